"""TensorRT-LLM's lifecycle protocol v1, our orchestrator's side: the control calls to trtllm-serve workers.

A pair whose ``GET /server_info`` advertises v1 refuses v0 requests, so each attempt is named by an identity CTX
must echo, GEN is sent anything only under a grant it gave (renewed while the request lives), and every failure
aborts the grant and CTX's artifact, so that neither worker holds KV for a request nobody will finish. What is sent
when, and what a lost answer means, is in docs/interop.md (Lifecycle v1); bodies are validated both ways by the
shared models in ``frontend.trtllm.lifecycle``.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncGenerator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

import orjson
from pydantic import BaseModel

from frontend.config import TrtllmConfig
from frontend.errors import UpstreamError
from frontend.metrics import Metrics
from frontend.trtllm.auth import TRTLLM_AUTH_HEADER, control_signature
from frontend.trtllm.identity import GENERATION_ENDPOINT_FIELDS, IDENTITY_FIELDS, new_identity
from frontend.trtllm.lifecycle import (
    CONTEXT_ARTIFACT_ABORT_PATH,
    GENERATION_GRANT_ABORT_PATH,
    GENERATION_GRANT_PATH,
    GENERATION_GRANT_RENEW_PATH,
    SERVER_INFO_PATH,
    ContextArtifactAbortRequest,
    GenerationGrantAbortRequest,
    GenerationGrantDecisionResponse,
    GenerationGrantRenewRequest,
    GenerationGrantRequest,
    GrantState,
    LifecycleNegotiationError,
    ObligationResponse,
    ScheduleStyle,
    TransceiverLifecycleAdvertisement,
    negotiate,
    validate_generation_safe_advertisement,
)
from orchestrator.client_body import encode
from orchestrator.member import PoolMember
from orchestrator.upstream.base import OpenStream, Reply

logger = logging.getLogger("disagg_serve.trtllm_lifecycle")


def speaks_v1(worker: PoolMember) -> bool:
    """A trtllm-serve worker that advertises lifecycle v1 (a v1 worker refuses a v0 request)."""
    return worker.protocol == "trtllm" and worker.lifecycle is not None


def generation_first_capable(worker: PoolMember) -> bool:
    return speaks_v1(worker) and worker.lifecycle is not None and "GENERATION_FIRST" in worker.lifecycle.capabilities


# How a worker is started in a lifecycle version: ours, and trtllm-serve.
LIFECYCLE_FLAG = "--lifecycle-protocol-version (TRTLLM_DISAGG_LIFECYCLE_PROTOCOL_VERSION for trtllm-serve)"


async def read_server_info(member: PoolMember, timeout_s: float = 5.0) -> bool:
    """``member``'s ``disaggregated_params`` from its ``GET /server_info`` (``member.disagg_info``: where a
    generation-first GEN finds its CTX) and its lifecycle v1 advertisement (``member.lifecycle``; None for a v0
    worker: one that advertises none or a v0 one, or has no such route, is spoken to in v0). False where the read
    failed (no answer, a timeout, a 5xx, a body that is not JSON), nothing set: it is read again later, never taken
    for a v0 worker; and False where it advertises a lifecycle this orchestrator cannot drive (``not_routable``),
    which would refuse v0 as well."""
    try:
        reply = await member.transport.get(SERVER_INFO_PATH, timeout_s)
        if reply.status_code >= 500:
            raise UpstreamError(f"status {reply.status_code}")
        info = orjson.loads(reply.content) if reply.status_code == 200 else {}
    except (UpstreamError, TimeoutError, orjson.JSONDecodeError) as exc:
        logger.warning("worker %s: GET %s failed (%s); read again at the next health check", member.url,
                       SERVER_INFO_PATH, exc)
        return False
    params = info.get("disaggregated_params") if isinstance(info, dict) else None
    member.disagg_info = params if isinstance(params, dict) else None
    member.lifecycle = None
    raw = (member.disagg_info or {}).get("context_transceiver_lifecycle")
    if raw is None:
        return True
    try:
        advertisement = TransceiverLifecycleAdvertisement.model_validate(raw)
        if advertisement.protocol_version == 0:
            return True  # v0, said out loud
        validate_generation_safe_advertisement(advertisement, role="worker")
    except (ValueError, LifecycleNegotiationError) as exc:  # pydantic's ValidationError is a ValueError
        not_routable(member, f"it advertises a lifecycle this orchestrator cannot drive ({exc}); start it in "
                     f"lifecycle protocol 0 or 1 ({LIFECYCLE_FLAG})")
        return False
    logger.info("worker %s advertises lifecycle protocol v1 (incarnation %s)", member.url, advertisement.instance_id)
    member.lifecycle = advertisement
    return True


def not_routable(member: PoolMember, why: str) -> None:
    """``member`` answers, but takes no requests: a deployment mismatch, logged for the operator once per cause."""
    if member.unroutable != why:
        logger.warning("worker %s takes no requests: %s", member.url, why)
    member.unroutable = why


def control_endpoint(member: PoolMember) -> str:
    """The CTX's ``context_control_endpoint``: host:port, as TensorRT-LLM's router names a server."""
    return urlsplit(member.url).netloc or member.url


@dataclass(slots=True)
class Attempt:
    """One attempt's identity and what has been set up for it: what must be undone if it fails."""

    identity: dict[str, Any]
    ctx: PoolMember
    ctx_lifecycle: TransceiverLifecycleAdvertisement
    schedule_style: ScheduleStyle
    gen: PoolMember | None = None
    endpoint: dict[str, Any] = field(default_factory=dict)  # generation_endpoint_* of the accepted grant
    grant_ttl_s: float | None = None
    renewal: asyncio.Task[None] | None = None
    ctx_sent: bool = False  # CTX may hold an artifact for it
    settled: bool = False

    @property
    def ctx_control_endpoint(self) -> str:
        return control_endpoint(self.ctx)

    def ctx_params(self) -> dict[str, Any]:
        """What v1 adds to CTX's ``disaggregated_params`` (and generation-first's GEN endpoint, once admitted)."""
        return {**self.identity, **self.endpoint, "context_control_endpoint": self.ctx_control_endpoint,
                "context_transceiver_lifecycle": self.ctx_lifecycle.to_dict()}


