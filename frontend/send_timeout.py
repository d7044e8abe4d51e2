"""Slow clients: an answer whose client stops reading is cut off after ``send_timeout_s``.

The server already bounds what one connection buffers: once the transport holds more than its high-water mark
(64 KiB) it stops the app's ``send`` until the client reads (flow control), so a client that does not read costs
the server at most that plus the kernel's socket buffers. What it does not bound is the *time*: the app waits in
``send`` for ever, holding its engine sequence (or, in the orchestrator, a GEN stream) all the while. This
middleware gives every ``send`` of an answer ``send_timeout_s``, its head's too (a pipelined request's answer
starts behind the one before it: a client that stopped reading that one kept its head waiting for ever); when one
runs out, the app is cancelled (its streams close, so the engine work is aborted as for a client that hung up) and
the connection is dropped (reset, buffer and all, where the server offers the ``ABORT_CONNECTION`` scope
extension; otherwise closed).
"""

from __future__ import annotations

import asyncio
import logging

from starlette.types import ASGIApp, Message, Receive, Scope, Send

logger = logging.getLogger("disagg_serve.http")  # the HTTP server's: it logs a client cut off

DEFAULT_SEND_TIMEOUT_S = 60.0
# A scope extension a server may offer: ``{"abort": callable}`` drops the connection at once (RST), buffer and all.
ABORT_CONNECTION = "disagg.abort_connection"
# A timeout's timer that fires this early counts as on time (event-loop timers round to the millisecond).
TIMER_SLACK_S = 0.001


def with_send_timeout(app: ASGIApp, send_timeout_s: float) -> ASGIApp:
    """``app`` with every answer's sends timed: by the app itself where it times its own (a ``FastPathApp``,
    ``frontend.asgi_fast_path``: it must not pay this middleware's task per send), else by the middleware."""
    limit = getattr(app, "limit_send_time", None)
    if limit is None:
        return SendTimeoutMiddleware(app, send_timeout_s)
    limit(send_timeout_s)
    return app


class ClientStalled(Exception):
    """The client read nothing of the answer for ``send_timeout_s``."""


class SendTimeoutMiddleware:
    def __init__(self, app: ASGIApp, send_timeout_s: float = DEFAULT_SEND_TIMEOUT_S) -> None:
        self.app = app
        self.send_timeout_s = send_timeout_s

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        stalled = False

        async def send_in_time(message: Message) -> None:
            nonlocal stalled
            try:
                # (A timer on the app's own task, not ``wait_for``'s task per send: every message is timed now.)
                async with asyncio.timeout(self.send_timeout_s):
                    await send(message)
            except TimeoutError:
                stalled = True
                abort_connection(scope)
                raise ClientStalled(f"the client read nothing for {self.send_timeout_s} s") from None

        try:
            await self.app(scope, receive, send_in_time)
        except BaseException:
            # The app may wrap our exception (a task group's ExceptionGroup) or answer it with its own; once the
            # client has stalled, whatever comes back is that, not a server fault.
            if not stalled:
                raise
            await asyncio.sleep(0)  # let the server see the aborted connection before the app's end is reported
            logger.warning("cut off a client that stopped reading %s after %s s",
                           scope.get("path", "?"), self.send_timeout_s)


def abort_connection(scope: Scope) -> None:
    """Drop the connection now if the server offers it: a plain close would first wait for the client to read what
    is still buffered for it, which is what it stopped doing. Otherwise the server closes when the app returns."""
    extension = scope.get("extensions", {}).get(ABORT_CONNECTION)
    if isinstance(extension, dict) and callable(extension.get("abort")):
        extension["abort"]()
