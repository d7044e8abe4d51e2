"""Generation first (TensorRT-LLM's ``schedule_style: 1``): GEN gets its request before CTX has prefilled, and pulls
the hand-off (first tokens, KV reference) from CTX by ``disagg_request_id`` once CTX has parked it, a bounded long
poll. CTX side: ``HandoffBoard`` keeps those answers until their GEN claims them, once. GEN side: ``pull_handoff``.

Only holders of the deployment secret reach the board (``workers.trtllm.routes``); under lifecycle v1 a hand-off
also goes only to the GEN granted that attempt, which presents its ``transfer_session_id`` (122 random bits) in
``CLAIM_HEADER``; a wrong claim is answered like a missing hand-off. Without v1 (TensorRT-LLM's wire has no
per-attempt value on both legs) the deployment secret is the only key.
"""

from __future__ import annotations

import asyncio
import hmac
from collections import OrderedDict
from collections.abc import Callable
from typing import Any
from uuid import UUID

import httpx

from frontend.disaggregated_params import DisaggregatedParams
from frontend.errors import HandoffError, InvalidRequestError, UpstreamUnavailableError
from frontend.trtllm.lifecycle import control_url
from workers.trtllm.lifecycle import LifecycleControl

HANDOFF_PATH = "/_internal/disagg/generation_first/{disagg_request_id}"
CLAIM_HEADER = "x-disagg-handoff-claim"  # the attempt's claim on its hand-off (v1: its transfer_session_id)
_MAX_ENTRIES = 4096  # unclaimed answers kept at most: a GEN that never comes must not grow this without bound


class HandoffBoard:
    def __init__(self, ttl_s: float, clock: Callable[[], float]) -> None:
        self.ttl_s = ttl_s
        self.clock = clock
        # id -> (posted at, the claim that takes it or None, the params)
        self._posted: OrderedDict[int, tuple[float, str | None, dict[str, Any]]] = OrderedDict()
        self._waiters: dict[int, asyncio.Event] = {}

    def post(self, disagg_request_id: int, params: dict[str, Any], claim: str | None = None) -> bool:
        """``claim``: what a GEN must present to take it (None: any caller the route lets in). The first post of an
        id stands: a later one is dropped (returns False), so no request can replace another's hand-off."""
        self._forget_old()
        if disagg_request_id in self._posted:
            return False
        self._posted[disagg_request_id] = (self.clock(), claim, params)
        while len(self._posted) > _MAX_ENTRIES:
            self._posted.popitem(last=False)
        waiter = self._waiters.pop(disagg_request_id, None)
        if waiter is not None:
            waiter.set()
        return True

    async def claim(self, disagg_request_id: int, wait_s: float, presented: str | None = None
                    ) -> dict[str, Any] | None:
        """The hand-off params for this request, waiting up to ``wait_s`` for CTX to post them; taken once, and only
        with the claim it was posted with (``presented``). None otherwise, the hand-off left for its GEN."""
        if disagg_request_id not in self._posted:
            waiter = self._waiters.setdefault(disagg_request_id, asyncio.Event())
            try:
                await asyncio.wait_for(waiter.wait(), wait_s)
            except TimeoutError:
                return None
            finally:
                if self._waiters.get(disagg_request_id) is waiter and not waiter.is_set():
                    self._waiters.pop(disagg_request_id, None)
        entry = self._posted.get(disagg_request_id)
        if entry is None or not _claim_matches(entry[1], presented):
            return None
        del self._posted[disagg_request_id]
        return entry[2]

    def waiting(self, disagg_request_id: int) -> bool:
        """Whether a GEN is waiting for this request's hand-off now."""
        return disagg_request_id in self._waiters

    def _forget_old(self) -> None:
        horizon = self.clock() - self.ttl_s
        while self._posted and next(iter(self._posted.values()))[0] < horizon:
            self._posted.popitem(last=False)


def _claim_matches(expected: str | None, presented: str | None) -> bool:
    if expected is None:
        return True
    return presented is not None and hmac.compare_digest(presented.encode(), expected.encode())


async def pull_handoff(client: httpx.AsyncClient, ctx_info_endpoint: str, disagg_request_id: int,
                       wait_s: float, claim: str | None = None) -> dict[str, Any]:
    """GEN's side: the hand-off CTX parked for ``disagg_request_id`` (first tokens, KV reference, CTX id), asked
    on the worker's pooled client for pulls, with the attempt's ``claim`` (v1) when it has one. The endpoint came
    with the request: it must be a plain http(s) base (``control_url``), rebuilt from its parsed parts."""
    try:
        url = control_url(ctx_info_endpoint, HANDOFF_PATH.format(disagg_request_id=disagg_request_id))
    except ValueError as error:
        raise HandoffError(f"ctx_info_endpoint is not usable: {error}",
                           param="disaggregated_params.ctx_info_endpoint") from None
    base = url.removesuffix(HANDOFF_PATH.format(disagg_request_id=disagg_request_id))
    try:
        reply = await client.get(url, params={"wait_s": wait_s}, timeout=wait_s + 10.0,
                                 headers={CLAIM_HEADER: claim} if claim is not None else None)
    except httpx.HTTPError as error:
        raise UpstreamUnavailableError(f"the context worker at {base} could not be asked for the hand-off: "
                                       f"{error}") from error
    if reply.status_code == 404:
        raise HandoffError(f"no hand-off for disagg_request_id {disagg_request_id} came from the context worker "
                           f"within {wait_s} s", param="disaggregated_params.disagg_request_id")
    if reply.status_code != 200:
        raise UpstreamUnavailableError(f"the context worker answered {reply.status_code} for the hand-off")
    params: dict[str, Any] = reply.json()
    return params


def comes_first(disagg: DisaggregatedParams | None) -> bool:
    """A generation-first GEN request sent before CTX answered: it carries no hand-off yet."""
    return (disagg is not None and disagg.request_type == "generation_only" and disagg.schedule_style == 1
            and disagg.encoded_opaque_state is None and disagg.first_gen_tokens is None)


async def wait_for_handoff(disagg: DisaggregatedParams, lifecycle: LifecycleControl, wait_s: float,
                           grant: UUID | None) -> DisaggregatedParams:
    """GEN came first: wait (up to ``wait_s``) for CTX's hand-off by ``disagg_request_id``, and return the request's
    params with it. Under v1 a grant that ends while GEN waits ends the wait too."""
    endpoint = disagg.ctx_info_endpoint
    if isinstance(endpoint, list):
        endpoint = endpoint[0] if endpoint else None
    if not endpoint or disagg.disagg_request_id is None:
        raise InvalidRequestError("a generation-first generation_only request needs ctx_info_endpoint and "
                                  "disagg_request_id", param="disaggregated_params.ctx_info_endpoint")
    # v1: the attempt's transfer_session_id is its claim on the hand-off.
    claim = str(disagg.transfer_session_id) if disagg.transfer_session_id is not None else None
    pull = asyncio.ensure_future(pull_handoff(lifecycle.http(), endpoint, disagg.disagg_request_id, wait_s, claim))
    if grant is not None:
        ended = asyncio.ensure_future(lifecycle.until_ended(grant))
        try:
            await asyncio.wait({pull, ended}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            ended.cancel()
            if not pull.done():
                pull.cancel()
        lifecycle.ensure_live(grant)  # aborted or expired while it waited: the KV is freed, not taken
    params = await pull
    return disagg.model_copy(update={k: params.get(k) for k in (
        "first_gen_tokens", "first_gen_log_probs", "ctx_request_id", "encoded_opaque_state")})
