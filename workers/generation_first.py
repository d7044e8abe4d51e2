"""Generation first on our workers: GEN may arrive before CTX has prefilled, and pulls the hand-off when it exists.

TensorRT-LLM's orchestrator with ``schedule_style: generation_first`` sends GEN its request (``schedule_style: 1``,
``disagg_request_id``, and the CTX's ``ctx_info_endpoint`` from CTX's ``/server_info``) before or together with
the CTX request, and no CTX answer ever reaches GEN through the orchestrator. Our hand-off is pulled anyway (GEN's
engine fetches the KV from CTX's transfer server by the reference in ``encoded_opaque_state``), so the only thing
GEN lacks is that reference and the first token: it asks CTX for them by ``disagg_request_id``, and CTX answers as
soon as its prefill has parked the KV (a long poll, bounded). GEN reserves its place meanwhile: the request is
admitted and counted, its grant bound (v1), before the wait starts.

CTX side: ``HandoffBoard`` keeps the hand-off params of generation-first CTX answers until their GEN claims them
(once), or for at most the artifact TTL. GEN side: ``pull_handoff``.
"""

from __future__ import annotations

import asyncio
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import httpx

from frontend.errors import HandoffError, UpstreamUnavailableError

HANDOFF_PATH = "/_internal/disagg/generation_first/{disagg_request_id}"
_MAX_ENTRIES = 4096  # unclaimed answers kept at most: a GEN that never comes must not grow this without bound


class HandoffBoard:
    def __init__(self, ttl_s: float, clock: Callable[[], float]) -> None:
        self.ttl_s = ttl_s
        self.clock = clock
        self._posted: OrderedDict[int, tuple[float, dict[str, Any]]] = OrderedDict()
        self._waiters: dict[int, asyncio.Event] = {}

    def post(self, disagg_request_id: int, params: dict[str, Any]) -> None:
        self._forget_old()
        self._posted[disagg_request_id] = (self.clock(), params)
        while len(self._posted) > _MAX_ENTRIES:
            self._posted.popitem(last=False)
        waiter = self._waiters.pop(disagg_request_id, None)
        if waiter is not None:
            waiter.set()

    async def claim(self, disagg_request_id: int, wait_s: float) -> dict[str, Any] | None:
        """The hand-off params for this request, waiting up to ``wait_s`` for CTX to post them; taken once."""
        if disagg_request_id not in self._posted:
            waiter = self._waiters.setdefault(disagg_request_id, asyncio.Event())
            try:
                await asyncio.wait_for(waiter.wait(), wait_s)
            except TimeoutError:
                return None
            finally:
                if self._waiters.get(disagg_request_id) is waiter and not waiter.is_set():
                    self._waiters.pop(disagg_request_id, None)
        entry = self._posted.pop(disagg_request_id, None)
        return entry[1] if entry is not None else None

    def waiting(self, disagg_request_id: int) -> bool:
        """Whether a GEN is waiting for this request's hand-off now."""
        return disagg_request_id in self._waiters

    def _forget_old(self) -> None:
        horizon = self.clock() - self.ttl_s
        while self._posted and next(iter(self._posted.values()))[0] < horizon:
            self._posted.popitem(last=False)


async def pull_handoff(client: httpx.AsyncClient, ctx_info_endpoint: str, disagg_request_id: int,
                       wait_s: float) -> dict[str, Any]:
    """GEN's side: the hand-off CTX parked for ``disagg_request_id`` (first tokens, KV reference, CTX id), asked
    on the worker's one pooled client."""
    base = ctx_info_endpoint if ctx_info_endpoint.startswith(("http://", "https://")) else "http://" + ctx_info_endpoint
    url = base.rstrip("/") + HANDOFF_PATH.format(disagg_request_id=disagg_request_id)
    try:
        reply = await client.get(url, params={"wait_s": wait_s}, timeout=wait_s + 10.0)
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
