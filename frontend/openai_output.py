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
    return _message_item_of(ident.response_id, text, status)


def _message_item_of(response_id: str, text: str, status: str) -> dict[str, Any]:
    content = [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}]
    return {"type": "message", "id": "msg_" + response_id[5:], "status": status, "role": "assistant",
            "content": content}


def function_call_item_id(response_id: str, index: int) -> str:
    """The id of a Response's ``index``-th function call item."""
    return "fc_" + response_id[5:] + (f"_{index}" if index else "")


def function_call_items(response_id: str, calls: Sequence[dict[str, Any]], status: str) -> list[dict[str, Any]]:
    """Chat-shaped tool calls (``frontend.tool_calls``) as the Responses API's ``function_call`` output items."""
    return [{"type": "function_call", "id": function_call_item_id(response_id, index), "call_id": call["id"],
             "name": call["function"]["name"], "arguments": call["function"]["arguments"], "status": status}
            for index, call in enumerate(calls)]


def as_function_call_output(body: dict[str, Any], calls: Sequence[dict[str, Any]], text: str | None = None) -> None:
    """Turn a whole Response object's output into the function calls it made, after a message of the ``text``
    before them if there was any, as OpenAI answers a call."""
    message = [_message_item_of(body["id"], text, "completed")] if text else []
    body["output"] = [*message, *function_call_items(body["id"], calls, "completed")]


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

    Tool calls come as they are read from the answer (``frontend.tool_parsers``): chat's ``delta.tool_calls``, a
    call's first with its id and name, then its arguments in pieces; the Responses API's output items, a message
    of the text before the calls (opened at its first text) and a ``function_call`` item per call, its arguments in
    ``response.function_call_arguments.delta`` events. ``tool_call``: the answer may be calls, so a Responses
    stream opens its message item only once text comes."""

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
        self._open_at_begin = not tool_call  # a Responses stream's message item: added at ``begin`` unless held
        # The Responses API's output items: those done, and the one open (a message or a function call).
        self._items: list[dict[str, Any]] = []
        self._message_index: int | None = None
        self._call: dict[str, Any] | None = None
        self._call_arguments: list[str] = []
        self._calls = 0
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
        return [*frames, *self._open_message()] if self._open_at_begin else frames

    # -- the Responses API's output items --------------------------------------------------------------------------
    def _open_message(self) -> list[bytes]:
        index = self._message_index = len(self._items)
        item = _message_item(self.ident, "", "in_progress")
        item["content"] = []
        part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
        return [
            self._event("response.output_item.added", {"output_index": index, "item": item}),
            self._event("response.content_part.added",
                        {"item_id": item["id"], "output_index": index, "content_index": 0, "part": part}),
        ]

    def _close_message(self) -> list[bytes]:
        index = self._message_index
        if index is None:
            return []
        self._message_index = None
        text = "".join(self._text_parts)
        self._text_parts = []
        item = _message_item(self.ident, text, "completed")
        self._items.append(item)
        return [
            self._event("response.output_text.done",
                        {"item_id": item["id"], "output_index": index, "content_index": 0, "text": text,
                         "logprobs": []}),
            self._event("response.content_part.done",
                        {"item_id": item["id"], "output_index": index, "content_index": 0,
                         "part": item["content"][0]}),
            self._event("response.output_item.done", {"output_index": index, "item": item}),
        ]

    def _close_call(self, status: str) -> list[bytes]:
        call = self._call
        if call is None:
            return []
        self._call = None
        index = len(self._items)
        arguments = "".join(self._call_arguments)
        item = {**call, "arguments": arguments, "status": status}
        self._items.append(item)
        return [
            self._event("response.function_call_arguments.done",
                        {"item_id": item["id"], "output_index": index, "arguments": arguments}),
            self._event("response.output_item.done", {"output_index": index, "item": item}),
        ]

    # -- text ------------------------------------------------------------------------------------------------------
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
        if self.ident.endpoint == "chat":
            choice = {"index": index, "delta": {"content": text}, "logprobs": logprobs, "finish_reason": None}
            top = {"prompt_logprobs": prompt_logprobs} if prompt_logprobs is not None else None
            return [self._chunk(choice, top=top)]
        if self.ident.endpoint == "completions":
            choice = {"index": index, "text": text, "logprobs": logprobs, "finish_reason": None}
            if prompt_logprobs is not None:
                choice["prompt_logprobs"] = prompt_logprobs
            return [self._chunk(choice)]
        if not text:
            return []
        frames = self._close_call("completed")
        if self._message_index is None:
            frames += self._open_message()
        self._text_parts.append(text)
        frames.append(self._event("response.output_text.delta",
                                  {"item_id": "msg_" + self.ident.response_id[5:], "output_index": self._message_index,
                                   "content_index": 0, "delta": text, "logprobs": []}))
        return frames

    # -- tool calls ------------------------------------------------------------------------------------------------
    def tool_call_opened(self, call_id: str, name: str, call_index: int, choice: int = 0) -> list[bytes]:
        """A call of choice ``choice`` begins: chat's delta with its ``index`` among the choice's calls, id and
        name; the Responses API's ``function_call`` item, added in progress."""
        if self.ident.endpoint == "chat":
            call = {"index": call_index, "id": call_id, "type": "function",
                    "function": {"name": name, "arguments": ""}}
            return [self._chunk({"index": choice, "delta": {"tool_calls": [call]}, "logprobs": None,
                                 "finish_reason": None})]
        frames = [*self._close_message(), *self._close_call("completed")]
        item_id = function_call_item_id(self.ident.response_id, self._calls)
        self._calls += 1
        self._call = {"type": "function_call", "id": item_id, "call_id": call_id, "name": name}
        self._call_arguments = []
        item = {**self._call, "arguments": "", "status": "in_progress"}
        return [*frames, self._event("response.output_item.added", {"output_index": len(self._items), "item": item})]

    def tool_call_arguments(self, piece: str, call_index: int, choice: int = 0) -> list[bytes]:
        """The next piece of the open call's arguments."""
        if not piece:
            return []
        if self.ident.endpoint == "chat":
            call = {"index": call_index, "function": {"arguments": piece}}
            return [self._chunk({"index": choice, "delta": {"tool_calls": [call]}, "logprobs": None,
                                 "finish_reason": None})]
        assert self._call is not None
        self._call_arguments.append(piece)
        return [self._event("response.function_call_arguments.delta",
                            {"item_id": self._call["id"], "output_index": len(self._items), "delta": piece})]

    def tool_calls(self, calls: Sequence[dict[str, Any]], choice: int = 0) -> list[bytes]:
        """A chat delta for choice ``choice`` with whole tool calls (id, type, name, arguments), each with its
        ``index`` among that choice's calls (a replayed answer's)."""
        indexed = [{"index": index, **call} for index, call in enumerate(calls)]
        body = {"index": choice, "delta": {"tool_calls": indexed}, "logprobs": None, "finish_reason": None}
        return [self._chunk(body)]

    # -- the end ---------------------------------------------------------------------------------------------------
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

    def finish(self, finish_reason: str | None, usage: Usage, call_broken: bool = False) -> list[bytes]:
        """The end: chat's and completions' finish chunk and end, or the Responses API's open items done and the
        final event (a Response that made no item has one empty message). ``call_broken``: the last call's
        arguments broke off or are not JSON (its item is ``incomplete``)."""
        endpoint = self.ident.endpoint
        if endpoint in ("chat", "completions"):
            return [*self.finish_choice(finish_reason), *self.end(usage)]
        cut = finish_reason == "length" or call_broken
        frames = self._close_call("incomplete" if cut else "completed")
        if not self._items and self._message_index is None:
            frames += self._open_message()
        frames += self._close_message()
        status = _responses_status(finish_reason)
        final = _responses_object(self.ident, None, finish_reason, usage, status=status, output=list(self._items))
        done_type = "response.incomplete" if status == "incomplete" else "response.completed"
        return [*frames, self._event(done_type, {"response": final})]

    def finish_function_calls(self, calls: Sequence[dict[str, Any]], usage: Usage) -> list[bytes]:
        """Responses: whole function calls (chat-shaped, ``frontend.tool_calls``; a replayed answer's), each item
        added, its arguments in one delta, and done, then the final event."""
        frames = []
        for index, call in enumerate(calls):
            frames += self.tool_call_opened(call["id"], call["function"]["name"], index)
            frames += self.tool_call_arguments(call["function"]["arguments"], index)
        return [*frames, *self.finish("stop", usage)]

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
        renderer = StreamRenderer(ident, include_usage, tool_call=bool(_calls_of(output)))
        # The renderer numbers events as it makes them: make them in the order they are sent.
        frames = renderer.begin()
        made = 0
        for item in output:
            if item.get("type") == "function_call":
                frames += renderer.tool_call_opened(item["call_id"], item["name"], made)
                frames += renderer.tool_call_arguments(item["arguments"], made)
                made += 1
            elif item["content"] and item["content"][0]["text"]:
                frames += renderer.delta_rendered(item["content"][0]["text"], None)
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
