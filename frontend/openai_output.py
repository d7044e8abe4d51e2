"""OpenAI response shapes for the three endpoints: whole responses, stream frames, and replays.

Shared by the workers, which produce answers, and the orchestrator, which replays a CTX-finished answer as a stream.
It knows no tokenizer: callers pass token strings. What each field carries: docs/conformance.md."""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from importlib import metadata
from typing import Any, Literal

from frontend.errors import ServingError, responses_error_event, sse_error_event
from frontend.sse import DONE_FRAME, data_frame, event_frame

Endpoint = Literal["chat", "completions", "responses"]


def _version() -> str:
    try:
        return metadata.version("disagg-serve")
    except metadata.PackageNotFoundError:
        return "dev"


SYSTEM_FINGERPRINT = "fp_disagg_serve_" + _version()


@dataclass(frozen=True, slots=True)
class TokenLogprobInfo:
    token: str
    logprob: float | None  # None: the first prompt token of an echo, which has no context to be scored in
    top: tuple[tuple[str, float], ...] = ()
    # The token's own bytes and, in the same order, each alternative's; None: the UTF-8 of its text. They differ for
    # a token that is only part of a character, whose text is U+FFFD.
    token_bytes: bytes | None = None
    top_bytes: tuple[bytes, ...] | None = None


