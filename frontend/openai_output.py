"""OpenAI response shapes for the three endpoints: whole responses, stream frames, and replays.

Shared by the workers (which produce answers) and the orchestrator (which, when CTX finished a streaming request
by itself, replays CTX's whole response as a stream). Knows nothing of tokenizers: callers pass token strings.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from frontend.errors import ServingError, responses_error_event, sse_error_event
from frontend.sse import DONE_FRAME, data_frame, event_frame

Endpoint = Literal["chat", "completions", "responses"]


@dataclass(frozen=True, slots=True)
class TokenLogprobInfo:
    token: str
    logprob: float
    top: tuple[tuple[str, float], ...] = ()


@dataclass(frozen=True, slots=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int

    def as_openai(self, endpoint: Endpoint) -> dict[str, Any]:
        if endpoint == "responses":
            return {
                "input_tokens": self.prompt_tokens,
                "input_tokens_details": {"cached_tokens": 0, "cache_write_tokens": 0},
                "output_tokens": self.completion_tokens,
                "output_tokens_details": {"reasoning_tokens": 0},
                "total_tokens": self.prompt_tokens + self.completion_tokens,
            }
        return {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "total_tokens": self.prompt_tokens + self.completion_tokens,
        }


@dataclass(frozen=True, slots=True)
class ResponseIdentity:
    endpoint: Endpoint
    response_id: str
    model: str
    created: int = field(default_factory=lambda: int(time.time()))


def _utf8(text: str) -> list[int]:
    return list(text.encode("utf-8"))


def chat_logprobs(entries: Sequence[TokenLogprobInfo]) -> dict[str, Any]:
    return {
        "content": [
            {
                "token": e.token,
                "logprob": e.logprob,
                "bytes": _utf8(e.token),
                "top_logprobs": [{"token": t, "logprob": lp, "bytes": _utf8(t)} for t, lp in e.top],
            }
            for e in entries
        ],
        "refusal": None,
    }


def completion_logprobs(entries: Sequence[TokenLogprobInfo | None], text_offset: int = 0) -> dict[str, Any]:
    tokens, token_logprobs, top_logprobs, offsets = [], [], [], []
    offset = text_offset
    for e in entries:
        token = e.token if e else ""
        tokens.append(token)
        token_logprobs.append(e.logprob if e else None)
        top_logprobs.append(dict(e.top) if e and e.top else None)
        offsets.append(offset)
        offset += len(token)
    return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top_logprobs, "text_offset": offsets}


def render_response(
    ident: ResponseIdentity,
    text: str,
    finish_reason: str | None,
    usage: Usage,
    logprobs: Sequence[TokenLogprobInfo | None] | None = None,
) -> dict[str, Any]:
    """The whole (non-streaming) response body for ``ident.endpoint``."""
    if ident.endpoint == "chat":
        return {
            "id": ident.response_id,
            "object": "chat.completion",
            "created": ident.created,
            "model": ident.model,
            "choices": [
                {
                    "index": 0,
                    "message": {"role": "assistant", "content": text},
                    "logprobs": chat_logprobs([e for e in logprobs if e]) if logprobs is not None else None,
                    "finish_reason": finish_reason,
                }
            ],
            "usage": usage.as_openai("chat"),
        }
    if ident.endpoint == "completions":
        return {
            "id": ident.response_id,
            "object": "text_completion",
            "created": ident.created,
            "model": ident.model,
            "choices": [
                {
                    "index": 0,
                    "text": text,
                    "logprobs": completion_logprobs(logprobs) if logprobs is not None else None,
                    "finish_reason": finish_reason,
                }
            ],
            "usage": usage.as_openai("completions"),
        }
    return _responses_object(ident, text, finish_reason, usage, status=_responses_status(finish_reason))


def _responses_status(finish_reason: str | None) -> str:
    return "incomplete" if finish_reason == "length" else "completed"


def _message_item(ident: ResponseIdentity, text: str, status: str) -> dict[str, Any]:
    content = [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}]
    return {"type": "message", "id": "msg_" + ident.response_id[5:], "status": status, "role": "assistant",
            "content": content}


def _responses_object(
    ident: ResponseIdentity, text: str | None, finish_reason: str | None, usage: Usage | None, status: str
) -> dict[str, Any]:
    output = [] if text is None else [_message_item(ident, text, "completed")]
    return {
        "id": ident.response_id,
        "object": "response",
        "created_at": ident.created,
        "model": ident.model,
        "status": status,
        "output": output,
        "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
        "error": None,
        "parallel_tool_calls": False,
        "tool_choice": "none",
        "tools": [],
        "usage": usage.as_openai("responses") if usage else None,
    }


class StreamRenderer:
    """Turns text deltas into the endpoint's stream frames, in order: ``begin``, ``delta``..., ``finish``."""

    def __init__(self, ident: ResponseIdentity, include_usage: bool = False) -> None:
        self.ident = ident
        self.include_usage = include_usage
        self._text_parts: list[str] = []
        self._sequence = 0

    def _chunk(self, choice: dict[str, Any], usage: dict[str, Any] | None = None) -> bytes:
        chat = self.ident.endpoint == "chat"
        payload: dict[str, Any] = {
            "id": self.ident.response_id,
            "object": "chat.completion.chunk" if chat else "text_completion",
            "created": self.ident.created,
            "model": self.ident.model,
            "choices": [choice] if choice else [],
        }
        if usage is not None:
            payload["usage"] = usage
        return data_frame(payload)

    def _event(self, event_type: str, body: dict[str, Any]) -> bytes:
        frame = event_frame(event_type, {"type": event_type, "sequence_number": self._sequence, **body})
        self._sequence += 1
        return frame

    def begin(self) -> list[bytes]:
        if self.ident.endpoint == "chat":
            delta = {"role": "assistant", "content": ""}
            return [self._chunk({"index": 0, "delta": delta, "logprobs": None, "finish_reason": None})]
        if self.ident.endpoint == "completions":
            return []
        in_progress = _responses_object(self.ident, None, None, None, status="in_progress")
        item = _message_item(self.ident, "", "in_progress")
        item["content"] = []
        part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
        return [
            self._event("response.created", {"response": in_progress}),
            self._event("response.in_progress", {"response": in_progress}),
            self._event("response.output_item.added", {"output_index": 0, "item": item}),
            self._event("response.content_part.added",
                        {"item_id": item["id"], "output_index": 0, "content_index": 0, "part": part}),
        ]

    def delta(self, text: str, logprobs: Sequence[TokenLogprobInfo] | None = None) -> list[bytes]:
        if not text and not logprobs:
            return []
        self._text_parts.append(text)
        if self.ident.endpoint == "chat":
            lp = chat_logprobs(logprobs) if logprobs else None
            return [self._chunk({"index": 0, "delta": {"content": text}, "logprobs": lp, "finish_reason": None})]
        if self.ident.endpoint == "completions":
            lp = completion_logprobs(logprobs) if logprobs else None
            return [self._chunk({"index": 0, "text": text, "logprobs": lp, "finish_reason": None})]
        item_id = "msg_" + self.ident.response_id[5:]
        return [self._event("response.output_text.delta",
                            {"item_id": item_id, "output_index": 0, "content_index": 0, "delta": text,
                             "logprobs": []})]

    def finish(self, finish_reason: str | None, usage: Usage) -> list[bytes]:
        endpoint = self.ident.endpoint
        if endpoint in ("chat", "completions"):
            choice: dict[str, Any] = {"index": 0, "logprobs": None, "finish_reason": finish_reason}
            if endpoint == "chat":
                choice["delta"] = {}
            else:
                choice["text"] = ""
            frames = [self._chunk(choice)]
            if self.include_usage:
                frames.append(self._chunk({}, usage=usage.as_openai(endpoint)))
            frames.append(DONE_FRAME)
            return frames
        text = "".join(self._text_parts)
        item = _message_item(self.ident, text, "completed")
        final = _responses_object(self.ident, text, finish_reason, usage, status=_responses_status(finish_reason))
        done_type = "response.incomplete" if final["status"] == "incomplete" else "response.completed"
        return [
            self._event("response.output_text.done",
                        {"item_id": item["id"], "output_index": 0, "content_index": 0, "text": text,
                         "logprobs": []}),
            self._event("response.content_part.done",
                        {"item_id": item["id"], "output_index": 0, "content_index": 0,
                         "part": item["content"][0]}),
            self._event("response.output_item.done", {"output_index": 0, "item": item}),
            self._event(done_type, {"response": final}),
        ]

    def error(self, error: ServingError) -> list[bytes]:
        frames = stream_error_frames(self.ident.endpoint, error, self._sequence)
        self._sequence += 1
        return frames


