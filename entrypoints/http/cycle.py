"""One request on a connection and its answer: the state the connection and the request's handler share
(``RequestCycle``), how an answer's writes wait for a client that reads slowly (``FlowControl``), ASGI's ``receive``
and ``send`` for a request served through an app, and the rules every answer keeps, whoever writes it (an app
through ``send``, a fast route's exchange through ``answer_head`` and the same fields): docs/http.md lists them.
"""

from __future__ import annotations

import asyncio
import http
import logging
import re
from collections.abc import Callable
from typing import Any

from frontend.errors import ServingError, error_body
from frontend.http import request_id_of

# The HTTP server's logger: what an operator's filters name.
logger = logging.getLogger("disagg_serve.http")

# A body read piece by piece (no declared length, or one too long to be read whole) pauses the socket past this
# many unread bytes, until the handler takes them.
HIGH_WATER_LIMIT = 64 * 1024

CONTINUE = b"HTTP/1.1 100 Continue\r\n\r\n"
LAST_CHUNK = b"0\r\n\r\n"
CLOSE = b"connection: close\r\n"
CHUNKED = b"transfer-encoding: chunked\r\n"
_TOKEN = re.compile(rb"[!#$%&'*+\-.^_`|~0-9A-Za-z]+")  # a header name (RFC 9110 5.6.2)
_NOT_IN_VALUE = re.compile(rb"[\x00-\x08\x0a-\x1f\x7f]")  # what a header value may not hold (RFC 9110 5.5)
_BODILESS = (204, 304)


def _status_line(status: int) -> bytes:
    try:
        phrase = http.HTTPStatus(status).phrase
    except ValueError:
        phrase = ""
    return f"HTTP/1.1 {status} {phrase}\r\n".encode("ascii")


STATUS_LINE = {status: _status_line(status) for status in range(100, 600)}


# The server's default headers (date, and any the configuration adds) as header lines, made once per list:
# uvicorn's server replaces the list when the date changes, once a second.
_default_cache: tuple[list[tuple[bytes, bytes]], bytes] = ([], b"")


def default_header_lines(defaults: list[tuple[bytes, bytes]]) -> bytes:
    """The lines of ``defaults`` but ``server``: uvicorn's ``server: uvicorn`` names software that does not even
    serve the connection, and a header naming the implementation only tells a prober which flaws to try."""
    global _default_cache
    cached, lines = _default_cache
    if cached is not defaults:
        lines = b"".join(b"%b: %b\r\n" % (name, value) for name, value in defaults if name.lower() != b"server")
        _default_cache = (defaults, lines)
    return lines


def head(status: int, default_headers: list[tuple[bytes, bytes]], header_lines: list[bytes]) -> bytes:
    """An answer's head: the status line, the server's default headers, ``header_lines`` (as bytes), the blank
    line. (A refusal the protocol answers without a cycle writes its head here too.)"""
    return b"".join((STATUS_LINE[status], default_header_lines(default_headers), *header_lines, b"\r\n"))


class FlowControl:
    """A connection's two directions: reading paused while a body's reader is behind, and writes paused while the
    transport holds more than its high-water mark (``drain`` waits until it is below its low-water mark again)."""

    __slots__ = ("_transport", "_writable", "read_paused", "write_paused")

    def __init__(self, transport: asyncio.Transport) -> None:
        self._transport = transport
        self.read_paused = False
        self.write_paused = False
        self._writable = asyncio.Event()
        self._writable.set()

    async def drain(self) -> None:
        await self._writable.wait()

    def pause_reading(self) -> None:
        if not self.read_paused:
            self.read_paused = True
            self._transport.pause_reading()

    def resume_reading(self) -> None:
        if self.read_paused:
            self.read_paused = False
            self._transport.resume_reading()

    def pause_writing(self) -> None:
        self.write_paused = True
        self._writable.clear()

    def resume_writing(self) -> None:
        self.write_paused = False
        self._writable.set()