@dataclass(frozen=True, slots=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int = 0  # prompt tokens whose KV was reused rather than computed

    def as_openai(self, endpoint: Endpoint) -> dict[str, Any]:
        if endpoint == "responses":
            return {
                "input_tokens": self.prompt_tokens,
                "input_tokens_details": {"cached_tokens": self.cached_tokens, "cache_write_tokens": 0},
                "output_tokens": self.completion_tokens,
                "output_tokens_details": {"reasoning_tokens": 0},
                "total_tokens": self.prompt_tokens + self.completion_tokens,
            }
        return {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "total_tokens": self.prompt_tokens + self.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": self.cached_tokens},
        }

    @classmethod
    def from_openai(cls, usage: dict[str, Any] | None) -> Usage:
        """The inverse of ``as_openai`` (any endpoint), for a replayed answer."""
        usage = usage or {}
        details = usage.get("prompt_tokens_details") or usage.get("input_tokens_details") or {}
        return cls(usage.get("prompt_tokens", usage.get("input_tokens", 0)),
                   usage.get("completion_tokens", usage.get("output_tokens", 0)), details.get("cached_tokens", 0))


@dataclass(frozen=True, slots=True)
class ResponsesSettings:
    """What a Responses request set that its Response object repeats (null where it set nothing)."""

    instructions: str | None = None
    temperature: float | None = None
    max_output_tokens: int | None = None
    tools: tuple[dict[str, Any], ...] = ()  # the function tools, as the SDK's ``FunctionTool``
    tool_choice: str | dict[str, Any] = "auto"  # OpenAI's defaults where the request set none
    parallel_tool_calls: bool = True

    @classmethod
    def of(cls, response: dict[str, Any]) -> ResponsesSettings:
        """The settings a Response object repeats (a replayed one's)."""
        return cls(response.get("instructions"), response.get("temperature"), response.get("max_output_tokens"),
                   tuple(response.get("tools") or ()), response.get("tool_choice") or "auto",
                   response.get("parallel_tool_calls", True))


@dataclass(frozen=True, slots=True)
class ResponseIdentity:
    endpoint: Endpoint
    response_id: str
    model: str
    created: int = field(default_factory=lambda: int(time.time()))
    system_fingerprint: str = SYSTEM_FINGERPRINT
    settings: ResponsesSettings = ResponsesSettings()


def _bytes_of(text: str, raw: bytes | None) -> list[int]:
    return list(raw if raw is not None else text.encode("utf-8"))


def _top_entries(e: TokenLogprobInfo) -> list[dict[str, Any]]:
    raws: Sequence[bytes | None] = e.top_bytes if e.top_bytes is not None else (None,) * len(e.top)
    return [{"token": t, "logprob": lp, "bytes": _bytes_of(t, raw)} for (t, lp), raw in zip(e.top, raws, strict=True)]


def chat_logprobs(entries: Sequence[TokenLogprobInfo]) -> dict[str, Any]:
    return {
        "content": [
            {
                "token": e.token,
                "logprob": e.logprob,
                "bytes": _bytes_of(e.token, e.token_bytes),
                "top_logprobs": _top_entries(e),
            }
            for e in entries
        ],
        "refusal": None,
    }


def completion_logprobs(entries: Sequence[TokenLogprobInfo | None], text_offset: int = 0) -> dict[str, Any]:
    """Completions' logprobs; ``text_offset`` is where the first entry's token starts in the whole text."""
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


@dataclass(frozen=True, slots=True)
class ChoiceOutput:
    """One choice of a whole answer: its text, why it ended, and its logprobs (None: not asked for)."""

    text: str
    finish_reason: str | None
    logprobs: Sequence[TokenLogprobInfo | None] | None = None


def render_response(
    ident: ResponseIdentity,
    text: str,
    finish_reason: str | None,
    usage: Usage,
    logprobs: Sequence[TokenLogprobInfo | None] | None = None,
    prompt_logprobs: list[Any] | None = None,
) -> dict[str, Any]:
    """The whole (non-streaming) response body of one choice for ``ident.endpoint``."""
    return render_choices(ident, [ChoiceOutput(text, finish_reason, logprobs)], usage, prompt_logprobs)


def render_choices(
    ident: ResponseIdentity, choices: Sequence[ChoiceOutput], usage: Usage, prompt_logprobs: list[Any] | None = None
) -> dict[str, Any]:
    """The whole response body, one choice per sequence (``index`` in order; the Responses API has one);
    ``prompt_logprobs`` (vLLM's shape) goes where vLLM puts it: at the top of a chat answer, in each choice of a
    completion."""
    if ident.endpoint == "chat":
        body: dict[str, Any] = {
            "id": ident.response_id,
            "object": "chat.completion",
            "created": ident.created,
            "model": ident.model,
            "system_fingerprint": ident.system_fingerprint,
            "choices": [
                {
                    "index": index,
                    "message": {"role": "assistant", "content": c.text},
                    "logprobs": chat_logprobs([e for e in c.logprobs if e]) if c.logprobs is not None else None,
                    "finish_reason": c.finish_reason,
                }
                for index, c in enumerate(choices)
            ],
            "usage": usage.as_openai("chat"),
        }
        if prompt_logprobs is not None:
            body["prompt_logprobs"] = prompt_logprobs
        return body
    if ident.endpoint == "completions":
        rendered = []
        for index, c in enumerate(choices):
            choice: dict[str, Any] = {
                "index": index,
                "text": c.text,
                "logprobs": completion_logprobs(c.logprobs) if c.logprobs is not None else None,
                "finish_reason": c.finish_reason,
            }
            if prompt_logprobs is not None:
                choice["prompt_logprobs"] = prompt_logprobs
            rendered.append(choice)
        return {
            "id": ident.response_id,
            "object": "text_completion",
            "created": ident.created,
            "model": ident.model,
            "system_fingerprint": ident.system_fingerprint,
            "choices": rendered,
            "usage": usage.as_openai("completions"),
        }
    (only,) = choices
    return _responses_object(ident, only.text, only.finish_reason, usage,
                             status=_responses_status(only.finish_reason))


def _responses_status(finish_reason: str | None) -> str:
    return "incomplete" if finish_reason == "length" else "completed"


def _message_item(ident: ResponseIdentity, text: str, status: str) -> dict[str, Any]:
    content = [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}]
    return {"type": "message", "id": "msg_" + ident.response_id[5:], "status": status, "role": "assistant",
            "content": content}


def function_call_items(response_id: str, calls: Sequence[dict[str, Any]], status: str) -> list[dict[str, Any]]:
    """Chat-shaped tool calls (``frontend.tool_calls``) as the Responses API's ``function_call`` output items."""
    item_id = "fc_" + response_id[5:]
    return [{"type": "function_call", "id": item_id + (f"_{index}" if index else ""), "call_id": call["id"],
             "name": call["function"]["name"], "arguments": call["function"]["arguments"], "status": status}
            for index, call in enumerate(calls)]


