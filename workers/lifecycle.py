"""A worker's side of TensorRT-LLM's lifecycle protocol v1: generation grants (GEN) and context artifacts (CTX).

TensorRT-LLM's orchestrator, run with ``TRTLLM_DISAGG_LIFECYCLE_PROTOCOL_VERSION=1``, admits every GEN leg with a
*grant* before sending it, renews it while the request runs, and aborts grants and CTX *artifacts* (the parked KV
of one attempt) on every failure path. What this module guarantees, and what the advertisement says it does:

- a generation_only request runs only under a live grant, checked before it reaches the engine (the submission
  fence / publication gate); a grant aborted or expired aborts the request bound to it and, if that request has
  not taken its KV yet, tells CTX to free it (a context-artifact abort to the grant's ``context_control_endpoint``);
- a CTX artifact is the hand-off parked for one attempt, keyed by its ``prefill_artifact_id``: an abort frees the
  KV at once, an artifact nobody aborted is freed after the artifact TTL (a GEN takes it within moments, since
  ours pulls the KV the moment its request starts) — the KV store's own TTL stays the backstop;
- every terminal outcome leaves a tombstone for the replay horizon, so a replayed call answers the same and an
  abort that arrives before its request (cancel before create) refuses that request when it comes. Entries, live and
  tombstones, are capped at ``replay_filter_capacity`` (TensorRT-LLM's, 262144): past it a new grant, artifact or
  abort-before-create is refused ("replay protection is saturated"), never a tombstone forgotten early.

Each collection is kept in order of expiry (one TTL for all, a monotonic clock; a renewed grant moves to the end),
so the sweeper and every new entry pop only what has expired, from the front, and the live grants are counted
without a scan.

Timekeeping uses one injectable clock, so a test moves time instead of sleeping.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Any, Literal
from uuid import UUID

import httpx

from frontend.disaggregated_params import DisaggregatedParams
from frontend.errors import InvalidRequestError, OverloadedError
from frontend.trtllm_identity import IDENTITY_FIELDS, has_identity
from frontend.trtllm_lifecycle import (
    ARTIFACT_TTL_ENV,
    CONTEXT_ARTIFACT_ABORT_PATH,
    DEFAULT_ARTIFACT_TTL_S,
    DEFAULT_GRANT_TTL_S,
    GENERATION_SAFE,
    GRANT_TTL_ENV,
    PROTOCOL_V1_REQUIRED_CAPABILITIES,
    ArtifactState,
    ContextArtifactAbortRequest,
    GenerationGrantAbortRequest,
    GenerationGrantDecisionResponse,
    GenerationGrantRenewRequest,
    GenerationGrantRequest,
    GrantState,
    LifecycleCapability,
    LifecycleNegotiationError,
    ScheduleStyle,
    TransceiverLifecycleAdvertisement,
    make_advertisement,
    negotiate,
    protocol_version_from_env,
)

logger = logging.getLogger(__name__)

Role = Literal["context", "generation", "both"]  # a worker's role (workers.serving uses this one)

GRANT_EXPIRED = "generation intent grant expired"
ARTIFACT_EXPIRED = "context artifact expired"
GRANT_SATURATED = "generation grant identity is terminal or replay protection is saturated"  # TensorRT-LLM's words
ARTIFACT_SATURATED = "context artifact identity is terminal or replay protection is saturated"
DEFAULT_REPLAY_FILTER_CAPACITY = 262144  # TensorRT-LLM's replay_filter_capacity

# What this worker does, in TensorRT-LLM's capability names (docs/interop.md says how each is met). Not advertised:
# IN_FLIGHT_CANCELLATION of a KV transfer already running (ours is one HTTP read, not cancellable mid-way),
# BOUNCE_TRANSFER, MULTI_WRITER and the parallelism ones (one writer, one rank).
CAPABILITIES = PROTOCOL_V1_REQUIRED_CAPABILITIES | {LifecycleCapability.DIRECT_TRANSFER.value,
                                                    LifecycleCapability.GENERATION_FIRST.value}


@dataclass(frozen=True, slots=True)
class LifecycleSettings:
    """``protocol_version`` 1 turns v1 on (TensorRT-LLM's env var or ``--lifecycle-protocol-version``)."""

    protocol_version: int = 0
    grant_ttl_s: float = DEFAULT_GRANT_TTL_S
    artifact_ttl_s: float = DEFAULT_ARTIFACT_TTL_S
    max_live_grants: int = 512
    replay_filter_capacity: int = DEFAULT_REPLAY_FILTER_CAPACITY  # live entries and tombstones, each role
    sweep_interval_s: float = 1.0
    generation_first_wait_s: float = 30.0  # how long a GEN that came first waits for its CTX's hand-off
    clock: Callable[[], float] = time.monotonic

    @property
    def enabled(self) -> bool:
        return self.protocol_version == GENERATION_SAFE

    @property
    def replay_horizon_s(self) -> float:
        return 2.0 * max(self.grant_ttl_s, self.artifact_ttl_s)  # TensorRT-LLM's default


def lifecycle_settings_from_env(environ: Mapping[str, str], protocol_version: int | None = None,
                                **overrides: Any) -> LifecycleSettings:
    """Settings as TensorRT-LLM's workers read them from the environment; an explicit flag wins over the env."""
    version = protocol_version if protocol_version is not None else protocol_version_from_env(environ)
    values: dict[str, Any] = {"protocol_version": version}
    for key, env in (("grant_ttl_s", GRANT_TTL_ENV), ("artifact_ttl_s", ARTIFACT_TTL_ENV)):
        if environ.get(env):
            values[key] = float(environ[env])
    values.update({k: v for k, v in overrides.items() if v is not None})
    for key in ("grant_ttl_s", "artifact_ttl_s"):
        if values.get(key, 1.0) <= 0:
            raise ValueError(f"{key} must be positive")
    return LifecycleSettings(**values)


@dataclass(slots=True)
class _Grant:
    request: GenerationGrantRequest
    expires_at: float
    state: GrantState = GrantState.ACTIVE
    reason: str = ""
    last_sequence: int = -1
    request_id: str | None = None  # the engine request bound to it
    handoff_taken: bool = False  # the bound request has its KV: CTX holds nothing more for it
    retain_until: float = 0.0
    ended: asyncio.Event | None = None  # set when the grant ends: wakes a request waiting under it


@dataclass(slots=True)
class _Artifact:
    identity: dict[str, Any]
    ctx_request_id: str | None = None
    handoff_state: bytes | None = None
    expires_at: float = 0.0
    state: ArtifactState = ArtifactState.ACTIVE
    reason: str = ""
    retain_until: float = 0.0


def _attempt(fields: Any) -> tuple[Any, ...]:
    """The attempt identity as comparable values (UUIDs and canonical strings alike)."""
    get = fields.get if isinstance(fields, Mapping) else lambda name: getattr(fields, name)
    return tuple(str(get(name)) for name in IDENTITY_FIELDS)


class LifecycleConflict(Exception):
    """A control call that contradicts what this worker holds: TensorRT-LLM answers 409 with the message."""


class LifecycleControl:
    """One worker's grants (GEN) or artifacts (CTX), with the sweeper that expires them."""

    def __init__(self, role: Role, settings: LifecycleSettings, *,
                 abort_request: Callable[[str], Awaitable[None]],
                 release_handoff: Callable[[str, bytes], Awaitable[bool]]) -> None:
        self.role = role
        self.settings = settings
        self.clock = settings.clock
        self._abort_request = abort_request
        self._release_handoff = release_handoff
        self.advertisement: TransceiverLifecycleAdvertisement | None = None
        if settings.enabled:
            self.advertisement = make_advertisement(protocol_version=GENERATION_SAFE, capabilities=CAPABILITIES,
                                                    instance_id=str(uuid.uuid4()))
        # Every entry, live or tombstone, for lookup; the live ones and the tombstones again, each in order of expiry.
        self.grants: dict[UUID, _Grant] = {}
        self._live_grants: OrderedDict[UUID, _Grant] = OrderedDict()
        self._grant_tombstones: OrderedDict[UUID, _Grant] = OrderedDict()
        self.artifacts: dict[str, _Artifact] = {}  # by prefill_artifact_id
        self._live_artifacts: OrderedDict[str, _Artifact] = OrderedDict()
        self._artifact_tombstones: OrderedDict[str, _Artifact] = OrderedDict()
        self._tasks: set[asyncio.Task[Any]] = set()
        self._sweeper: asyncio.Task[None] | None = None
        self._client: httpx.AsyncClient | None = None

    @property
    def enabled(self) -> bool:
        return self.advertisement is not None

    @property
    def live_grants(self) -> int:
        """Grants active now (what ``max_live_grants`` limits), counted as they are issued and retired."""
        return len(self._live_grants)

    @property
    def live_artifacts(self) -> int:
        return len(self._live_artifacts)

    @property
    def incarnation(self) -> UUID:
        assert self.advertisement is not None
        return self.advertisement.incarnation

    # -- start / stop ---------------------------------------------------------------------------------------
    def start(self) -> None:
        if self.enabled and self._sweeper is None:
            self._sweeper = asyncio.create_task(self._sweep_loop())

    async def aclose(self) -> None:
        sweeper, self._sweeper = self._sweeper, None
        if sweeper is not None:
            sweeper.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await sweeper
        if self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)
        if self._client is not None:
            await self._client.aclose()

    async def _sweep_loop(self) -> None:
        while True:
            await asyncio.sleep(self.settings.sweep_interval_s)
            try:
                await self.sweep()
            except Exception:  # the sweeper must outlive one bad entry
                logger.exception("lifecycle sweep failed")

    async def sweep(self) -> None:
        """Revoke expired grants, free expired artifacts, forget tombstones past the replay horizon: each from the
        front of its expiry order, so a sweep costs what has expired, not what is held."""
        now = self.clock()
        while self._live_grants:
            grant = next(iter(self._live_grants.values()))
            if now < grant.expires_at:
                break
            self._retire_grant(grant, GrantState.REVOKED, GRANT_EXPIRED)
        while self._live_artifacts:
            artifact = next(iter(self._live_artifacts.values()))
            if now < artifact.expires_at:
                break
            await self._retire_artifact(artifact, ArtifactState.ABANDONED, ARTIFACT_EXPIRED)
        self._forget_tombstones(now)

    def _forget_tombstones(self, now: float) -> None:
        _forget_expired(self._grant_tombstones, self.grants, now)
        _forget_expired(self._artifact_tombstones, self.artifacts, now)

    def _saturated(self, entries: Mapping[Any, Any]) -> bool:
        """No room for one more entry, once what has expired is forgotten: refuse rather than forget early."""
        if len(entries) < self.settings.replay_filter_capacity:
            return False
        self._forget_tombstones(self.clock())
        return len(entries) >= self.settings.replay_filter_capacity

    # -- GEN: grants ------------------------------------------------------------------------------------------
    def issue(self, request: GenerationGrantRequest, endpoint_name: str) -> GenerationGrantDecisionResponse:
        """Admit one attempt (TensorRT-LLM's ``issue_generation_grant``). A refusal is ``accepted: false``; a
        contradiction of an earlier grant raises ``LifecycleConflict`` (409)."""
        local = self.advertisement
        assert local is not None
        try:
            negotiate(request.context_transceiver_lifecycle, local, schedule_style=request.schedule_style,
                      ctx_dp_rank=request.ctx_dp_rank)
        except (LifecycleNegotiationError, ValueError) as error:
            return GenerationGrantDecisionResponse(lifecycle_protocol_version=1, accepted=False, reason=str(error))
        now = self.clock()
        existing = self.grants.get(request.consumer_grant_id)
        if existing is not None:
            if existing.request.transfer_session_id != request.transfer_session_id:
                raise LifecycleConflict("consumer_grant_id was replayed for a different transfer session")
            if existing.request.model_dump(exclude={"ttl_s"}) != request.model_dump(exclude={"ttl_s"}):
                raise LifecycleConflict("consumer_grant_id was replayed with different admission facts")
            if existing.state is not GrantState.ACTIVE:
                return GenerationGrantDecisionResponse(
                    lifecycle_protocol_version=1, accepted=False,
                    reason=existing.reason or "generation grant is already terminal")
            return self._decision(existing, endpoint_name, now)  # a replay: the same grant, its original expiry
        if self._saturated(self.grants):
            return GenerationGrantDecisionResponse(lifecycle_protocol_version=1, accepted=False,
                                                   reason=GRANT_SATURATED)
        if self.live_grants >= self.settings.max_live_grants:
            return GenerationGrantDecisionResponse(lifecycle_protocol_version=1, accepted=False,
                                                   reason="generation admission credit is exhausted")
        # The worker's own TTL, not the one asked for: only the worker decides how long it holds credit.
        grant = _Grant(request, now + self.settings.grant_ttl_s)
        self.grants[request.consumer_grant_id] = grant
        self._live_grants[request.consumer_grant_id] = grant  # the latest expiry: the end of the order
        return self._decision(grant, endpoint_name, now)

    def _decision(self, grant: _Grant, endpoint_name: str, now: float) -> GenerationGrantDecisionResponse:
        return GenerationGrantDecisionResponse(
            lifecycle_protocol_version=1, accepted=True, generation_endpoint_name=endpoint_name,
            generation_endpoint_rank=0, generation_endpoint_incarnation=self.incarnation,
            generation_transceiver_lifecycle=self.advertisement, ttl_s=max(grant.expires_at - now, 1e-6))

    def _known_grant(self, request: GenerationGrantRenewRequest | GenerationGrantAbortRequest) -> _Grant:
        grant = self.grants.get(request.consumer_grant_id)
        if grant is None:
            raise LifecycleConflict(f"generation grant {request.consumer_grant_id} has no admitted transfer session")
        if _attempt(grant.request) != _attempt(request) or request.generation_endpoint_incarnation != \
                self.incarnation or request.generation_endpoint_rank != 0:
            raise LifecycleConflict("generation grant identity does not match the admitted transfer session")
        return grant

    def renew(self, request: GenerationGrantRenewRequest) -> dict[str, Any]:
        grant = self._known_grant(request)
        now = self.clock()
        if grant.state is GrantState.ACTIVE and now >= grant.expires_at:
            self._retire_grant(grant, GrantState.REVOKED, GRANT_EXPIRED)
        if grant.state is not GrantState.ACTIVE:
            return {"lifecycle_protocol_version": 1, "accepted": False, "state": grant.state.value,
                    "reason": grant.reason}
        if request.sequence > grant.last_sequence:  # an older or repeated sequence changes nothing
            grant.last_sequence = request.sequence
            grant.expires_at = now + self.settings.grant_ttl_s
            self._live_grants.move_to_end(request.consumer_grant_id)  # now the latest expiry
        return {"lifecycle_protocol_version": 1, "accepted": True, "state": GrantState.ACTIVE.value,
                "reason": "", "ttl_s": max(grant.expires_at - now, 1e-6)}

    def abort(self, request: GenerationGrantAbortRequest) -> dict[str, Any]:
        grant = self._known_grant(request)
        if grant.state is GrantState.RELEASED:
            raise LifecycleConflict("cannot revoke a grant that was already released")
        if grant.state is GrantState.ACTIVE:
            self._retire_grant(grant, GrantState.REVOKED, request.reason)
        return {"lifecycle_protocol_version": 1, "accepted": True, "state": GrantState.REVOKED.value,
                "reason": grant.reason}

    def _retire_grant(self, grant: _Grant, state: GrantState, reason: str) -> None:
        if grant.state is not GrantState.ACTIVE:
            return
        grant_id = grant.request.consumer_grant_id
        self._live_grants.pop(grant_id, None)
        grant.state, grant.reason = state, reason
        grant.retain_until = self.clock() + self.settings.replay_horizon_s
        self._grant_tombstones[grant_id] = grant
        if grant.ended is not None:
            grant.ended.set()
        if state is GrantState.RELEASED:
            return
        if grant.request_id is not None:
            self._spawn(self._abort_request(grant.request_id))
        if not grant.handoff_taken:  # CTX still holds the KV for this attempt: tell it to free it
            self._spawn(self._abort_context_artifact(grant.request, reason))

    async def _abort_context_artifact(self, request: GenerationGrantRequest, reason: str) -> None:
        endpoint = request.context_control_endpoint
        if not endpoint:
            return
        url = (endpoint if endpoint.startswith(("http://", "https://")) else "http://" + endpoint).rstrip("/")
        body = ContextArtifactAbortRequest(
            lifecycle_protocol_version=1, **{name: getattr(request, name) for name in IDENTITY_FIELDS},
            context_endpoint_incarnation=request.context_transceiver_lifecycle.incarnation, reason=reason)
        try:
            reply = await self.http().post(url + CONTEXT_ARTIFACT_ABORT_PATH, json=body.model_dump(mode="json"))
            if reply.status_code != 200:
                logger.warning("context artifact abort at %s answered %d: %s", url, reply.status_code,
                               reply.text[:200])
        except httpx.HTTPError as error:  # CTX's own artifact TTL frees it anyway
            logger.warning("context artifact abort at %s failed: %s", url, error)

    def http(self) -> httpx.AsyncClient:
        """The worker's one pooled client to its peers (artifact aborts, generation-first hand-offs)."""
        if self._client is None:
            self._client = httpx.AsyncClient(timeout=10.0)
        return self._client

    def _spawn(self, work: Awaitable[Any]) -> None:
        task = asyncio.ensure_future(work)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def bind(self, params: DisaggregatedParams, request_id: str) -> UUID:
        """Bind a generation_only request to its live grant (checked again: it may have expired since
        ``check_request``); returns the grant's id for ``finish``."""
        grant = self._live_grant(params)
        grant.request_id = request_id
        grant.ended = asyncio.Event()
        return grant.request.consumer_grant_id

    async def until_ended(self, grant_id: UUID) -> None:
        """Returns once the grant is no longer active (aborted, expired, released)."""
        grant = self.grants.get(grant_id)
        if grant is not None and grant.ended is not None and grant.state is GrantState.ACTIVE:
            await grant.ended.wait()

    def _live_grant(self, params: DisaggregatedParams) -> _Grant:
        grant_id = UUID(str(params.consumer_grant_id))
        grant = self.grants.get(grant_id)
        if grant is None:
            raise InvalidRequestError(f"generation grant {grant_id} has no admitted transfer session",
                                      param="disaggregated_params.consumer_grant_id")
        if _attempt(grant.request) != _attempt(params.model_dump()):
            raise InvalidRequestError("generation grant identity does not match the admitted transfer session",
                                      param="disaggregated_params.consumer_grant_id")
        if grant.state is GrantState.ACTIVE and self.clock() >= grant.expires_at:
            self._retire_grant(grant, GrantState.REVOKED, GRANT_EXPIRED)
            raise InvalidRequestError("generation intent grant expired before scheduler submission",
                                      param="disaggregated_params.consumer_grant_id")
        if grant.state is not GrantState.ACTIVE:
            raise InvalidRequestError(f"generation grant is {grant.state.value}: {grant.reason}",
                                      param="disaggregated_params.consumer_grant_id")
        if grant.request_id is not None:
            raise InvalidRequestError("generation grant is already bound to a request",
                                      param="disaggregated_params.consumer_grant_id")
        return grant

    def ensure_live(self, grant_id: UUID) -> None:
        """A bound grant still holds (checked again after a wait, before the engine is asked)."""
        grant = self.grants.get(grant_id)
        if grant is not None and grant.state is GrantState.ACTIVE and self.clock() >= grant.expires_at:
            self._retire_grant(grant, GrantState.REVOKED, GRANT_EXPIRED)
        if grant is None or grant.state is not GrantState.ACTIVE:
            reason = grant.reason if grant is not None else "unknown"
            raise InvalidRequestError(f"generation grant is no longer active: {reason}",
                                      param="disaggregated_params.consumer_grant_id")

    def handoff_taken(self, grant_id: UUID) -> None:
        grant = self.grants.get(grant_id)
        if grant is not None:
            grant.handoff_taken = True

    def finish(self, grant_id: UUID, ok: bool) -> None:
        """The bound request ended: a success releases the grant, anything else revokes it (and frees CTX's KV
        if the request never took it)."""
        grant = self.grants.get(grant_id)
        if grant is None or grant.state is not GrantState.ACTIVE:
            return
        if ok:
            self._retire_grant(grant, GrantState.RELEASED, "generation request finished")
        else:
            self._retire_grant(grant, GrantState.REVOKED, "generation request failed")

    # -- CTX: artifacts ---------------------------------------------------------------------------------------
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
        artifact = _Artifact(_identity_of(params), ctx_request_id, handoff_state,
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
            artifact = self.artifacts[key] = _Artifact(_identity_of(request))
            artifact.state, artifact.reason = ArtifactState.ABANDONED, request.reason
            artifact.retain_until = self.clock() + self.settings.replay_horizon_s
            self._artifact_tombstones[key] = artifact
        elif _attempt(artifact.identity) != _attempt(request):
            raise LifecycleConflict("context artifact abort does not match the artifact's transfer session")
        elif artifact.state is ArtifactState.ACTIVE:
            await self._retire_artifact(artifact, ArtifactState.ABANDONED, request.reason)
        return {"lifecycle_protocol_version": 1, "accepted": artifact.state is ArtifactState.ABANDONED,
                "state": artifact.state.value, "reason": artifact.reason,
                "context_endpoint_incarnation": str(self.incarnation)}

    async def _retire_artifact(self, artifact: _Artifact, state: ArtifactState, reason: str) -> None:
        if artifact.state is not ArtifactState.ACTIVE:
            return
        key = str(artifact.identity["prefill_artifact_id"])
        if self._live_artifacts.get(key) is artifact:
            del self._live_artifacts[key]
        artifact.state, artifact.reason = state, reason
        artifact.retain_until = self.clock() + self.settings.replay_horizon_s
        self._artifact_tombstones[key] = artifact
        state_bytes, artifact.handoff_state = artifact.handoff_state, None
        if artifact.ctx_request_id is not None and state_bytes is not None:
            # False when a GEN already took it: nothing left to free, which is fine.
            await self._release_handoff(artifact.ctx_request_id, state_bytes)


def _forget_expired(tombstones: OrderedDict[Any, Any], entries: dict[Any, Any], now: float) -> None:
    """Pop the tombstones past their replay horizon, from the front of their order of expiry."""
    while tombstones:
        key, entry = next(iter(tombstones.items()))
        if now < entry.retain_until:
            return
        del tombstones[key]
        if entries.get(key) is entry:
            del entries[key]


def _identity_of(fields: Any) -> dict[str, Any]:
    get = fields.get if isinstance(fields, Mapping) else lambda name: getattr(fields, name)
    return {name: str(get(name)) if name not in ("logical_request_id", "artifact_version") else get(name)
            for name in IDENTITY_FIELDS}


def check_request(params: DisaggregatedParams | None, role: Role, control: LifecycleControl) -> None:
    """TensorRT-LLM's ``_validate_disagg_before_submit``: what a cross-side request must carry for this worker's
    protocol version. Local-only requests (no params, ``context_and_generation``) always pass."""
    if params is None or params.request_type not in ("context_only", "generation_only"):
        return
    fields = params.model_dump()
    if not control.enabled:
        if has_identity(fields):
            raise InvalidRequestError("generation-safe request reached a qualified-legacy transceiver without "
                                      "protocol-v1 support", param="disaggregated_params")
        return
    if any(fields.get(name) is None for name in IDENTITY_FIELDS):
        raise InvalidRequestError("protocol-v1 cross-side request is missing its negotiated attempt identity",
                                  param="disaggregated_params")
    if params.context_transceiver_lifecycle is None:
        raise InvalidRequestError("protocol-v1 cross-side request is missing the selected context transceiver "
                                  "lifecycle", param="disaggregated_params.context_transceiver_lifecycle")
    if params.context_control_endpoint is None:
        raise InvalidRequestError("protocol-v1 cross-side request is missing the selected context lifecycle-control "
                                  "endpoint", param="disaggregated_params.context_control_endpoint")
    expected = {"context_only": "CONTEXT", "generation_only": "GENERATION"}[params.request_type]
    actual = {"context": "CONTEXT", "generation": "GENERATION", "both": "CONTEXT_AND_GENERATION"}[role]
    if expected != actual:
        raise InvalidRequestError(f"protocol-v1 {params.request_type} request reached {actual} server; expected "
                                  f"{expected}", param="disaggregated_params.request_type")
    if params.request_type == "context_only":
        if params.context_transceiver_lifecycle != control.advertisement:
            raise InvalidRequestError("selected context transceiver lifecycle does not match the current context "
                                      "endpoint incarnation",
                                      param="disaggregated_params.context_transceiver_lifecycle")
        control.check_artifact(params)
    else:
        control._live_grant(params)  # unknown, expired or aborted grants stop here, before the engine
    if params.schedule_style not in (None, ScheduleStyle.CONTEXT_FIRST, ScheduleStyle.GENERATION_FIRST):
        raise InvalidRequestError(f"unsupported disaggregated schedule style {params.schedule_style!r}",
                                  param="disaggregated_params.schedule_style")
