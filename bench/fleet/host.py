"""Many simulated workers in one process, for ``bench.fleet``: one event loop, one uvicorn server per worker.

    python -m bench.fleet.host --control-port P --worker context:PORT ... --worker generation:PORT ...
        [-- ENGINE FLAGS]

Each worker is built by the real ``disagg-serve worker`` code with only the final serve step taken over, so a
2-core machine is spared a dozen processes. A control server answers ``GET /health`` and ``GET /ledger`` (the
fleet's oracle, ``bench.fleet.ledger``); SIGTERM or SIGINT stops every server.
"""

from __future__ import annotations

import argparse
import asyncio
import signal
import socket
import sys
import threading
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any
from unittest import mock

import orjson
import uvicorn
import uvloop

from bench.driver.common import arguments
from bench.fleet.ledger import FleetLedger, record_every_prefill
from entrypoints import cli
from entrypoints.arguments import build_parser
from entrypoints.http.limits import ClientLimits
from entrypoints.http.protocol import guarded_protocol
from entrypoints.http.server import TickServer
from frontend.logging_setup import configure_logging
from frontend.send_timeout import with_send_timeout

LOOPBACK = "127.0.0.1"
Scope = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[MutableMapping[str, Any]]]
Send = Callable[[MutableMapping[str, Any]], Awaitable[None]]


def build_worker(role: str, port: int, engine_flags: list[str], log_level: str
                 ) -> tuple[Any, argparse.Namespace, socket.socket]:
    """The app ``disagg-serve worker`` would serve for these flags, its parsed arguments, and the socket it bound."""
    argv = ["--log-level", log_level, "worker", "--role", role, "--host", LOOPBACK, "--port", str(port),
            *engine_flags]
    args = build_parser().parse_args(argv)
    built: list[Any] = []

    def keep(app: Any, _args: argparse.Namespace, listener: socket.socket, **_options: object) -> int:
        built.append((app, listener))
        return 0

    with mock.patch.object(cli, "_serve", keep):
        status = cli.run_worker(args, argv)
    if status != 0 or len(built) != 1:
        raise SystemExit(f"fleet_host: the {role} worker on port {port} was not built (status {status})")
    app, listener = built[0]
    return app, args, listener


def worker_server(app: Any, args: argparse.Namespace, drop_fields: frozenset[str] = frozenset()) -> TickServer:
    """As ``entrypoints.cli._serve`` configures it: the same protocol, head, body and send limits
    (``drop_fields``: removed from the JSON bodies it is sent)."""
    limits = ClientLimits(args.header_timeout_s, args.body_timeout_s, args.max_head_bytes)
    cuts = app.state.metrics.connections_cut
    served = dropping_fields(app, drop_fields) if drop_fields else app
    config = uvicorn.Config(with_send_timeout(served, args.client_send_timeout_s), host=args.host, port=args.port,
                            log_level=args.log_level, loop="none", ws="none",
                            http=guarded_protocol(limits, app,  # type: ignore[arg-type]
                                                  lambda reason: cuts.labels(reason=reason).inc()),
                            timeout_graceful_shutdown=5, timeout_keep_alive=75, access_log=False, log_config=None)
    return TickServer(config)


def dropping_fields(app: Any, fields: frozenset[str]) -> Callable[[Scope, Receive, Send], Awaitable[None]]:
    """``app`` with ``fields`` removed from every JSON body POSTed to it: what a gateway adds for its own engines
    (vLLM's router sends SGLang's ``no_stop_trim``), which our workers refuse as an unknown argument."""
    async def wrapped(scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] != "POST":
            await app(scope, receive, send)
            return
        chunks = []
        while True:
            message = await receive()
            chunks.append(message.get("body", b""))
            if not message.get("more_body"):
                break
        body = b"".join(chunks)
        try:
            parsed = orjson.loads(body)
        except orjson.JSONDecodeError:
            parsed = None
        if isinstance(parsed, dict) and fields.intersection(parsed):
            body = orjson.dumps({k: v for k, v in parsed.items() if k not in fields})
            headers = [(k, v) for k, v in scope["headers"] if k != b"content-length"]
            scope = {**scope, "headers": [*headers, (b"content-length", str(len(body)).encode())]}
        sent = False

        async def replay() -> MutableMapping[str, Any]:
            nonlocal sent
            if sent:
                return await receive()  # after the body: a disconnect, when it comes
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}

        await app(scope, replay, send)

    return wrapped


def control_app(ledger: FleetLedger, servers: list[TickServer]) -> Callable[[Scope, Receive, Send], Awaitable[None]]:
    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return
        path = scope["path"]
        if path == "/health":
            ready = all(s.started for s in servers)
            status, body = (200, b'{"status":"ok"}') if ready else (503, b'{"status":"starting"}')
        elif path == "/ledger":
            status, body = 200, orjson.dumps(ledger.snapshot())
        else:
            status, body = 404, b'{"error":"not found"}'
        await send({"type": "http.response.start", "status": status,
                    "headers": [(b"content-type", b"application/json")]})
        await send({"type": "http.response.body", "body": body})

    return app


def main(argv: list[str] | None = None) -> int:
    raw = list(sys.argv[1:] if argv is None else argv)
    engine_flags: list[str] = []
    if "--" in raw:
        cut = raw.index("--")
        raw, engine_flags = raw[:cut], raw[cut + 1 :]
    parser = arguments(__doc__)
    parser.add_argument("--control-port", type=int, required=True)
    parser.add_argument("--worker", action="append", default=[], metavar="ROLE:PORT",
                        help="a worker to serve (context, generation or both), once per worker")
    parser.add_argument("--log-level", default="warning")
    parser.add_argument("--drop-fields", nargs="*", default=[],
                        help="top-level fields removed from every JSON body a worker is sent (what a gateway adds)")
    args = parser.parse_args(raw)
    configure_logging(args.log_level, "text")
    ledger = record_every_prefill()  # before any engine exists: every prefill of this process is recorded
    servers: list[TickServer] = []
    listeners: list[socket.socket | None] = []
    for spec in args.worker:
        role, _, port = spec.partition(":")
        app, worker_args, listener = build_worker(role, int(port), engine_flags, args.log_level)
        servers.append(worker_server(app, worker_args, frozenset(args.drop_fields)))
        listeners.append(listener)
    control = TickServer(uvicorn.Config(control_app(ledger, servers), host=LOOPBACK, port=args.control_port,
                                         log_level=args.log_level, loop="none", lifespan="off",
                                         access_log=False, log_config=None))
    everything = [*servers, control]
    listeners.append(None)  # the control server binds its own port

    def stop(*_: object) -> None:
        for server in everything:
            server.should_exit = True

    def serve_all() -> None:
        # A thread of its own: uvicorn takes the process's signals only in the main thread, where one handler
        # here stops every server at once instead of each server's replacing the last one's.
        loop = uvloop.new_event_loop()
        asyncio.set_event_loop(loop)

        async def run() -> None:
            await asyncio.gather(*(server.serve(sockets=[listener] if listener is not None else None)
                                   for server, listener in zip(everything, listeners, strict=True)))

        try:
            loop.run_until_complete(run())
        finally:
            loop.close()

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    thread = threading.Thread(target=serve_all, name="fleet-host", daemon=True)
    thread.start()
    while thread.is_alive():
        thread.join(0.5)
    return 0


if __name__ == "__main__":
    sys.exit(main())
