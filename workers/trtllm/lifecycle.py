"""A worker's side of TensorRT-LLM's lifecycle protocol v1: the generation grants a GEN admits its requests under,
and (``workers.trtllm.artifacts``) the context artifacts a CTX parks its hand-offs as.

A GEN request runs only under a live grant, checked before it reaches the engine; a grant that is aborted, expires
or is never bound within its admission lease frees its credit, aborts its request and, if the KV was not taken yet,
tells CTX to free it. Every end leaves a tombstone (digests only, ``workers.trtllm.entries``) for the replay
horizon, up to ``replay_filter_capacity``: past it new work is refused, never a tombstone forgotten early. Each
collection is kept in order of expiry, so a sweep pops only what has expired; one injectable clock keeps time.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import uuid
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Mapping
from typing import Any
from uuid import UUID

import httpx

from frontend.disaggregated_params import DisaggregatedParams
from frontend.errors import InvalidRequestError
from frontend.trtllm.identity import IDENTITY_FIELDS
from frontend.trtllm.lifecycle import (
    CONTEXT_ARTIFACT_ABORT_PATH,
    GENERATION_SAFE,
    PROTOCOL_V1_REQUIRED_CAPABILITIES,
    ContextArtifactAbortRequest,
    GenerationGrantAbortRequest,
    GenerationGrantDecisionResponse,
    GenerationGrantRenewRequest,
    GenerationGrantRequest,
    GrantState,
    LifecycleCapability,
    LifecycleNegotiationError,
    TransceiverLifecycleAdvertisement,
    control_url,
    make_advertisement,
    negotiate,
)
from workers.settings import Role
from workers.trtllm.artifacts import ContextArtifacts
from workers.trtllm.entries import (
    Grant,
    LifecycleConflict,
    admission_facts,
    attempt_of,
    forget_expired,
    short_reason,
)
from workers.trtllm.settings import LifecycleSettings

logger = logging.getLogger("disagg_serve.worker.trtllm_lifecycle")

GRANT_EXPIRED = "generation intent grant expired"
GRANT_SATURATED = "generation grant identity is terminal or replay protection is saturated"  # TensorRT-LLM's words
GRANT_UNUSED = "generation grant was not bound to a request within its admission lease"
GRANT_HOARDED = "this caller holds too many generation grants not yet bound to a request"

# The calls this worker makes on a grant's behalf (context-artifact aborts): a few at a time, each short. Pending ones
# past _CONTROL_BACKLOG are dropped (CTX's artifact TTL frees the KV anyway).
_CONTROL_CONCURRENCY = 8
_CONTROL_BACKLOG = 1024
_CONTROL_TIMEOUT = httpx.Timeout(5.0, connect=2.0)

# What this worker does, in TensorRT-LLM's capability names (docs/interop.md says how each is met). Not advertised:
# IN_FLIGHT_CANCELLATION of a KV transfer already running (ours is one HTTP read, not cancellable mid-way),
# BOUNCE_TRANSFER, MULTI_WRITER and the parallelism ones (one writer, one rank).
CAPABILITIES = PROTOCOL_V1_REQUIRED_CAPABILITIES | {LifecycleCapability.DIRECT_TRANSFER.value,
                                                    LifecycleCapability.GENERATION_FIRST.value}


class LifecycleControl:
    """One worker's grants (GEN) and its context artifacts (CTX, ``artifacts``), with the sweeper that expires them."""

    def __init__(self, role: Role, settings: LifecycleSettings, *,
                 abort_request: Callable[[str], Awaitable[None]],
                 release_handoff: Callable[[str, bytes], Awaitable[bool]],
                 peer_headers: Mapping[str, str] | None = None) -> None:
        """``peer_headers``: what proves this worker is one of the deployment's on its calls to its peers (the
        deployment secret's header), sent on every one."""
        self.role = role
        self.peer_headers = dict(peer_headers or {})
        self.settings = settings
        self.clock = settings.clock
        self._abort_request = abort_request
        self._release_handoff = release_handoff
        self.advertisement: TransceiverLifecycleAdvertisement | None = None
        if settings.enabled:
            self.advertisement = make_advertisement(protocol_version=GENERATION_SAFE, capabilities=CAPABILITIES,
                                                    instance_id=str(uuid.uuid4()))
        # Every entry, live or tombstone, for lookup; the live ones and the tombstones again, each in order of expiry.
        self.grants: dict[UUID, Grant] = {}
        self._live_grants: OrderedDict[UUID, Grant] = OrderedDict()
        self._unbound: OrderedDict[UUID, Grant] = OrderedDict()  # live, no request yet: in order of bind_by
        self._unbound_by_caller: dict[str, int] = {}
        self._grant_tombstones: OrderedDict[UUID, Grant] = OrderedDict()
        self._tasks: set[asyncio.Task[Any]] = set()
        self.artifacts = ContextArtifacts(settings, self.advertisement.incarnation if self.advertisement else None,
                                          release_handoff=release_handoff, spawn=self._spawn)
        self._sweeper: asyncio.Task[None] | None = None
        self._client: httpx.AsyncClient | None = None
        self._control_client: httpx.AsyncClient | None = None
        self._control_slots = asyncio.Semaphore(_CONTROL_CONCURRENCY)
        self._control_pending = 0
        self._control_tasks: set[asyncio.Task[None]] = set()  # cancelled at shutdown, not waited out

    @property
    def enabled(self) -> bool:
        return self.advertisement is not None

    @property
    def live_grants(self) -> int:
        """Grants active now (what ``max_live_grants`` limits), counted as they are issued and retired."""
        return len(self._live_grants)

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
        for task in self._control_tasks:  # aborts still queued or waiting on a CTX: its artifact TTL frees the KV
            task.cancel()
        if self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)
        for client in (self._client, self._control_client):
            if client is not None:
                await client.aclose()

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
        while self._unbound:
            grant = next(iter(self._unbound.values()))
            if now < grant.bind_by:
                break
            self._retire_grant(grant, GrantState.REVOKED, GRANT_UNUSED)
        while self._live_grants:
            grant = next(iter(self._live_grants.values()))
            if now < grant.expires_at:
                break
            self._retire_grant(grant, GrantState.REVOKED, GRANT_EXPIRED)
        forget_expired(self._grant_tombstones, self.grants, now)
        await self.artifacts.sweep(now)

    def _saturated(self) -> bool:
        """No room for one more grant, once what has expired is forgotten: refuse rather than forget early."""
        if len(self.grants) < self.settings.replay_filter_capacity:
            return False
        forget_expired(self._grant_tombstones, self.grants, self.clock())
        return len(self.grants) >= self.settings.replay_filter_capacity

    # -- GEN: grants ------------------------------------------------------------------------------------------
    def issue(self, request: GenerationGrantRequest, endpoint_name: str,
              caller: str | None = None) -> GenerationGrantDecisionResponse:
        """Admit one attempt (TensorRT-LLM's ``issue_generation_grant``) for ``caller``: an unauthenticated caller's
        peer address, its unbound grants capped; None for an authenticated one. A refusal is ``accepted: false``; a
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
            if existing.transfer_session_id != request.transfer_session_id:
                raise LifecycleConflict("consumer_grant_id was replayed for a different transfer session")
            if existing.facts != admission_facts(request):
                raise LifecycleConflict("consumer_grant_id was replayed with different admission facts")
            if existing.state is not GrantState.ACTIVE:
                return GenerationGrantDecisionResponse(
                    lifecycle_protocol_version=1, accepted=False,
                    reason=existing.reason or "generation grant is already terminal")
            return self._decision(existing, endpoint_name, now)  # a replay: the same grant, its original expiry
        if self._saturated():
            return GenerationGrantDecisionResponse(lifecycle_protocol_version=1, accepted=False,
                                                   reason=GRANT_SATURATED)
        if request.context_control_endpoint is not None:
            try:  # refused now, not met later when an abort would POST to it
                control_url(request.context_control_endpoint, CONTEXT_ARTIFACT_ABORT_PATH)
            except ValueError as error:
                return GenerationGrantDecisionResponse(lifecycle_protocol_version=1, accepted=False,
                                                       reason=str(error))
        if self.live_grants >= self.settings.max_live_grants:
            return GenerationGrantDecisionResponse(lifecycle_protocol_version=1, accepted=False,
                                                   reason="generation admission credit is exhausted")
        if caller is not None and self._unbound_by_caller.get(caller, 0) >= self.settings.unbound_grants_per_caller:
            return GenerationGrantDecisionResponse(lifecycle_protocol_version=1, accepted=False,
                                                   reason=GRANT_HOARDED)
        # The worker's own TTL, not the one asked for: only the worker decides how long it holds credit.
        grant = Grant(request.consumer_grant_id, request, attempt_of(request), admission_facts(request),
                      request.transfer_session_id, now + self.settings.grant_ttl_s,
                      bind_by=now + self.settings.grant_bind_lease_s, caller=caller)
        self.grants[request.consumer_grant_id] = grant
        self._live_grants[request.consumer_grant_id] = grant  # the latest expiry: the end of the order
        self._unbound[request.consumer_grant_id] = grant  # the latest bind_by: the end of that order
        if caller is not None:
            self._unbound_by_caller[caller] = self._unbound_by_caller.get(caller, 0) + 1
        return self._decision(grant, endpoint_name, now)

    @staticmethod
    def _deadline(grant: Grant) -> float:
        """When the grant ends unless renewed (or, unbound, unless bound): what its holder is told as ``ttl_s``."""
        return grant.expires_at if grant.request_id is not None else min(grant.expires_at, grant.bind_by)

    def _expire_if_due(self, grant: Grant, now: float) -> bool:
        """Retire an active grant whose TTL or admission lease has passed (the sweeper may not have come by yet)."""
        if grant.state is not GrantState.ACTIVE:
            return False
        if now >= grant.expires_at:
            self._retire_grant(grant, GrantState.REVOKED, GRANT_EXPIRED)
            return True
        if grant.request_id is None and now >= grant.bind_by:
            self._retire_grant(grant, GrantState.REVOKED, GRANT_UNUSED)
            return True
        return False

    def _decision(self, grant: Grant, endpoint_name: str, now: float) -> GenerationGrantDecisionResponse:
        return GenerationGrantDecisionResponse(
            lifecycle_protocol_version=1, accepted=True, generation_endpoint_name=endpoint_name,
            generation_endpoint_rank=0, generation_endpoint_incarnation=self.incarnation,
            generation_transceiver_lifecycle=self.advertisement, ttl_s=max(self._deadline(grant) - now, 1e-6))

    def _known_grant(self, request: GenerationGrantRenewRequest | GenerationGrantAbortRequest) -> Grant:
        grant = self.grants.get(request.consumer_grant_id)
        if grant is None:
            raise LifecycleConflict(f"generation grant {request.consumer_grant_id} has no admitted transfer session")
        if grant.attempt != attempt_of(request) or request.generation_endpoint_incarnation != \
                self.incarnation or request.generation_endpoint_rank != 0:
            raise LifecycleConflict("generation grant identity does not match the admitted transfer session")
        return grant

    def renew(self, request: GenerationGrantRenewRequest) -> dict[str, Any]:
        grant = self._known_grant(request)
        now = self.clock()
        self._expire_if_due(grant, now)
        if grant.state is not GrantState.ACTIVE:
            return {"lifecycle_protocol_version": 1, "accepted": False, "state": grant.state.value,
                    "reason": grant.reason}
        if request.sequence > grant.last_sequence:  # an older or repeated sequence changes nothing
            grant.last_sequence = request.sequence
            grant.expires_at = now + self.settings.grant_ttl_s
            self._live_grants.move_to_end(request.consumer_grant_id)  # now the latest expiry
        return {"lifecycle_protocol_version": 1, "accepted": True, "state": GrantState.ACTIVE.value,
                "reason": "", "ttl_s": max(self._deadline(grant) - now, 1e-6)}

    def abort(self, request: GenerationGrantAbortRequest) -> dict[str, Any]:
        grant = self._known_grant(request)
        if grant.state is GrantState.RELEASED:
            raise LifecycleConflict("cannot revoke a grant that was already released")
        if grant.state is GrantState.ACTIVE:
            self._retire_grant(grant, GrantState.REVOKED, request.reason)
        return {"lifecycle_protocol_version": 1, "accepted": True, "state": GrantState.REVOKED.value,
                "reason": grant.reason}

    def _retire_grant(self, grant: Grant, state: GrantState, reason: str) -> None:
        if grant.state is not GrantState.ACTIVE:
            return
        grant_id = grant.grant_id
        self._live_grants.pop(grant_id, None)
        self._forget_unbound(grant)
        grant.state, grant.reason = state, short_reason(reason)
        grant.retain_until = self.clock() + self.settings.replay_horizon_s
        self._grant_tombstones[grant_id] = grant
        request, grant.request = grant.request, None  # a tombstone keeps digests, not the caller's request
        if grant.ended is not None:
            grant.ended.set()
        if state is GrantState.RELEASED:
            return
        if grant.request_id is not None:
            self._spawn(self._abort_request(grant.request_id))
        if not grant.handoff_taken and request is not None:  # CTX still holds the KV for this attempt: free it
            self._abort_context_artifact(request, grant.reason)

    def _forget_unbound(self, grant: Grant) -> None:
        if self._unbound.pop(grant.grant_id, None) is None or grant.caller is None:
            return
        left = self._unbound_by_caller.get(grant.caller, 1) - 1
        if left > 0:
            self._unbound_by_caller[grant.caller] = left
        else:
            self._unbound_by_caller.pop(grant.caller, None)
        grant.caller = None

    def _abort_context_artifact(self, request: GenerationGrantRequest, reason: str) -> None:
        """Tell the grant's CTX to free the KV it parked for the attempt, in the background, on the control client.
        Past ``_CONTROL_BACKLOG`` pending calls the call is dropped: CTX's own artifact TTL frees it anyway."""
        endpoint = request.context_control_endpoint
        if not endpoint:
            return
        try:
            url = control_url(endpoint, CONTEXT_ARTIFACT_ABORT_PATH)
        except ValueError as error:  # refused at issue; a grant from before that check cannot name one either
            logger.warning("context artifact abort not sent: %s", error)
            return
        if self._control_pending >= _CONTROL_BACKLOG:
            logger.warning("context artifact abort to %s dropped: %d aborts already pending", url,
                           self._control_pending)
            return
        body = ContextArtifactAbortRequest(
            lifecycle_protocol_version=1, **{name: getattr(request, name) for name in IDENTITY_FIELDS},
            context_endpoint_incarnation=request.context_transceiver_lifecycle.incarnation, reason=reason)
        self._control_pending += 1
        task = asyncio.ensure_future(self._post_control(url, body.model_dump(mode="json")))
        self._tasks.add(task)
        self._control_tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        task.add_done_callback(self._control_tasks.discard)

    async def _post_control(self, url: str, body: dict[str, Any]) -> None:
        try:
            async with self._control_slots:
                reply = await self.control_http().post(url, json=body)
            if reply.status_code != 200:
                logger.warning("context artifact abort at %s answered %d: %s", url, reply.status_code,
                               reply.text[:200])
        except httpx.HTTPError as error:  # CTX's own artifact TTL frees it anyway
            logger.warning("context artifact abort at %s failed: %s", url, error)
        finally:
            self._control_pending -= 1

    def http(self) -> httpx.AsyncClient:
        """The worker's pooled client for generation-first hand-off pulls (long polls: up to the wait they ask)."""
        if self._client is None:
            self._client = httpx.AsyncClient(timeout=10.0, headers=self.peer_headers)
        return self._client

    def control_http(self) -> httpx.AsyncClient:
        """The client of the calls made on a grant's behalf: its own few connections and short timeouts, so that
        aborts sent to a CTX that never answers cannot delay a hand-off pull."""
        if self._control_client is None:
            self._control_client = httpx.AsyncClient(
                timeout=_CONTROL_TIMEOUT, headers=self.peer_headers,
                limits=httpx.Limits(max_connections=_CONTROL_CONCURRENCY,
                                    max_keepalive_connections=_CONTROL_CONCURRENCY))
        return self._control_client

    def _spawn(self, work: Awaitable[Any]) -> None:
        task = asyncio.ensure_future(work)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def bind(self, params: DisaggregatedParams, request_id: str) -> UUID:
        """Bind a generation_only request to its live grant (checked again: it may have expired since
        ``check_request``); returns the grant's id for ``finish``."""
        grant = self.live_grant(params)
        grant.request_id = request_id
        grant.ended = asyncio.Event()
        self._forget_unbound(grant)  # bound: its admission lease is met
        return grant.grant_id

    async def until_ended(self, grant_id: UUID) -> None:
        """Returns once the grant is no longer active (aborted, expired, released)."""
        grant = self.grants.get(grant_id)
        if grant is not None and grant.ended is not None and grant.state is GrantState.ACTIVE:
            await grant.ended.wait()

    def live_grant(self, params: DisaggregatedParams) -> Grant:
        grant_id = UUID(str(params.consumer_grant_id))
        grant = self.grants.get(grant_id)
        if grant is None:
            raise InvalidRequestError(f"generation grant {grant_id} has no admitted transfer session",
                                      param="disaggregated_params.consumer_grant_id")
        if grant.attempt != attempt_of(params.model_dump()):
            raise InvalidRequestError("generation grant identity does not match the admitted transfer session",
                                      param="disaggregated_params.consumer_grant_id")
        if self._expire_if_due(grant, self.clock()):
            message = ("generation intent grant expired before scheduler submission" if grant.reason == GRANT_EXPIRED
                       else f"generation grant is {grant.state.value}: {grant.reason}")
            raise InvalidRequestError(message, param="disaggregated_params.consumer_grant_id")
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
        if grant is not None:
            self._expire_if_due(grant, self.clock())
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
