"""CTX's side of the lifecycle protocol v1: context artifacts, the hand-offs parked for one attempt each.

``ContextArtifacts`` is a base of ``workers.lifecycle.LifecycleControl``, which owns the collections and the
clock declared here (and sweeps expired artifacts with ``_retire_artifact``).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Awaitable, Callable, Mapping
from typing import Any
from uuid import UUID

from frontend.disaggregated_params import DisaggregatedParams
from frontend.errors import InvalidRequestError, OverloadedError
from frontend.trtllm.lifecycle import ArtifactState, ContextArtifactAbortRequest
from workers.lifecycle_entries import Artifact, LifecycleConflict, attempt_of, short_reason
from workers.lifecycle_settings import LifecycleSettings

ARTIFACT_EXPIRED = "context artifact expired"
ARTIFACT_SATURATED = "context artifact identity is terminal or replay protection is saturated"


class ContextArtifacts:
    """The artifacts a CTX worker holds, live and tombstones; what LifecycleControl provides is declared here."""

    settings: LifecycleSettings
    clock: Callable[[], float]
    artifacts: dict[str, Artifact]
    _live_artifacts: OrderedDict[str, Artifact]
    _artifact_tombstones: OrderedDict[str, Artifact]
    _release_handoff: Callable[[str, bytes], Awaitable[bool]]

    @property
    def incarnation(self) -> UUID:
        raise NotImplementedError  # LifecycleControl's

    def _saturated(self, entries: Mapping[Any, Any]) -> bool:
        raise NotImplementedError  # LifecycleControl's

    def _spawn(self, work: Awaitable[Any]) -> None:
        raise NotImplementedError  # LifecycleControl's

    def check_artifact(self, params: DisaggregatedParams) -> None:
        """A context_only request whose artifact was already aborted (cancel before create) is refused."""
        artifact = self.artifacts.get(str(params.prefill_artifact_id))
        if artifact is not None and artifact.state is not ArtifactState.ACTIVE:
            raise InvalidRequestError(f"context artifact is {artifact.state.value}: {artifact.reason}",
                                      param="disaggregated_params.prefill_artifact_id")
        if artifact is None and self._saturated(self.artifacts):  # refused before the prefill runs
            raise OverloadedError(ARTIFACT_SATURATED)

    def park(self, params: DisaggregatedParams, ctx_request_id: str, handoff_state: bytes | None) -> None:
        """The CTX answer parked a hand-off for this attempt: it is now the attempt's artifact. An abort that came
        while the prefill ran frees it right away."""
        key = str(params.prefill_artifact_id)
        artifact = self.artifacts.get(key)
        if artifact is not None and artifact.state is not ArtifactState.ACTIVE:
            if handoff_state is not None:
                self._spawn(self._release_handoff(ctx_request_id, handoff_state))
            raise InvalidRequestError(f"context artifact is {artifact.state.value}: {artifact.reason}",
                                      param="disaggregated_params.prefill_artifact_id")
        if artifact is None and self._saturated(self.artifacts):  # filled while this prefill ran
            if handoff_state is not None:
                self._spawn(self._release_handoff(ctx_request_id, handoff_state))
            raise OverloadedError(ARTIFACT_SATURATED)
        artifact = Artifact(key, attempt_of(params), ctx_request_id, handoff_state,
                            self.clock() + self.settings.artifact_ttl_s)
        self.artifacts[key] = artifact
        self._live_artifacts.pop(key, None)  # a repeat of a live key: its new expiry is the latest
        self._live_artifacts[key] = artifact

    async def abort_artifact(self, request: ContextArtifactAbortRequest) -> dict[str, Any]:
        if request.context_endpoint_incarnation != self.incarnation:
            raise LifecycleConflict("context artifact abort targets a stale endpoint incarnation")
        key = str(request.prefill_artifact_id)
        artifact = self.artifacts.get(key)
        if artifact is None:  # before its request came (or after it was forgotten): a tombstone refuses it
            if self._saturated(self.artifacts):
                return {"lifecycle_protocol_version": 1, "accepted": False, "state": ArtifactState.ABANDONED.value,
                        "reason": ARTIFACT_SATURATED, "context_endpoint_incarnation": str(self.incarnation)}
            artifact = self.artifacts[key] = Artifact(key, attempt_of(request))
            artifact.state, artifact.reason = ArtifactState.ABANDONED, short_reason(request.reason)
            artifact.retain_until = self.clock() + self.settings.replay_horizon_s
            self._artifact_tombstones[key] = artifact
        elif artifact.attempt != attempt_of(request):
            raise LifecycleConflict("context artifact abort does not match the artifact's transfer session")
        elif artifact.state is ArtifactState.ACTIVE:
            await self._retire_artifact(artifact, ArtifactState.ABANDONED, request.reason)
        return {"lifecycle_protocol_version": 1, "accepted": artifact.state is ArtifactState.ABANDONED,
                "state": artifact.state.value, "reason": artifact.reason,
                "context_endpoint_incarnation": str(self.incarnation)}

    async def _retire_artifact(self, artifact: Artifact, state: ArtifactState, reason: str) -> None:
        if artifact.state is not ArtifactState.ACTIVE:
            return
        key = artifact.key
        if self._live_artifacts.get(key) is artifact:
            del self._live_artifacts[key]
        artifact.state, artifact.reason = state, short_reason(reason)
        artifact.retain_until = self.clock() + self.settings.replay_horizon_s
        self._artifact_tombstones[key] = artifact
        state_bytes, artifact.handoff_state = artifact.handoff_state, None
        if artifact.ctx_request_id is not None and state_bytes is not None:
            # False when a GEN already took it: nothing left to free, which is fine.
            await self._release_handoff(artifact.ctx_request_id, state_bytes)
