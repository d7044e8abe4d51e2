"""A bare-ASGI path for a server's few hot routes, in front of its FastAPI app, with what that stack gives a route.

Why: at 1k tokens most of the orchestrator's CPU per request was per-request machinery, not its work
(docs/performance-history.md): FastAPI's routing, three ASGI middlewares each wrapping ``send``,
``cancel_on_disconnect``'s two tasks, ``asyncio.wait_for``'s task per ``send`` (Python 3.11), and starlette's
``StreamingResponse`` with its anyio task group and disconnect listener. Here one ``Exchange`` per request does all
of it from the handler's own coroutine: no task, no wrapper around ``send``, the stream written to ``send`` as it
comes.

What it keeps, each with the code that does the same for the routes FastAPI serves:

- ``X-Request-Id`` on every answer, errors included, and in the log context (``frontend.http._RequestIds``);
- errors answered in OpenAI's shape, every 5xx logged with its request id and cause, an unexpected exception a 500
  that keeps the keep-alive connection (``frontend.http.install_error_handlers``);
- a client that reads nothing for ``send_timeout_s`` is cut off (``frontend.send_timeout``): one timer per
  request, re-armed only while a ``send`` is blocked;
- a client that goes away cancels the handler wherever it waits (``cancel_on_disconnect``, ``StreamingResponse``):
  told by the server when it offers the ``CLIENT_GONE`` scope extension (``entrypoints/http/protocol.py``),
  otherwise by one task waiting on ``receive``.

Any other path, or another method on these paths, goes to the FastAPI app, which also lists the fast routes in its
OpenAPI schema and answers their 405s.

The exchange is written once for the handler (``Exchange``) and twice for how its bytes move: ``AsgiExchange`` on
any ASGI server, and ``entrypoints/http/exchange.py``'s on the project's own protocol, which serves these routes
without ASGI at all (``disagg-serve`` runs that one).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Mapping
from contextlib import aclosing
from functools import partial
from typing import Any, Protocol

from fastapi import FastAPI
from starlette.datastructures import Headers
from starlette.responses import Response
from starlette.types import ASGIApp, Receive, Scope, Send

from frontend.errors import ServingError, error_body
from frontend.http import (
    CLIENT_CLOSED_REQUEST,
    ClientDisconnected,
    answered_status,
    log_server_error,
    request_id_of,
    too_large,
)
from frontend.logging_setup import request_id_var
from frontend.send_timeout import TIMER_SLACK_S, SendTimeoutMiddleware, abort_connection

logger = logging.getLogger(__name__)

# A scope extension a server may offer: ``{"callbacks": set}``, a set the app adds a callback to, each called (and
# the set emptied) when the client's connection is lost. Without it, the exchange learns of a disconnect by waiting
# on ``receive`` in a task.
CLIENT_GONE = "disagg.client_gone"

Handler = Callable[["Exchange"], Awaitable[None]]
RawHeaders = list[tuple[bytes, bytes]]
# Takes one piece of a streamed answer, written as it is; returns False when the client is behind (the writer should
# wait for ``Drained`` before it sends more).
ChunkWriter = Callable[[bytes], bool]
Drained = Callable[[], Awaitable[object]]
# Takes a streamed answer's last piece and ends the answer with it, in one send; any piece written after it is
# dropped (nothing may follow a stream's end marker).
LastChunkWriter = Callable[[bytes], None]


class PushedStream(Protocol):
    """A streamed answer that can push its pieces to the client as they arrive, from the callback that read them,
    instead of being iterated: a piece then costs no wake-up of the handler's coroutine chain."""

    def frames(self) -> AsyncIterator[bytes]:
        """The same pieces, as an iterator (for an exchange that cannot take pushes, or a wrapper that reads them)."""
        ...

    async def push(self, write: ChunkWriter, drained: Drained, finish: LastChunkWriter) -> None:
        """Write every piece with ``write``, awaiting ``drained`` whenever it returns False, and the piece that holds
        the stream's end marker with ``finish``; return at the end of what was read."""
        ...

