"""What tracing costs the orchestrator per request: its hooks with tracing off, against no hooks at all, and on.

    python -m bench.tracing_overhead [--requests 200000]

One "request" is every hook the orchestrator's hot path runs for a streamed request (frontend/tracing.py and
orchestrator/flow/spans.py): the request and admission spans, the CTX call, the hand-off, the GEN call and the
stream wrapper, in the order the flow runs them. "No hooks" is the same loop with the hooks' lines removed; the
difference is the price of the hooks when tracing is off. "On" exports to an OTLP endpoint nobody listens on;
CPU time is this thread's only (the SDK exports from its own), i.e. what the event loop pays.
"""

from __future__ import annotations

import asyncio
import logging
import sys
import time
from collections.abc import AsyncIterator
from types import SimpleNamespace
from typing import Any

from bench.driver.common import arguments
from frontend import tracing
from orchestrator.flow import spans as flow_tracing

REQUESTS = 200_000


async def _frames() -> AsyncIterator[bytes]:
    yield b"data: {}\n\n"


async def _one_request_with_hooks(headers: dict[str, str], outgoing: dict[str, str]) -> None:
    span = tracing.start("orchestrator chat", headers, server=True)
    admission = tracing.start("admission", span)
    tracing.end(admission, None)
    with tracing.span("ctx.call", span, headers=outgoing, client=True) as ctx_call:
        flow_tracing.called(ctx_call, _DONE)
    with tracing.span("handoff", span) as handoff:
        flow_tracing.handed_off(handoff, _CTX, _CARRIAGE, None, b"")
    with tracing.span("gen.call", span, headers=outgoing, client=True) as gen_call:
        flow_tracing.called(gen_call, _DONE)
    async for _ in tracing.traced_frames("stream", span, _frames()):
        pass
    tracing.end(span, {"http.status_code": 200})


async def _one_request_without_hooks(headers: dict[str, str], outgoing: dict[str, str]) -> None:
    async for _ in _frames():
        pass


def _fixtures() -> tuple[Any, Any, Any]:
    from orchestrator.flow.retry import Attempted
    from orchestrator.protocols.base import ContextAnswer, PromptCarriage
    from orchestrator.upstream.base import Reply

    member: Any = SimpleNamespace(url="http://127.0.0.1:1")  # the hooks read only the worker's URL
    ctx = ContextAnswer({}, {"encoded_opaque_state": "x" * 64}, False, 1024, "A" * 5464)
    return Attempted(Reply(200, b"{}"), member, 1), ctx, PromptCarriage.CTX_TOKENS


_DONE, _CTX, _CARRIAGE = _fixtures()


async def _per_request_us(requests: int, hooks: bool) -> float:
    one = _one_request_with_hooks if hooks else _one_request_without_hooks
    headers = {"traceparent": "00-" + "1" * 32 + "-" + "2" * 16 + "-01"}
    outgoing: dict[str, str] = {}
    started = time.thread_time()  # this thread only: the SDK exports from its own
    for _ in range(requests):
        await one(headers, outgoing)
    return (time.thread_time() - started) * 1e6 / requests


async def _measure(requests: int) -> dict[str, float]:
    figures: dict[str, list[float]] = {"no hooks": [], "hooks, tracing off": []}
    for _ in range(5):  # interleaved, best of five: the machine is shared
        figures["no hooks"].append(await _per_request_us(requests, hooks=False))
        figures["hooks, tracing off"].append(await _per_request_us(requests, hooks=True))
    logging.getLogger("opentelemetry").setLevel(logging.CRITICAL)  # the refused exports are expected
    tracing.configure("bench", "orchestrator", endpoint="http://127.0.0.1:9")
    figures["hooks, tracing on"] = [await _per_request_us(max(requests // 20, 100), hooks=True) for _ in range(3)]
    return {name: min(values) for name, values in figures.items()}


def run(requests: int = REQUESTS) -> dict[str, Any]:
    """CPU µs per request of each way, best of its repeats."""
    figures = asyncio.run(_measure(requests))
    tracing._shutdown.clear()  # nothing listens on the endpoint: do not wait for the export at exit
    return {"benchmark": "tracing_overhead", "requests": requests, "us_per_request": figures}


def tables(result: dict[str, Any]) -> str:
    figures = result["us_per_request"]
    base = figures["no hooks"]
    return "\n".join(f"{name:<20} {value:8.2f} us CPU per request   (+{value - base:.2f} us)"
                     for name, value in figures.items())


def main(argv: list[str] | None = None) -> int:
    parser = arguments(__doc__)
    parser.add_argument("--requests", type=int, default=REQUESTS)
    args = parser.parse_args(argv)
    print(tables(run(args.requests)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