def as_function_call_output(body: dict[str, Any], calls: Sequence[dict[str, Any]]) -> None:
    """Turn a whole Response object's text into the function calls it made, as OpenAI answers a call."""
    body["output"] = function_call_items(body["id"], calls, "completed")


def _calls_of(output: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """A Response object's ``function_call`` items, chat-shaped (the inverse of ``function_call_items``)."""
    return [{"id": item["call_id"], "type": "function",
             "function": {"name": item["name"], "arguments": item["arguments"]}}
            for item in output if item.get("type") == "function_call"]


def _responses_object(
    ident: ResponseIdentity, text: str | None, finish_reason: str | None, usage: Usage | None, status: str,
    output: list[dict[str, Any]] | None = None,
) -> dict[str, Any]:
    """``output``: the items, where they are not one message of ``text`` (none: no item yet)."""
    if output is None:
        output = [] if text is None else [_message_item(ident, text, "completed")]
    settings = ident.settings
    return {
        "id": ident.response_id,
        "object": "response",
        "created_at": ident.created,
        "model": ident.model,
        "status": status,
        "instructions": ident.settings.instructions,
        "temperature": ident.settings.temperature,
        "max_output_tokens": ident.settings.max_output_tokens,
        "output": output,
        "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
        "error": None,
        "parallel_tool_calls": settings.parallel_tool_calls,
        "tool_choice": settings.tool_choice,
        "tools": list(settings.tools),
        "usage": usage.as_openai("responses") if usage else None,
    }


class StreamRenderer:
    """Turns text deltas into the endpoint's stream frames, in order: ``begin``, ``delta``..., ``finish``.

    ``tool_call``: the answer is held back to be sent whole as a function call (or, cut short, as text): a Responses
    stream then opens its output item only once it knows which it is (``finish_function_calls`` or the first
    text)."""

    def __init__(self, ident: ResponseIdentity, include_usage: bool = False, continuous_usage: bool = False,
                 tool_call: bool = False) -> None:
        self.ident = ident
        self.include_usage = include_usage
        # Chat and completions, as vLLM's continuous_usage_stats: every chunk carries ``usage``, the counts so far,
        # which the caller keeps current (so the first chunk already says the prompt's).
        self.continuous_usage = include_usage and continuous_usage
        self.usage: Usage | None = None
        self._text_parts: list[str] = []
        self._sequence = 0
        self._message_open = not tool_call  # a Responses stream's message item: added at ``begin`` unless held
        # Completions, per choice: where the next logprob token starts in that choice's whole streamed text.
        self._text_offsets: dict[int, int] = {}

    def _chunk(
        self, choice: dict[str, Any], usage: dict[str, Any] | None = None, top: dict[str, Any] | None = None
    ) -> bytes:
        chat = self.ident.endpoint == "chat"
        payload: dict[str, Any] = {
            "id": self.ident.response_id,
            "object": "chat.completion.chunk" if chat else "text_completion",
            "created": self.ident.created,
            "model": self.ident.model,
            "system_fingerprint": self.ident.system_fingerprint,
            "choices": [choice] if choice else [],
        }
        if self.include_usage:
            if usage is None and self.continuous_usage and self.usage is not None:
                usage = self.usage.as_openai(self.ident.endpoint)
            payload["usage"] = usage  # else null until the last chunk, as OpenAI streams it
        if top:
            payload.update(top)
        return data_frame(payload)

    def _event(self, event_type: str, body: dict[str, Any]) -> bytes:
        frame = event_frame(event_type, {"type": event_type, "sequence_number": self._sequence, **body})
        self._sequence += 1
        return frame

    def begin(self, choices: int = 1) -> list[bytes]:
        if self.ident.endpoint == "chat":
            delta = {"role": "assistant", "content": ""}
            return [self._chunk({"index": index, "delta": delta, "logprobs": None, "finish_reason": None})
                    for index in range(choices)]
        if self.ident.endpoint == "completions":
            return []
        in_progress = _responses_object(self.ident, None, None, None, status="in_progress")
        frames = [
            self._event("response.created", {"response": in_progress}),
            self._event("response.in_progress", {"response": in_progress}),
        ]
        return [*frames, *self._open_message()] if self._message_open else frames

    def _open_message(self) -> list[bytes]:
        self._message_open = True
        item = _message_item(self.ident, "", "in_progress")
        item["content"] = []
        part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
        return [
            self._event("response.output_item.added", {"output_index": 0, "item": item}),
            self._event("response.content_part.added",
                        {"item_id": item["id"], "output_index": 0, "content_index": 0, "part": part}),
        ]

    def delta(
        self, text: str, logprobs: Sequence[TokenLogprobInfo] | None = None, prompt_logprobs: list[Any] | None = None,
        index: int = 0,
    ) -> list[bytes]:
        if not text and not logprobs and prompt_logprobs is None:
            return []
        lp: dict[str, Any] | None = None
        if logprobs and self.ident.endpoint == "chat":
            lp = chat_logprobs(logprobs)
        elif logprobs and self.ident.endpoint == "completions":
            offset = self._text_offsets.get(index, 0)
            lp = completion_logprobs(logprobs, offset)
            self._text_offsets[index] = offset + sum(len(e.token) for e in logprobs)
        return self.delta_rendered(text, lp, prompt_logprobs, index)

    def delta_rendered(
        self, text: str, logprobs: dict[str, Any] | None, prompt_logprobs: list[Any] | None = None, index: int = 0
    ) -> list[bytes]:
        """A delta of choice ``index`` whose logprobs are already in the endpoint's shape (a replayed answer's)."""
        self._text_parts.append(text)
        if self.ident.endpoint == "chat":
            choice = {"index": index, "delta": {"content": text}, "logprobs": logprobs, "finish_reason": None}
            top = {"prompt_logprobs": prompt_logprobs} if prompt_logprobs is not None else None
            return [self._chunk(choice, top=top)]
        if self.ident.endpoint == "completions":
            choice = {"index": index, "text": text, "logprobs": logprobs, "finish_reason": None}
            if prompt_logprobs is not None:
                choice["prompt_logprobs"] = prompt_logprobs
            return [self._chunk(choice)]
        item_id = "msg_" + self.ident.response_id[5:]
        opened = [] if self._message_open else self._open_message()
        return [*opened, self._event("response.output_text.delta",
                                     {"item_id": item_id, "output_index": 0, "content_index": 0, "delta": text,
                                      "logprobs": []})]

    def tool_calls(self, calls: Sequence[dict[str, Any]], choice: int = 0) -> list[bytes]:
        """A chat delta for choice ``choice`` with whole tool calls (id, type, name, arguments), each with its
        ``index`` among that choice's calls."""
        indexed = [{"index": index, **call} for index, call in enumerate(calls)]
        body = {"index": choice, "delta": {"tool_calls": indexed}, "logprobs": None, "finish_reason": None}
        return [self._chunk(body)]

    def finish_choice(self, finish_reason: str | None, index: int = 0) -> list[bytes]:
        """Chat and completions: the chunk that ends choice ``index``."""
        choice: dict[str, Any] = {"index": index, "logprobs": None, "finish_reason": finish_reason}
        if self.ident.endpoint == "chat":
            choice["delta"] = {}
        else:
            choice["text"] = ""
        return [self._chunk(choice)]

    def end(self, usage: Usage) -> list[bytes]:
        """Chat and completions: after every choice has finished, the usage chunk (if asked for) and the end."""
        usage_frames = [self._chunk({}, usage=usage.as_openai(self.ident.endpoint))] if self.include_usage else []
        return [*usage_frames, DONE_FRAME]

    def finish(self, finish_reason: str | None, usage: Usage) -> list[bytes]:
        endpoint = self.ident.endpoint
        if endpoint in ("chat", "completions"):
            return [*self.finish_choice(finish_reason), *self.end(usage)]
        text = "".join(self._text_parts)
        item = _message_item(self.ident, text, "completed")
        final = _responses_object(self.ident, text, finish_reason, usage, status=_responses_status(finish_reason))
        done_type = "response.incomplete" if final["status"] == "incomplete" else "response.completed"
        return [
            *([] if self._message_open else self._open_message()),
            self._event("response.output_text.done",
                        {"item_id": item["id"], "output_index": 0, "content_index": 0, "text": text,
                         "logprobs": []}),
            self._event("response.content_part.done",
                        {"item_id": item["id"], "output_index": 0, "content_index": 0,
                         "part": item["content"][0]}),
            self._event("response.output_item.done", {"output_index": 0, "item": item}),
            self._event(done_type, {"response": final}),
        ]

    def finish_function_calls(self, calls: Sequence[dict[str, Any]], usage: Usage) -> list[bytes]:
        """Responses: the end of a held-back answer that is function calls (chat-shaped, ``frontend.tool_calls``),
        each item added, its arguments sent whole in one delta, and done, as OpenAI streams a call."""
        items = function_call_items(self.ident.response_id, calls, "completed")
        frames = []
        for index, item in enumerate(items):
            frames += [
                self._event("response.output_item.added",
                            {"output_index": index, "item": {**item, "arguments": "", "status": "in_progress"}}),
                self._event("response.function_call_arguments.delta",
                            {"item_id": item["id"], "output_index": index, "delta": item["arguments"]}),
                self._event("response.function_call_arguments.done",
                            {"item_id": item["id"], "output_index": index, "arguments": item["arguments"]}),
                self._event("response.output_item.done", {"output_index": index, "item": item}),
            ]
        final = _responses_object(self.ident, None, "stop", usage, status="completed", output=items)
        return [*frames, self._event("response.completed", {"response": final})]

    def error(self, error: ServingError) -> list[bytes]:
        frames = stream_error_frames(self.ident.endpoint, error, self._sequence)
        self._sequence += 1
        return frames


def stream_error_frames(endpoint: Endpoint, error: ServingError, sequence_number: int = 0) -> list[bytes]:
    """Frames that end a stream that failed after it started: an error event, then the end marker."""
    if endpoint == "responses":
        return [responses_error_event(error, sequence_number)]
    return [sse_error_event(error), DONE_FRAME]


def replay_as_stream(endpoint: Endpoint, response: dict[str, Any], include_usage: bool,
                     continuous_usage: bool = False) -> list[bytes]:
    """Re-render a whole response (from a CTX that finished the request itself) as the client's stream: the same
    choices, text, logprobs, prompt logprobs, fingerprint and usage the whole answer has (``continuous_usage``:
    on every chunk, the prompt's alone on the first)."""
    usage = Usage.from_openai(response.get("usage"))
    if endpoint == "responses":
        ident = ResponseIdentity(endpoint, response["id"], response["model"], response["created_at"],
                                 settings=ResponsesSettings.of(response))
        output = response.get("output") or []
        function_calls = _calls_of(output)
        renderer = StreamRenderer(ident, include_usage, tool_call=bool(function_calls))
        # The renderer numbers events as it makes them: make them in the order they are sent.
        frames = renderer.begin()
        if function_calls:
            return [*frames, *renderer.finish_function_calls(function_calls, usage)]
        text = output[0]["content"][0]["text"] if output else ""
        if text:
            frames += renderer.delta_rendered(text, None)
        finish = "length" if response.get("status") == "incomplete" else "stop"
        return [*frames, *renderer.finish(finish, usage)]
    ident = ResponseIdentity(endpoint, response["id"], response["model"], response["created"],
                             response.get("system_fingerprint") or SYSTEM_FINGERPRINT)
    choices = response["choices"]
    renderer = StreamRenderer(ident, include_usage, continuous_usage)
    renderer.usage = Usage(usage.prompt_tokens, 0, usage.cached_tokens)
    frames = renderer.begin(len(choices))
    renderer.usage = usage
    for choice in choices:
        text = (choice["message"]["content"] if endpoint == "chat" else choice["text"]) or ""
        logprobs = choice.get("logprobs")
        prompt_logprobs = choice.get("prompt_logprobs") if endpoint == "completions" \
            else response.get("prompt_logprobs") if choice["index"] == 0 else None
        if text or logprobs is not None or prompt_logprobs is not None:
            frames += renderer.delta_rendered(text, logprobs, prompt_logprobs, choice["index"])
        calls = choice["message"].get("tool_calls") if endpoint == "chat" else None
        if calls:
            frames += renderer.tool_calls(calls, choice["index"])
    for choice in choices:
        frames += renderer.finish_choice(choice["finish_reason"], choice["index"])
    return [*frames, *renderer.end(usage)]
