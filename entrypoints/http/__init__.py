"""The front ends' HTTP/1.1 server: uvicorn's ``Server`` listens, runs the app's lifespan, renews the ``Date``
header and shuts down in order; every byte on a connection is this package's own protocol's, so that no limit a
client is held to (docs/http.md) rests on another project's private code.

``serve`` is the one place the pieces meet: the socket (``listener``), the tick (``server``), the protocol holding
clients to ``ClientLimits`` (``protocol``, ``limits``), a request's answer (``cycle``), a fast route served on the
connection itself (``exchange``).

What it relies on of uvicorn outside its documented API (``__all__ = [main, run, Config, Server]``), each checked
on the installed version by tests/entrypoints/http/test_uvicorn_contract.py (pyproject.toml pins the range):

- the protocol factory call: ``http=`` a class, called as ``(config=, server_state=, app_state=, _loop=)``, and
  ``shutdown()`` called on each connection when the server stops;
- ``Config.load()``, ``.loaded``, ``.loaded_app``, ``.root_path``, ``.timeout_keep_alive``, ``.reset_contextvars``;
- ``ServerState.connections`` and ``.tasks`` (what a graceful shutdown waits for), ``.default_headers``,
  ``.total_requests``;
- ``Server.main_loop`` (overridden), ``Server.on_tick(counter)`` (called; it renews the date when ``counter`` is a
  multiple of 10), ``Server.should_exit`` (made a property), ``Server.started``;
- ``on_tick`` *rebinding* ``default_headers`` to a new list when it renews the date, which
  ``cycle.default_header_lines`` caches by identity.
"""

from __future__ import annotations

import socket
import sys
from collections.abc import Awaitable, Callable
from typing import Any

import uvicorn

from entrypoints.http.limits import ClientLimits
from entrypoints.http.listener import address
from entrypoints.http.protocol import guarded_protocol
from entrypoints.http.server import TickServer
from frontend.send_timeout import with_send_timeout

STARTUP_FAILED = 3  # uvicorn's own exit status for an app whose start-up failed (uvicorn.run exits with it)
KEEP_ALIVE_S = 75  # how long an idle kept connection stays open
GRACEFUL_SHUTDOWN_S = 30  # how long a stop waits for the answers in progress before it cancels them
AFTER_DRAIN_S = 1  # the same, after a drain (``before_stop``) that already waited for them: what is left is cut


def serve(app: Any, listener: socket.socket, limits: ClientLimits, *, send_timeout_s: float, log_level: str,
          before_stop: Callable[[], Awaitable[object]] | None = None) -> int:
    """Serve ``app`` on ``listener`` (bound, not yet listening), holding every client to ``limits`` and cutting
    off one that takes nothing of an answer for ``send_timeout_s`` (the protocol's flow control already caps what a
    client that does not read makes us buffer). ``before_stop``: what a stop runs while the server still listens
    (a worker's drain, workers/drain.py); the answers still running after it are cut within ``AFTER_DRAIN_S``. The
    exit status: 0 after a clean stop, ``STARTUP_FAILED`` for an app that did not start or a port another socket
    listened on first."""
    cuts = app.state.metrics.connections_cut
    host, port = address(listener)
    config = uvicorn.Config(with_send_timeout(app, send_timeout_s), host=host, port=port,
                            log_level=log_level, loop="uvloop",
                            # The package's own protocol, which offers no upgrade: no WebSocket protocol is loaded.
                            # (uvicorn calls ``http`` as a protocol factory; its hint names only asyncio.Protocol.)
                            ws="none", http=guarded_protocol(limits, app,  # type: ignore[arg-type]
                                                  lambda reason: cuts.labels(reason=reason).inc()),
                            timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_S if before_stop is None else AFTER_DRAIN_S,
                            timeout_keep_alive=KEEP_ALIVE_S, access_log=False, log_config=None)
    server = TickServer(config, before_stop)
    try:
        server.run(sockets=[listener])
    except OSError as exc:
        if server.started:
            raise
        # Bound, but another socket that shares the port (SO_REUSEADDR, ``listener``) listened on it first.
        print(f"disagg-serve: cannot listen on {host}:{port}: {exc.strerror}", file=sys.stderr)
        return STARTUP_FAILED
    # An engine that failed to start (its error is already logged) must not look like a clean stop to whatever
    # started the process: ``up``, a container runtime, a supervisor.
    return 0 if server.started else STARTUP_FAILED
