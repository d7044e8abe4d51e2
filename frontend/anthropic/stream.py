"""A chat answer's SSE stream as Anthropic's event stream, in its order: ``message_start``, ``ping``, per content
block ``content_block_start`` / ``content_block_delta`` (``text_delta``, ``input_json_delta``) /
``content_block_stop``, then ``message_delta`` (stop reason and usage) and ``message_stop``; or an ``error`` event
where the chat stream ended with an error. The chat stream is asked for its usage on every chunk
(``stream_options.continuous_usage_stats``, vLLM's and TensorRT-LLM's option, which our workers and a CTX-finished
answer's replay honour too): its first chunk gives ``message_start`` the prompt's counts (as Anthropic's does: input
and cache-read tokens), its last fills ``message_delta``'s usage. With stop sequences, the chunks' logprobs are
read for the tokens' bytes (which stop sequence ended the answer: ``frontend.anthropic.translate.matched_stop``) and
not passed on. A chunk that cannot be translated ends the stream with an ``error`` event, logged with the request id
and its cause, rather than cutting the connection."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from typing import Any

import orjson

from frontend.anthropic.errors import error_event, error_event_from_openai
from frontend.anthropic.translate import matched_stop, message_id, stop_reason, token_bytes, tool_use_id, usage
from frontend.errors import ServingError
from frontend.logging_setup import request_id_var
from frontend.sse import FrameSplitter, close_frames, event_frame

logger = logging.getLogger("disagg_serve.messages")

_DATA = b"data: "
_DONE = b"[DONE]"


class MessagesStream:
    """The translation's state: which content block is open, and what the end events will say."""

    def __init__(self, stop_sequences: tuple[str, ...] = ()) -> None:
        self.stop_sequences = stop_sequences
        self.text: list[str] = []  # what was said, and the tokens' bytes, while a stop sequence may end it
        self.generated: list[bytes] = []
        self.started = False
        self.ended = False
        self.block: int | None = None  # the open block's index
        self.text_block = False  # the open block is text (else a tool_use)
        self.blocks = 0
        self.finish: str | None = None
        self.usage: dict[str, Any] | None = None

    def events(self, frame: bytes) -> list[bytes]:
        """The events for one whole chat SSE frame (``data: ...``)."""
        if self.ended:
            return []
        data = _data_of(frame)
        if data is None:
            return []
        if data == _DONE:
            return self._end()
        payload = orjson.loads(data)
        if "error" in payload:
            self.ended = True
            return [error_event_from_openai(payload)]
        events = [] if self.started else self._start(payload)
        if payload.get("usage"):
            self.usage = payload["usage"]
        for choice in payload.get("choices") or ():
            delta = choice.get("delta") or {}
            text = delta.get("content")
            if self.stop_sequences:
                self.generated.append(token_bytes(choice.get("logprobs")))
                self.text.append(text or "")
            if text:
                events += self._text(text)
            for call in delta.get("tool_calls") or ():
                events += self._tool_use(call)
            if choice.get("finish_reason") is not None:
                self.finish = choice["finish_reason"]
                events += self._close_block()
        return events

    def _start(self, chunk: dict[str, Any]) -> list[bytes]:
        self.started = True
        message = {"id": message_id(str(chunk.get("id", ""))), "type": "message", "role": "assistant",
                   "model": chunk.get("model", ""), "content": [], "stop_reason": None, "stop_sequence": None,
                   "usage": usage(chunk.get("usage"))}
        return [event_frame("message_start", {"type": "message_start", "message": message}),
                event_frame("ping", {"type": "ping"})]

    def _text(self, text: str) -> list[bytes]:
        events = []
        if self.block is not None and not self.text_block:
            events += self._close_block()
        if self.block is None:
            events.append(self._open({"type": "text", "text": ""}))
        events.append(event_frame("content_block_delta", {"type": "content_block_delta", "index": self.block,
                                                          "delta": {"type": "text_delta", "text": text}}))
        return events

    def _tool_use(self, call: dict[str, Any]) -> list[bytes]:
        """One chat tool-call delta: a call's first (with its id and name) opens a ``tool_use`` block, and the
        arguments of it and of those after it are ``input_json_delta`` pieces of that block."""
        events: list[bytes] = []
        function = call.get("function") or {}
        if call.get("id"):
            block = {"type": "tool_use", "id": tool_use_id(str(call["id"])), "name": function.get("name", ""),
                     "input": {}}
            events += [*self._close_block(), self._open(block)]
        arguments = function.get("arguments")
        if arguments and self.block is not None:
            events.append(event_frame("content_block_delta", {"type": "content_block_delta", "index": self.block,
                                                              "delta": {"type": "input_json_delta",
                                                                        "partial_json": arguments}}))
        return events

    def _open(self, content_block: dict[str, Any]) -> bytes:
        self.block = self.blocks
        self.blocks += 1
        self.text_block = content_block["type"] == "text"
        return event_frame("content_block_start", {"type": "content_block_start", "index": self.block,
                                                   "content_block": content_block})

    def _close_block(self) -> list[bytes]:
        if self.block is None:
            return []
        index, self.block = self.block, None
        return [event_frame("content_block_stop", {"type": "content_block_stop", "index": index})]

    def _end(self) -> list[bytes]:
        self.ended = True
        events = self._close_block()
        stop = None
        if self.finish == "stop":
            stop = matched_stop("".join(self.text), b"".join(self.generated), self.stop_sequences)
        delta = {"stop_reason": stop_reason(self.finish, stop), "stop_sequence": stop}
        events.append(event_frame("message_delta", {"type": "message_delta", "delta": delta,
                                                    "usage": usage(self.usage)}))
        events.append(event_frame("message_stop", {"type": "message_stop"}))
        return events


def _data_of(frame: bytes) -> bytes | None:
    for line in frame.split(b"\n"):
        if line.startswith(_DATA):
            return line[len(_DATA):].strip()
    return None


async def messages_events(frames: AsyncIterator[bytes], stop_sequences: tuple[str, ...] = ()
                          ) -> AsyncIterator[bytes]:
    """``frames`` (a chat stream, in pieces of any size) as Anthropic's events; ``stop_sequences``: the request's;
    ``frames`` is closed however this ends."""
    splitter = FrameSplitter()
    stream = MessagesStream(stop_sequences)
    try:
        async for piece in frames:
            try:
                events = [event for frame in splitter.feed(piece) for event in stream.events(frame)]
            except Exception:
                logger.exception("request %s: a chat chunk could not be written as Anthropic's events",
                                 request_id_var.get())
                yield error_event(ServingError("internal server error"))
                return
            if events:
                yield b"".join(events)
    finally:
        await close_frames(frames)
