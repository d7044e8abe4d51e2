"""CTX's side of TensorRT-LLM's lifecycle protocol v1: context artifacts, the hand-offs parked for one attempt each,
owned by ``workers.trtllm.lifecycle.LifecycleControl``. An abort frees the KV at once; an artifact nobody aborted is
freed after the artifact TTL; every end leaves a tombstone for the replay horizon (cancel before create refuses)."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Awaitable, Callable
from typing import Any
from uuid import UUID

from frontend.disaggregated_params import DisaggregatedParams
from frontend.errors import InvalidRequestError, OverloadedError
from frontend.trtllm.lifecycle import ArtifactState, ContextArtifactAbortRequest
from workers.trtllm.entries import Artifact, LifecycleConflict, attempt_of, forget_expired, short_reason
from workers.trtllm.settings import LifecycleSettings

ARTIFACT_EXPIRED = "context artifact expired"
ARTIFACT_SATURATED = "context artifact identity is terminal or replay protection is saturated"


class ContextArtifacts:
    """The artifacts a CTX worker holds, live and tombstones, each kept in order of expiry."""

    def __init__(self, settings: LifecycleSettings, incarnation: UUID | None, *,
                 release_handoff: Callable[[str, bytes], Awaitable[bool]],
                 spawn: Callable[[Awaitable[Any]], None]) -> None:
        """``incarnation``: this endpoint's (its advertisement's; None while v1 is off); ``spawn`` runs work in the
        background on the owner's tasks."""
        self.settings = settings
        self.clock = settings.clock
        self.incarnation = incarnation
        self._release_handoff = release_handoff
        self._spawn = spawn
        self.entries: dict[str, Artifact] = {}  # by prefill_artifact_id, live or tombstone
        self._live: OrderedDict[str, Artifact] = OrderedDict()
        self._tombstones: OrderedDict[str, Artifact] = OrderedDict()

    @property
    def live(self) -> int:
        return len(self._live)

    async def sweep(self, now: float) -> None:
        """Free what has expired and forget tombstones past the replay horizon, from the front of each order."""
        while self._live:
            artifact = next(iter(self._live.values()))
            if now < artifact.expires_at:
                break
            await self._retire(artifact, ArtifactState.ABANDONED, ARTIFACT_EXPIRED)
        self.forget_tombstones(now)

    def forget_tombstones(self, now: float) -> None:
        forget_expired(self._tombstones, self.entries, now)

    def _saturated(self) -> bool:
        """No room for one more entry, once what has expired is forgotten: refuse rather than forget early."""
        if len(self.entries) < self.settings.replay_filter_capacity:
            return False
        self.forget_tombstones(self.clock())
        return len(self.entries) >= self.settings.replay_filter_capacity

    def check(self, params: DisaggregatedParams) -> None:
        """A context_only request whose artifact was already aborted (cancel before create) is refused."""
        artifact = self.entries.get(str(params.prefill_artifact_id))
        if artifact is not None and artifact.state is not ArtifactState.ACTIVE:
            raise InvalidRequestError(f"context artifact is {artifact.state.value}: {artifact.reason}",
                                      param="disaggregated_params.prefill_artifact_id")
        if artifact is None and self._saturated():  # refused before the prefill runs
            raise OverloadedError(ARTIFACT_SATURATED)

    def park(self, params: DisaggregatedParams, ctx_request_id: str, handoff_state: bytes | None) -> None:
        """The CTX answer parked a hand-off for this attempt: it is now the attempt's artifact. An abort that came
        while the prefill ran frees it right away."""
        key = str(params.prefill_artifact_id)
        artifact = self.entries.get(key)
        if artifact is not None and artifact.state is not ArtifactState.ACTIVE:
            if handoff_state is not None:
                self._spawn(self._release_handoff(ctx_request_id, handoff_state))
            raise InvalidRequestError(f"context artifact is {artifact.state.value}: {artifact.reason}",
                                      param="disaggregated_params.prefill_artifact_id")
        if artifact is None and self._saturated():  # filled while this prefill ran
            if handoff_state is not None:
                self._spawn(self._release_handoff(ctx_request_id, handoff_state))
            raise OverloadedError(ARTIFACT_SATURATED)
        artifact = Artifact(key, attempt_of(params), ctx_request_id, handoff_state,
                            self.clock() + self.settings.artifact_ttl_s)
        self.entries[key] = artifact
        self._live.pop(key, None)  # a repeat of a live key: its new expiry is the latest
        self._live[key] = artifact

    async def abort(self, request: ContextArtifactAbortRequest) -> dict[str, Any]:
        if request.context_endpoint_incarnation != self.incarnation:
            raise LifecycleConflict("context artifact abort targets a stale endpoint incarnation")
        key = str(request.prefill_artifact_id)
        artifact = self.entries.get(key)
        if artifact is None:  # before its request came (or after it was forgotten): a tombstone refuses it
            if self._saturated():
                return {"lifecycle_protocol_version": 1, "accepted": False, "state": ArtifactState.ABANDONED.value,
                        "reason": ARTIFACT_SATURATED, "context_endpoint_incarnation": str(self.incarnation)}
            artifact = self.entries[key] = Artifact(key, attempt_of(request))
            artifact.state, artifact.reason = ArtifactState.ABANDONED, short_reason(request.reason)
            artifact.retain_until = self.clock() + self.settings.replay_horizon_s
            self._tombstones[key] = artifact
        elif artifact.attempt != attempt_of(request):
            raise LifecycleConflict("context artifact abort does not match the artifact's transfer session")
        elif artifact.state is ArtifactState.ACTIVE:
            await self._retire(artifact, ArtifactState.ABANDONED, request.reason)
        return {"lifecycle_protocol_version": 1, "accepted": artifact.state is ArtifactState.ABANDONED,
                "state": artifact.state.value, "reason": artifact.reason,
                "context_endpoint_incarnation": str(self.incarnation)}

    async def _retire(self, artifact: Artifact, state: ArtifactState, reason: str) -> None:
        if artifact.state is not ArtifactState.ACTIVE:
            return
        key = artifact.key
        if self._live.get(key) is artifact:
            del self._live[key]
        artifact.state, artifact.reason = state, short_reason(reason)
        artifact.retain_until = self.clock() + self.settings.replay_horizon_s
        self._tombstones[key] = artifact
        state_bytes, artifact.handoff_state = artifact.handoff_state, None
        if artifact.ctx_request_id is not None and state_bytes is not None:
            # False when a GEN already took it: nothing left to free, which is fine.
            await self._release_handoff(artifact.ctx_request_id, state_bytes)