class LifecycleClient:
    def __init__(self, config: TrtllmConfig, metrics: Metrics, auth_key: str | None = None) -> None:
        """``auth_key``: TensorRT-LLM's ``internal_request_auth_key``: each control call then carries its signature
        of the route and the body (frontend/trtllm/auth.py), as its own orchestrator's do."""
        self.config = config
        self.metrics = metrics
        self.auth_key = auth_key

    def count(self, event: str) -> None:
        self.metrics.trtllm_lifecycle.labels(event=event).inc()

    def begin(self, ctx: PoolMember, logical_request_id: int,
              schedule_style: ScheduleStyle = ScheduleStyle.CONTEXT_FIRST) -> Attempt:
        assert ctx.lifecycle is not None
        return Attempt(new_identity(logical_request_id), ctx, ctx.lifecycle, schedule_style)

    # -- CTX's echo -----------------------------------------------------------------------------------------------
    def verify_echo(self, attempt: Attempt, sent_request_id: int, params: dict[str, Any]) -> None:
        """CTX answered for exactly this attempt: its identity, control endpoint, advertisement and schedule echoed
        (TensorRT-LLM's ``_verify_lifecycle_echo``), and the request id it was admitted under unchanged."""
        expected = attempt.ctx_params()
        expected.update({name: attempt.endpoint.get(name) for name in GENERATION_ENDPOINT_FIELDS})
        expected["schedule_style"] = int(attempt.schedule_style)
        mismatched = sorted(name for name, value in expected.items() if params.get(name) != value)
        if params.get("disagg_request_id") != sent_request_id:
            mismatched.append("disagg_request_id")
        if mismatched:
            self.count("echo_mismatch")
            raise UpstreamError("the CTX step failed: the context worker returned a conflicting lifecycle contract "
                                f"({', '.join(mismatched)})")

    # -- the grant -------------------------------------------------------------------------------------------------
    def _grant_request(self, attempt: Attempt) -> GenerationGrantRequest:
        return GenerationGrantRequest(
            lifecycle_protocol_version=1, **attempt.identity, ttl_s=self.config.grant_ttl_s,
            context_control_endpoint=attempt.ctx_control_endpoint,
            context_transceiver_lifecycle=attempt.ctx_lifecycle, schedule_style=attempt.schedule_style)

    async def admit(self, attempt: Attempt, gen: PoolMember) -> bool:
        """Issue the grant on ``gen``: True once accepted (``attempt`` then names it), False if ``gen`` refused it
        (another GEN may be asked). An answer lost on the way is replayed once and an accepted replay aborted;
        that raises ``UpstreamError``, as TensorRT-LLM re-raises its original error. A cancellation (the client
        left) with the call in flight is settled the same way, then re-raised."""
        request = self._grant_request(attempt)
        try:
            reply = await self._post(gen, GENERATION_GRANT_PATH, request)
            decision = self._decision(reply)
        except (UpstreamError, TimeoutError, ValueError) as exc:
            self.count("grant_ambiguous")
            logger.warning("generation grant on %s is ambiguous (%s): replaying it to settle it", gen.url, exc)
            await self._settle_ambiguous(gen, request)
            raise UpstreamError(f"the GEN admission on {gen.url} failed: {exc}") from exc
        except asyncio.CancelledError:
            # The client left with the grant call in flight: GEN may have made the grant, and ``attempt`` does
            # not name it yet, so it is settled like any ambiguous admission (shielded: we are being cancelled).
            self.count("grant_ambiguous")
            logger.warning("generation grant on %s is ambiguous (cancelled): replaying it to settle it", gen.url)
            await asyncio.shield(self._settle_ambiguous(gen, request))
            raise
        if decision is None or not decision.accepted:
            self.count("grant_refused")
            logger.warning("GEN worker %s refused the generation grant: %s", gen.url,
                           decision.reason if decision is not None else f"status {reply.status_code}")
            return False
        try:
            endpoint = _granted_endpoint(decision)
            assert decision.generation_transceiver_lifecycle is not None
            negotiate(attempt.ctx_lifecycle, decision.generation_transceiver_lifecycle,
                      schedule_style=attempt.schedule_style)
        except (ValueError, LifecycleNegotiationError) as exc:
            # Accepted but unusable: the grant exists on GEN, so it is aborted before the next GEN is asked.
            self.count("grant_refused")
            logger.warning("GEN worker %s granted an attempt it cannot serve (%s)", gen.url, exc)
            if len(endpoint := _partial_endpoint(decision)) == len(GENERATION_ENDPOINT_FIELDS):
                await self._abort_grant(attempt, gen, endpoint, "generation grant could not be negotiated")
            return False
        self.count("grant_accepted")
        attempt.gen, attempt.endpoint, attempt.grant_ttl_s = gen, endpoint, decision.ttl_s
        return True

    def _decision(self, reply: Reply) -> GenerationGrantDecisionResponse | None:
        if reply.status_code in (400, 404, 409):  # a definite no: a v0 worker, a bad body, a conflicting replay
            return None
        if reply.status_code != 200:
            raise UpstreamError(f"status {reply.status_code}")
        return GenerationGrantDecisionResponse.model_validate_json(reply.content)

    async def _settle_ambiguous(self, gen: PoolMember, request: GenerationGrantRequest) -> None:
        try:
            decision = self._decision(await self._post(gen, GENERATION_GRANT_PATH, request))
            if decision is not None and decision.accepted:
                endpoint = _partial_endpoint(decision)
                if len(endpoint) == len(GENERATION_ENDPOINT_FIELDS):
                    await self._abort_grant_body(gen, request.model_dump(include=set(IDENTITY_FIELDS)), endpoint,
                                                 "ambiguous generation admission")
        except (UpstreamError, TimeoutError, ValueError) as exc:
            self.count("grant_ambiguous_failed")  # GEN's own expiry of the grant is the backstop
            logger.warning("the replay of an ambiguous grant on %s failed too (%s)", gen.url, exc)

    # -- renewal ---------------------------------------------------------------------------------------------------
    def start_renewal(self, attempt: Attempt, on_lost: Callable[[], object]) -> None:
        attempt.renewal = asyncio.get_running_loop().create_task(self._renew(attempt, on_lost))

    async def _renew(self, attempt: Attempt, on_lost: Callable[[], object]) -> None:
        assert attempt.gen is not None and attempt.grant_ttl_s is not None
        loop = asyncio.get_running_loop()
        remaining, sequence = attempt.grant_ttl_s, 0
        while True:
            await asyncio.sleep(min(self.config.grant_renew_interval_s, remaining / 3))
            sent = loop.time()
            request = GenerationGrantRenewRequest(lifecycle_protocol_version=1, **attempt.identity,
                                                  **attempt.endpoint, ttl_s=self.config.grant_ttl_s,
                                                  sequence=sequence)
            try:
                reply = await self._post(attempt.gen, GENERATION_GRANT_RENEW_PATH, request)
                answer = ObligationResponse.model_validate_json(reply.content) if reply.status_code == 200 else None
                if answer is not None and not answer.accepted and answer.state == GrantState.RELEASED:
                    # GEN finished the request and released its grant (its answer may still be on the way to a
                    # slow client): nothing is left to renew, and nothing was lost.
                    logger.debug("generation grant on %s was released: renewal stops", attempt.gen.url)
                    return
                why = (f"status {reply.status_code}" if answer is None else
                       f"{answer.state} {answer.reason}".strip() if not answer.accepted or answer.ttl_s is None
                       else None)
                if answer is not None and why is None and answer.ttl_s is not None:
                    received = loop.time()
                    if received >= sent + answer.ttl_s:
                        why = "the renewal arrived after the grant's deadline"
                    remaining = sent + answer.ttl_s - received
            except (UpstreamError, TimeoutError, ValueError) as exc:
                why = str(exc)
            if why is not None:
                self.count("grant_renew_failed")
                logger.warning("generation grant on %s could not be renewed (%s): the request ends",
                               attempt.gen.url, why)
                on_lost()
                return
            sequence += 1

    # -- clean-up --------------------------------------------------------------------------------------------------
    async def settle(self, attempt: Attempt, *, ok: bool, reason: str) -> None:
        """The attempt's end (once): renewal stopped; after a failure, the context artifact and the grant aborted.
        A success leaves both to the workers: GEN releases its grant when it finishes."""
        if attempt.settled:
            return
        attempt.settled = True
        renewal = attempt.renewal
        if renewal is not None:
            renewal.cancel()
        try:
            if not ok:
                # First, and shielded: a client that left cancels the request's task, and the clean-up must still
                # reach the workers whatever became of the renewal.
                await asyncio.shield(self._abort_all(attempt, reason))
        finally:
            if renewal is not None:
                # ``wait``, not ``await renewal``: the renewal's own end is not ours to raise, while a cancellation
                # of the caller still ends the caller.
                await asyncio.wait([renewal])
                if not renewal.cancelled() and (failure := renewal.exception()) is not None:
                    logger.error("the renewal of the generation grant on %s failed", attempt.gen and attempt.gen.url,
                                 exc_info=failure)

    async def _abort_all(self, attempt: Attempt, reason: str) -> None:
        calls = []
        if attempt.ctx_sent:
            calls.append(self._abort_artifact(attempt, reason))
        if attempt.gen is not None:
            calls.append(self._abort_grant(attempt, attempt.gen, attempt.endpoint, reason))
        await asyncio.gather(*calls)

    async def _abort_artifact(self, attempt: Attempt, reason: str) -> None:
        request = ContextArtifactAbortRequest(lifecycle_protocol_version=1, **attempt.identity,
                                              context_endpoint_incarnation=attempt.ctx_lifecycle.incarnation,
                                              reason=reason)
        await self._clean_up(attempt.ctx, CONTEXT_ARTIFACT_ABORT_PATH, request, "artifact_aborted")

    async def _abort_grant(self, attempt: Attempt, gen: PoolMember, endpoint: dict[str, Any], reason: str) -> None:
        await self._abort_grant_body(gen, attempt.identity, endpoint, reason)

    async def _abort_grant_body(self, gen: PoolMember, identity: dict[str, Any], endpoint: dict[str, Any],
                                reason: str) -> None:
        request = GenerationGrantAbortRequest(lifecycle_protocol_version=1, **identity, **endpoint, reason=reason)
        await self._clean_up(gen, GENERATION_GRANT_ABORT_PATH, request, "grant_aborted")

    async def _clean_up(self, member: PoolMember, path: str, request: BaseModel, event: str) -> None:
        try:
            reply = await self._post(member, path, request)
            answer = ObligationResponse.model_validate_json(reply.content) if reply.status_code == 200 else None
            if answer is None or not answer.accepted:
                raise UpstreamError(f"status {reply.status_code}: {reply.content[:200]!r}")
        except (UpstreamError, TimeoutError, ValueError) as exc:
            self.count(f"{event}_failed")  # the worker's own expiry frees it later
            logger.warning("lifecycle clean-up %s on %s failed: %s", path, member.url, exc)
            return
        self.count(event)

    async def _post(self, member: PoolMember, path: str, request: BaseModel) -> Reply:
        fields = request.model_dump(mode="json")
        headers = ({TRTLLM_AUTH_HEADER: control_signature(self.auth_key, path, fields)}
                   if self.auth_key is not None else None)
        async with asyncio.timeout(self.config.admission_timeout_s):
            return await member.transport.post(path, encode(fields), headers)