class RequestCycle:
    """A request's state, shared by the connection that parses it and the handler that answers it."""

    __slots__ = ("_bodiless", "_close_unread", "body", "chunked_encoding", "default_headers", "disconnected",
                 "expected_content_length", "flow", "keep_alive", "message_event", "more_body", "on_response",
                 "response_complete", "response_started", "scope", "transport", "unframed",
                 "waiting_for_100_continue")

    def __init__(self, scope: dict[str, Any], transport: asyncio.Transport, flow: FlowControl,
                 default_headers: list[tuple[bytes, bytes]], keep_alive: bool, expect_100_continue: bool,
                 on_response: Callable[[], None], close_unread: Callable[[], None]) -> None:
        self.scope = scope
        self.transport = transport
        self.flow = flow
        self.default_headers = default_headers
        self.keep_alive = keep_alive
        self.waiting_for_100_continue = expect_100_continue
        self.on_response = on_response  # the connection's: its next request may start
        self._close_unread = close_unread
        self.message_event = asyncio.Event()  # set when the body moves, the answer completes, or the client leaves
        self.disconnected = False  # the client left (or was cut off) before the answer was complete
        self.body: bytes | bytearray = bytearray()  # what of the body the handler has not taken yet
        self.more_body = True  # the body is not all parsed yet
        self.response_started = False
        self.response_complete = False
        self.chunked_encoding: bool | None = None  # None until the answer's head says
        self.expected_content_length = 0  # what is left of an answer's declared length
        self.unframed = False  # an HTTP/1.0 answer of no declared length: the connection's end is its end
        self._bodiless = False  # HEAD, 204, 304: whatever body the app sends is not written

    def end(self) -> None:
        """The answer is complete: the connection closes if it is not kept (without resetting a client still
        sending a body no one will read), and its next request may start."""
        self.response_complete = True
        self.message_event.set()
        if self.more_body:
            self._close_unread()
        elif not self.keep_alive:
            self.transport.close()
        self.on_response()

    # -- served through ASGI ------------------------------------------------------------------------------------
    async def run_asgi(self, app: Any) -> None:
        """Run the app on this request; what it leaves unanswered is a 500, what it leaves cut short a closed
        connection, each logged with the request's id."""
        try:
            result = await app(self.scope, self.receive, self.send)
        except asyncio.CancelledError:
            self._log_error("cancelled by the server's shutdown", None)
            self.end_broken()
            raise
        except BaseException as exc:  # (a SystemExit or an exception group too: the server keeps serving)
            self._log_error("failed", exc)
            self.end_broken()
        else:
            if result is not None:
                self._log_error(f"the app returned {result!r} instead of None", None)
                self.transport.close()
            elif not self.disconnected and not self.response_complete:
                self._log_error("the app returned without completing its answer", None)
                self.end_broken()
        finally:
            self.detach()

    def _log_error(self, what: str, exc: BaseException | None) -> None:
        logger.error("request %s on %s %s: %s", request_id_of(self.scope["headers"]), self.scope["method"],
                     self.scope["path"], what, exc_info=exc)

    def end_broken(self, request_id: str | None = None) -> None:
        """A 500 if nothing was answered yet, else a closed connection (an answer cut short must not look whole).
        ``request_id``: the one the failure was logged with (else the client's, or a new one)."""
        if self.response_complete:
            return  # (the connection may be serving its next request)
        if self.response_started or self.disconnected or self.transport.is_closing():
            self.transport.close()
            return
        self.keep_alive = False
        self.chunked_encoding, self.expected_content_length = None, 0  # what a refused head may have set
        body = error_body(ServingError("internal server error"))
        request_id = request_id or request_id_of(self.scope["headers"])
        head = self._head(500, ((b"content-type", b"application/json"), (b"content-length", b"%d" % len(body)),
                                (b"x-request-id", request_id.encode())))
        self.transport.write(head + (b"" if self._bodiless else body))
        self.end()

    def detach(self) -> None:
        """The handler is done: whatever it still does, the connection's next request is not this one's to start."""
        self.on_response = _nothing

    def continue_if_awaited(self) -> None:
        """The ``100 Continue`` a client that asked for it waits for before it sends the body, once the handler
        reads the body; never after an answer, or once our side is shut."""
        if self.waiting_for_100_continue and not self.transport.is_closing() and not self.response_complete:
            self.transport.write(CONTINUE)
            self.waiting_for_100_continue = False

    async def receive(self) -> dict[str, Any]:
        self.continue_if_awaited()
        if not self.disconnected and not self.response_complete:
            self.flow.resume_reading()  # paused past HIGH_WATER_LIMIT of a body read piece by piece
            await self.message_event.wait()
            self.message_event.clear()
        if self.disconnected or self.response_complete:
            return {"type": "http.disconnect"}
        body = self.body
        self.body = bytearray()
        return {"type": "http.request", "body": body if type(body) is bytes else bytes(body),
                "more_body": self.more_body}

    async def send(self, message: dict[str, Any]) -> None:
        if self.flow.write_paused and not self.disconnected:
            await self.flow.drain()
        if self.disconnected:
            return  # the client is gone: what the app still sends has nowhere to go
        kind = message["type"]
        if not self.response_started:
            if kind != "http.response.start":
                raise RuntimeError(f"an answer starts with 'http.response.start', not {kind!r}")
            self.transport.write(self._head(message["status"], message.get("headers", ())))
        elif not self.response_complete:
            if kind != "http.response.body":
                raise RuntimeError(f"an answer's head is followed by 'http.response.body', not {kind!r}")
            self._write_body(message.get("body", b""), message.get("more_body", False))
        else:
            raise RuntimeError(f"{kind!r} sent after the answer was complete")

    def _head(self, status: int, headers: Any) -> bytes:
        """An app's answer head: its headers checked (a header built from a client's input cannot split the
        answer) and read for the answer's framing, then written by ``answer_head``."""
        lines: list[bytes] = []
        says_close = False
        for raw_name, value in headers:
            if not _TOKEN.fullmatch(raw_name):
                raise RuntimeError(f"invalid header name {raw_name!r}")
            if _NOT_IN_VALUE.search(value):
                raise RuntimeError(f"invalid value of header {raw_name!r}")
            name = raw_name.lower()
            if name == b"content-length" and self.chunked_encoding is None:
                if not value.isdigit():
                    raise RuntimeError(f"invalid content-length {value!r}")
                self.expected_content_length = int(value)
                self.chunked_encoding = False
            elif name == b"transfer-encoding" and value.lower() == b"chunked":
                if self.scope["http_version"] == "1.0":
                    continue  # no chunks for HTTP/1.0, even if the app asks: sent unframed (below)
                self.expected_content_length = 0
                self.chunked_encoding = True
            elif name == b"connection" and b"close" in (token.strip().lower() for token in value.split(b",")):
                self.keep_alive = False
                says_close = True
            lines += (name, b": ", value, b"\r\n")
        self._bodiless = self.scope["method"] == "HEAD" or status in _BODILESS
        chunked = False
        if self.chunked_encoding is None and not self._bodiless:
            if self.scope["http_version"] == "1.0":
                self.unframed = True  # no chunks for HTTP/1.0: the connection's end is the body's (it is not kept)
            else:
                self.chunked_encoding = chunked = True
        return self.answer_head(status, lines, says_close=says_close, chunked=chunked)

    def answer_head(self, status: int, header_lines: list[bytes], *, says_close: bool, chunked: bool) -> bytes:
        """The answer's head, whoever writes it (an app through ``send``, a fast route's exchange): the status
        line, the server's default headers, ``header_lines`` (the answer's own, as bytes), ``connection: close``
        when the connection is not kept (unless they say it), ``transfer-encoding: chunked`` when ``chunked``. The
        answer counts as started from here: no ``100 Continue`` after it, and no 500 in its place."""
        if self.more_body:
            self.keep_alive = False  # answered before its body is in: closed after the answer (``end``)
        if not self.keep_alive and not says_close:
            header_lines.append(CLOSE)
        if chunked:
            header_lines.append(CHUNKED)
        self.response_started = True
        self.waiting_for_100_continue = False
        return head(status, self.default_headers, header_lines)

    def _write_body(self, body: bytes, more: bool) -> None:
        if self._bodiless:
            pass
        elif self.chunked_encoding:
            if not more:
                self.transport.write(last_chunk(body))
            elif body:
                self.transport.write(b"%x\r\n%b\r\n" % (len(body), body))
        elif self.unframed:
            if body:
                self.transport.write(body)
        else:
            if len(body) > self.expected_content_length:
                raise RuntimeError("the answer's body is longer than its content-length")
            self.expected_content_length -= len(body)
            if body:
                self.transport.write(body)
        if not more:
            if self.expected_content_length and not self._bodiless:
                raise RuntimeError("the answer's body is shorter than its content-length")
            self.end()


def last_chunk(body: bytes) -> bytes:
    """``body`` as the last chunk of a chunked answer, with the chunked body's end."""
    return b"%x\r\n%b\r\n%b" % (len(body), body, LAST_CHUNK) if body else LAST_CHUNK


def _nothing() -> None:
    pass
