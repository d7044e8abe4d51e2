"""OpenAI parameters this server recognises but does not implement, and the values of them it can still honour.

A neutral value (``tools=None``, ``response_format={"type": "text"}``: what the SDK sends by default) asks for
nothing, so it is dropped before validation; any other value is a 400 ``unsupported_parameter`` that names it."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, Literal

from frontend.errors import UnsupportedParameterError

Neutral = Callable[[Any], bool]
WireEndpoint = Literal["chat", "completions", "responses"]


def _null(value: Any) -> bool:
    return value is None


def _null_or_empty(value: Any) -> bool:
    return value is None or value == [] or value == {}


def _one_of(*allowed: Any) -> Neutral:
    return lambda value: value is None or any(value == a for a in allowed)


def _any_string(value: Any) -> bool:
    # Hints that change nothing of the answer (a cache key, an end-user id for abuse tracking).
    return value is None or isinstance(value, str)


def _string_map(value: Any) -> bool:
    # Metadata only tags a stored object; this server stores nothing, so any tags are honoured by keeping none.
    return value is None or (isinstance(value, dict) and all(isinstance(v, str) for v in value.values()))


# Every endpoint.
_COMMON: dict[str, Neutral] = {
    "service_tier": _one_of("auto", "default"),
    "prompt_cache_key": _any_string,
    "prompt_cache_retention": _null,
    "prompt_cache_options": _null_or_empty,
    "safety_identifier": _any_string,
    "moderation": _null,
    "no_repeat_ngram_size": _one_of(0),  # vLLM's name; no engine here implements it
}
# Reasoning: chat and the Responses API share it.
_REASONING: dict[str, Neutral] = {
    "reasoning_effort": _null,
    "reasoning": _null_or_empty,
}
_CHAT: dict[str, Neutral] = {
    **_COMMON,
    **_REASONING,
    # tools, tool_choice, parallel_tool_calls and response_format are chat wire fields (``frontend.tool_calls``).
    "functions": _null_or_empty,
    "function_call": _one_of("none", "auto"),
    "audio": _null,
    "modalities": _one_of(["text"]),
    "prediction": _null,
    "web_search_options": _null,
    "verbosity": _null,
    "store": _one_of(False),
    "metadata": _string_map,
}
_RESPONSES: dict[str, Neutral] = {
    **_COMMON,
    # tools, tool_choice and parallel_tool_calls are Responses wire fields (``frontend.openai_models``).
    **_REASONING,
    "include": _null_or_empty,
    "truncation": _one_of("disabled"),
    "background": _one_of(False),
    "background_options": _null_or_empty,
    "max_tool_calls": _null,
    "conversation": _null,
    "context_management": _null_or_empty,
    "image": _null,
    "access_programs": _null_or_empty,
    "prompt": _null,  # a stored prompt template, not the completions prompt
    "top_logprobs": _one_of(0),  # Responses output carries no logprobs here
}
UNSUPPORTED_BY_ENDPOINT: Mapping[WireEndpoint, Mapping[str, Neutral]] = {
    "chat": _CHAT,
    "completions": _COMMON,
    "responses": _RESPONSES,
}
# Names some wire model implements on another endpoint (the completions prompt, chat's top_logprobs, the
# Responses API's store, metadata and tools): only the endpoint's own table can judge them.
_IMPLEMENTED_ELSEWHERE = frozenset({"prompt", "top_logprobs", "store", "metadata", "tools", "tool_choice"})
# The rest, whichever endpoint: what a body-level check that knows no endpoint can judge (``refuse_unsupported``).
UNSUPPORTED_PARAMETERS: frozenset[str] = frozenset(
    name for table in UNSUPPORTED_BY_ENDPOINT.values() for name in table if name not in _IMPLEMENTED_ELSEWHERE
)


def drop_neutral_parameters(endpoint: WireEndpoint, data: Mapping[str, Any]) -> dict[str, Any]:
    """``data`` without the endpoint's unimplemented parameters; a non-neutral value of one is a 400."""
    table = UNSUPPORTED_BY_ENDPOINT[endpoint]
    present = table.keys() & data.keys()
    if not present:
        return dict(data)
    for name in sorted(present):
        if not table[name](data[name]):
            raise UnsupportedParameterError(
                f"parameter '{name}' with value {_short(data[name])} is not supported by this server", param=name
            )
    return {name: value for name, value in data.items() if name not in present}


def refuse_unsupported(body: Mapping[str, Any]) -> None:
    """The endpoint-free check: any non-neutral value of a parameter unimplemented on every endpoint."""
    for name in sorted(UNSUPPORTED_PARAMETERS & body.keys()):
        neutral = next(table[name] for table in UNSUPPORTED_BY_ENDPOINT.values() if name in table)
        if not neutral(body[name]):
            raise UnsupportedParameterError(
                f"parameter '{name}' with value {_short(body[name])} is not supported by this server", param=name
            )


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."