def _partial_endpoint(decision: GenerationGrantDecisionResponse) -> dict[str, Any]:
    values = {"generation_endpoint_name": decision.generation_endpoint_name,
              "generation_endpoint_rank": decision.generation_endpoint_rank,
              "generation_endpoint_incarnation": (str(decision.generation_endpoint_incarnation)
                                                  if decision.generation_endpoint_incarnation else None)}
    return {name: value for name, value in values.items() if value is not None}


def _granted_endpoint(decision: GenerationGrantDecisionResponse) -> dict[str, Any]:
    endpoint = _partial_endpoint(decision)
    if (len(endpoint) != len(GENERATION_ENDPOINT_FIELDS) or decision.generation_transceiver_lifecycle is None
            or decision.ttl_s is None):
        raise ValueError("an accepted generation grant is missing its endpoint, lifecycle or ttl_s")
    return endpoint


class SettledStream:
    """GEN's stream under v1 (an ``OpenStream``): its end settles the attempt. Read to its end, or its end marker
    sent (``answered``), the request succeeded (GEN releases its own grant); closed before that (the client
    left, GEN broke, the grant was lost), the grant and CTX's artifact are aborted. A lost grant closes the stream
    under the reader."""

    def __init__(self, stream: OpenStream, settle: Callable[[bool], Awaitable[None]],
                 lost: asyncio.Future[None]) -> None:
        self.stream = stream
        self._settle = settle
        self._completed = False
        self._lost = lost
        lost.add_done_callback(self._on_lost)

    def _on_lost(self, _: asyncio.Future[None]) -> None:
        if not self._completed:
            asyncio.get_running_loop().create_task(self.stream.aclose())

    @property
    def status_code(self) -> int:
        return self.stream.status_code

    @property
    def prompt_report(self) -> bytes | None:
        return self.stream.prompt_report

    def answered(self) -> None:
        """GEN sent the stream's end marker (the relay hands it on to the client): GEN finished the request and
        released its grant, so a close from here on (a client that hangs up at ``[DONE]``, before GEN's last bytes
        are read) aborts nothing. A grant lost before this still counts as lost."""
        self._completed = self._completed or not self._lost.done()

    async def chunks(self) -> AsyncGenerator[bytes, None]:
        async for chunk in self.stream.chunks():
            yield chunk
        self._completed = self._completed or not self._lost.done()

    async def push(self, take: Callable[[bytes], bool], drained: Callable[[], Awaitable[object]]) -> None:
        await self.stream.push(take, drained)
        self._completed = self._completed or not self._lost.done()

    async def read(self) -> bytes:
        content = await self.stream.read()
        self._completed = self._completed or not self._lost.done()
        return content

    async def aclose(self) -> None:
        self._lost.remove_done_callback(self._on_lost)
        await self.stream.aclose()
        await self._settle(self._completed)
