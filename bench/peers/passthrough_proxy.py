"""The baseline of ``bench.orchestrator_cost``: a pass-through proxy that moves the same bytes as the orchestrator
and does no JSON work at all.

``python -m bench.peers.passthrough_proxy --port P --ctx URL --gen URL``. The client's body to CTX as it came,
CTX's whole answer to GEN as its body, GEN's stream back chunk by chunk; a bare ASGI app on the orchestrator's own
server stack with one pooled aiohttp session, no retries, health checks, metrics or background task: close to what
moving these bytes through one Python process costs.
"""

from __future__ import annotations

import sys
from typing import Any

import aiohttp
import uvicorn

from bench.driver.common import arguments

_JSON = {"Content-Type": "application/json"}
_SSE_HEADERS = [(b"content-type", b"text/event-stream"), (b"cache-control", b"no-cache")]


class PassThroughProxy:
    def __init__(self, ctx_url: str, gen_url: str) -> None:
        self.ctx_url = ctx_url
        self.gen_url = gen_url
        self.session: aiohttp.ClientSession | None = None

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            await self._lifespan(receive, send)
        elif scope["method"] == "GET":
            await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/plain")]})
            await send({"type": "http.response.body", "body": b"ok"})
        else:
            await self._relay(scope["path"], await _read_body(receive), send)

    async def _relay(self, path: str, body: bytes, send: Any) -> None:
        assert self.session is not None
        async with self.session.post(self.ctx_url + path, data=body, headers=_JSON) as ctx:
            ctx_answer = await ctx.read()
        async with self.session.post(self.gen_url + path, data=ctx_answer, headers=_JSON) as gen:
            await send({"type": "http.response.start", "status": gen.status, "headers": _SSE_HEADERS})
            async for chunk in gen.content.iter_any():
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
        await send({"type": "http.response.body", "body": b""})

    async def _lifespan(self, receive: Any, send: Any) -> None:
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                # The orchestrator's own read buffer (orchestrator/upstream/aiohttp.py): CTX's answer read whole.
                self.session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0), read_bufsize=2**21)
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                if self.session is not None:
                    await self.session.close()
                await send({"type": "lifespan.shutdown.complete"})
                return


async def _read_body(receive: Any) -> bytes:
    parts = []
    while True:
        message = await receive()
        parts.append(message.get("body", b""))
        if not message.get("more_body"):
            return b"".join(parts)


def main(argv: list[str] | None = None) -> int:
    parser = arguments(__doc__)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--ctx", required=True, help="the CTX worker's URL")
    parser.add_argument("--gen", required=True, help="the GEN worker's URL")
    args = parser.parse_args(argv)
    uvicorn.run(PassThroughProxy(args.ctx.rstrip("/"), args.gen.rstrip("/")), host="127.0.0.1", port=args.port,
                loop="uvloop", http="httptools", log_level="warning", lifespan="on")
    return 0


if __name__ == "__main__":
    sys.exit(main())