_JSON_TYPE = (b"content-type", b"application/json")


class FastPathApp(FastAPI):
    """A FastAPI app whose ``fast_post`` routes never enter FastAPI's stack."""

    def __init__(self, **options: Any) -> None:
        super().__init__(**options)
        self._fast: dict[str, Handler] = {}
        self._send_timeout_s: float | None = None
        self._rest: ASGIApp = partial(FastAPI.__call__, self)

    def fast_post(self, path: str, handler: Handler, **route_options: Any) -> None:
        """Serve POST ``path`` with ``handler``; ``route_options`` go to the FastAPI route kept for the schema."""
        self._fast[path] = handler
        self.add_api_route(path, _served_by_the_fast_path, methods=["POST"], **route_options)

    @property
    def fast_routes(self) -> Mapping[str, Handler]:
        """The POST paths served bare, with their handlers (for a server that serves them itself)."""
        return self._fast

    @property
    def send_timeout_s(self) -> float | None:
        """How long one send of a fast route's answer may wait for the client (None: for ever)."""
        return self._send_timeout_s

    def limit_send_time(self, send_timeout_s: float) -> None:
        """Cut off a client that reads nothing for ``send_timeout_s``: the fast routes time their own sends, the
        rest go through ``SendTimeoutMiddleware`` (``frontend.send_timeout.with_send_timeout`` calls this)."""
        self._send_timeout_s = send_timeout_s
        self._rest = SendTimeoutMiddleware(partial(FastAPI.__call__, self), send_timeout_s)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["method"] == "POST":
            handler = self._fast.get(scope["path"])
            if handler is not None:
                await AsgiExchange(scope, receive, send, self._send_timeout_s).serve(handler)
                return
        await self._rest(scope, receive, send)


async def _served_by_the_fast_path() -> Response:
    # The FastAPI route of a fast path is in the schema and answers other methods' 405s; it never serves the POST
    # (``FastPathApp.__call__`` does). No docstring: FastAPI would publish it as the route's description.
    raise RuntimeError("a fast-path route reached FastAPI")