def stream_error_frames(endpoint: Endpoint, error: ServingError, sequence_number: int = 0) -> list[bytes]:
    """Frames that end a stream that failed after it started: an error event, then the end marker."""
    if endpoint == "responses":
        return [responses_error_event(error, sequence_number)]
    return [sse_error_event(error), DONE_FRAME]


def replay_as_stream(endpoint: Endpoint, response: dict[str, Any], include_usage: bool) -> list[bytes]:
    """Re-render a whole response (from a CTX that finished the request itself) as the client's stream."""
    if endpoint == "responses":
        ident = ResponseIdentity(endpoint, response["id"], response["model"], response["created_at"])
        output = response.get("output") or []
        text = output[0]["content"][0]["text"] if output else ""
        finish = "length" if response.get("status") == "incomplete" else "stop"
        usage_raw = response.get("usage") or {}
        usage = Usage(usage_raw.get("input_tokens", 0), usage_raw.get("output_tokens", 0))
    else:
        ident = ResponseIdentity(endpoint, response["id"], response["model"], response["created"])
        choice = response["choices"][0]
        text = choice["message"]["content"] if endpoint == "chat" else choice["text"]
        finish = choice["finish_reason"]
        usage_raw = response.get("usage") or {}
        usage = Usage(usage_raw.get("prompt_tokens", 0), usage_raw.get("completion_tokens", 0))
    renderer = StreamRenderer(ident, include_usage)
    return [*renderer.begin(), *renderer.delta(text or ""), *renderer.finish(finish, usage)]