class Exchange:
    """One request and its answer, served from the handler's coroutine. How the bytes move is a subclass's:
    ``AsgiExchange`` through ASGI's ``receive`` and ``send``, or a server's own (``entrypoints/http/exchange.py``
    writes to the connection directly)."""

    __slots__ = ("_complete", "_cut", "_send_timeout_s", "_started", "_task", "request_id", "scope")

    def __init__(self, scope: Scope, send_timeout_s: float | None) -> None:
        self.scope = scope
        self.request_id = request_id_of(scope["headers"])
        self._send_timeout_s = send_timeout_s
        self._task: asyncio.Task[Any] | None = None
        self._cut: str | None = None  # "left" or "stalled" once the handler was cancelled for the client
        self._started = False  # the answer's status line is sent: an error can no longer be answered
        self._complete = False  # the answer's last piece is being sent

    # -- the request ---------------------------------------------------------------------------------------------
    def header(self, name: bytes) -> str | None:
        """The first value of the (lower-case) header ``name``."""
        for key, value in self.scope["headers"]:
            if key == name:
                return str(value.decode("latin-1"))
        return None

    @property
    def headers(self) -> Headers:
        return Headers(raw=self.scope["headers"])

    async def read_body(self, max_bytes: int) -> bytes:
        """The whole body, or ``PayloadTooLargeError`` as soon as it is known to exceed ``max_bytes``."""
        declared = self.header(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > max_bytes:
            raise too_large(max_bytes, declared)
        return await self._read(max_bytes)

    # -- the answer ----------------------------------------------------------------------------------------------
    async def answer(self, body: bytes, status: int = 200, headers: Iterable[tuple[bytes, bytes]] = ()) -> None:
        """A whole JSON answer (the headers as starlette's ``Response`` writes them, request id last)."""
        self._started = self._complete = True
        await self._send_whole(status, self._whole_headers(body, headers), body)

    def _whole_headers(self, body: bytes, headers: Iterable[tuple[bytes, bytes]] = ()) -> RawHeaders:
        """A whole JSON answer's headers: ``headers``, then its length, type and request id."""
        return [*headers, (b"content-length", b"%d" % len(body)), _JSON_TYPE,
                (b"x-request-id", self.request_id.encode())]

    async def stream(self, frames: AsyncIterator[bytes], headers: RawHeaders) -> None:
        """A 200 streamed chunk by chunk as ``frames`` yields them; ``frames`` is closed however the stream ends."""
        async with aclosing(frames) as chunks:  # type: ignore[type-var]  # any iterator with aclose
            self._started = True
            await self._send_start(200, [*headers, (b"x-request-id", self.request_id.encode())])
            async for chunk in chunks:
                await self._send_body(chunk, True)
        self._complete = True
        await self._send_body(b"", False)

    async def push(self, pushed: PushedStream, headers: RawHeaders) -> None:
        """A 200 streamed as ``pushed`` writes it; an exchange that cannot take pushes iterates it (``stream``)."""
        await self.stream(pushed.frames(), headers)

    def status_of(self, exc: BaseException) -> int:
        """The status a request ending in ``exc`` is counted with: ``answered_status``, and 499 for the
        cancellation of a client that left or stalled."""
        if self._cut is not None and isinstance(exc, asyncio.CancelledError):
            return CLIENT_CLOSED_REQUEST
        return answered_status(exc)

    # -- how the bytes move (the subclass's) ---------------------------------------------------------------------
    async def _read(self, max_bytes: int) -> bytes:
        """The whole body, ``too_large`` past ``max_bytes``, ``ClientDisconnected`` if the client left."""
        raise NotImplementedError

    async def _send_start(self, status: int, headers: RawHeaders) -> None:
        raise NotImplementedError

    async def _send_body(self, body: bytes, more: bool) -> None:
        raise NotImplementedError

    async def _send_whole(self, status: int, headers: RawHeaders, body: bytes) -> None:
        await self._send_start(status, headers)
        await self._send_body(body, False)

    def _watch(self) -> None:
        """Start watching for the client leaving (``_client_left``)."""

    def _unwatch(self) -> None:
        """Stop watching the client, and every timer of the answer."""

    # -- serving -------------------------------------------------------------------------------------------------
    async def serve(self, handler: Handler) -> None:
        """Run ``handler`` and answer what it raises, as ``frontend.http``'s handlers and middlewares do."""
        token = request_id_var.set(self.request_id)
        self._task = asyncio.current_task()
        self._watch()
        try:
            await self._answer_errors(handler)
        except asyncio.CancelledError:
            if self._cut is None:
                raise  # not ours: the server is shutting down
            await self._after_cut()
        finally:
            self._unwatch()
            request_id_var.reset(token)

    async def _answer_errors(self, handler: Handler) -> None:
        try:
            await handler(self)
        except ClientDisconnected:
            pass  # gone before the body was read: nothing to answer, nothing to log
        except ServingError as exc:
            if self._started:
                raise  # too late to answer: the server drops the connection
            if exc.status_code >= 500:
                log_server_error(self.request_id, exc, "POST", self.scope["path"])
            await self.answer(error_body(exc), exc.status_code, _raw(exc.headers))
        except Exception as exc:
            if self._started:
                raise
            logger.exception("unhandled error", exc_info=exc)
            await self.answer(error_body(ServingError("internal server error")), 500)

    def _client_left(self) -> None:
        if not self._complete:  # gone once its answer was all sent: the handler's cleanup is not cut short
            self._cut_off("left")

    def _cut_off(self, why: str) -> None:
        # A task the server is already cancelling (its shutdown) keeps that cancellation: it is not a client's.
        if self._cut is None and self._task is not None and not self._task.done() and not self._task.cancelling():
            self._cut = why
            self._task.cancel()

    async def _after_cut(self) -> None:
        assert self._task is not None
        self._task.uncancel()  # ours, taken: what the request does after this is not cancelled
        if self._cut == "stalled":
            await asyncio.sleep(0)  # let the server see the aborted connection before the app's end is reported
            logger.warning("cut off a client that stopped reading %s after %s s", self.scope["path"],
                           self._send_timeout_s)


class AsgiExchange(Exchange):
    """An exchange over ASGI's ``receive`` and ``send``.

    A client that reads nothing for ``send_timeout_s`` is cut off: one timer per request, re-armed only while a
    ``send`` is blocked. A client that goes away cancels the handler wherever it waits: told by the server when it
    offers the ``CLIENT_GONE`` scope extension, otherwise by one task waiting on ``receive``."""

    __slots__ = ("_blocked_since", "_gone", "_loop", "_receive", "_send", "_timer", "_watcher")

    def __init__(self, scope: Scope, receive: Receive, send: Send, send_timeout_s: float | None) -> None:
        super().__init__(scope, send_timeout_s)
        self._receive = receive
        self._send = send
        self._blocked_since: float | None = None  # loop time of the send in progress, for the send timeout
        self._loop: asyncio.AbstractEventLoop | None = None  # set with the send timer
        self._timer: asyncio.TimerHandle | None = None
        self._watcher: asyncio.Future[None] | None = None
        self._gone: set[Callable[[], None]] | None = None

    async def _read(self, max_bytes: int) -> bytes:
        chunks: list[bytes] = []
        size = 0
        more = True
        while more:
            message = await self._receive()
            if message["type"] == "http.disconnect":
                raise ClientDisconnected()
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > max_bytes:
                raise too_large(max_bytes)
            if chunk:
                chunks.append(chunk)
            more = message.get("more_body", False)
        if self._gone is None:  # nothing more to receive but the disconnect: wait for it
            self._watcher = asyncio.ensure_future(self._wait_for_disconnect())
        return chunks[0] if len(chunks) == 1 else b"".join(chunks)

    async def _send_start(self, status: int, headers: RawHeaders) -> None:
        if self._send_timeout_s is not None:
            self._loop = asyncio.get_running_loop()
            self._timer = self._loop.call_later(self._send_timeout_s, self._check_stalled, self._send_timeout_s)
        message = {"type": "http.response.start", "status": status, "headers": headers}
        if self._loop is None:
            await self._send(message)
            return
        # Timed like a body send: uvicorn's send waits for the client to drain whatever message it is given.
        self._blocked_since = self._loop.time()
        await self._send(message)
        self._blocked_since = None

    async def _send_body(self, body: bytes, more: bool) -> None:
        if self._loop is None:
            await self._send({"type": "http.response.body", "body": body, "more_body": more})
            return
        self._blocked_since = self._loop.time()
        await self._send({"type": "http.response.body", "body": body, "more_body": more})
        self._blocked_since = None

    def _watch(self) -> None:
        gone = self.scope.get("extensions", {}).get(CLIENT_GONE)
        if gone is not None:
            self._gone = gone["callbacks"]
            self._gone.add(self._client_left)

    async def _wait_for_disconnect(self) -> None:
        while True:
            message = await self._receive()
            if message["type"] == "http.disconnect":  # also what uvicorn says once the answer is complete
                self._client_left()
                return

    def _check_stalled(self, timeout_s: float) -> None:
        """The send timer: fires ``timeout_s`` after the answer started, then after each send that was blocked
        when it last fired; cuts the client off once one send has been blocked for ``timeout_s``."""
        assert self._loop is not None
        now, since = self._loop.time(), self._blocked_since
        if since is not None and now - since >= timeout_s - TIMER_SLACK_S:
            self._timer = None
            abort_connection(self.scope)
            self._cut_off("stalled")
            return
        self._timer = self._loop.call_at((now if since is None else since) + timeout_s, self._check_stalled,
                                         timeout_s)

    def _unwatch(self) -> None:
        if self._gone is not None:
            self._gone.discard(self._client_left)
        if self._watcher is not None:
            self._watcher.cancel()
        if self._timer is not None:
            self._timer.cancel()


def _raw(headers: dict[str, str]) -> RawHeaders:
    return [(name.lower().encode("latin-1"), value.encode("latin-1")) for name, value in headers.items()]

