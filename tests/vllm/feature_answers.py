"""The vllm adapter's ``n`` and structured-output cases, asked through the official openai SDK, whole or streamed,
kept choice by choice and token by token: the aggregated worker's answers are the reference the disaggregated
ones must equal."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import openai

from tests.vllm.prompts import MODEL, long_chat

PERSON = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
          "required": ["name", "age"], "additionalProperties": False}

@dataclass(frozen=True)
class Choice:
    text: str
    tokens: tuple[str, ...]

@dataclass(frozen=True)
class FeatureAnswer:
    choices: tuple[Choice, ...]  # by index
    completion_tokens: int

def _n2(temperature: float, seed: int | None) -> dict[str, Any]:
    return {"n": 2, "temperature": temperature, "seed": seed, "max_tokens": 12}

# Each case's request fields beyond the model, the prompt and logprobs.
FEATURES: dict[str, dict[str, Any]] = {
    "n2_seeded": _n2(0.9, 1234),
    "n2_greedy": _n2(0.0, None),
    "json_schema": {"temperature": 0, "max_tokens": 40, "response_format": {
        "type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}},
}
FEATURE_CASES = [(name, stream) for stream in (False, True) for name in FEATURES]

def feature_variant(name: str, stream: bool) -> str:
    # The request's own prompt: one a vLLM instance has not seen, so its KV must come through the connector.
    return f"{name}, {'streamed' if stream else 'whole'}; answer as JSON with a name and an age"

def ask_feature(client: openai.OpenAI, name: str, stream: bool, variant: str) -> FeatureAnswer:
    kwargs: dict[str, Any] = {"model": MODEL, "messages": long_chat(variant), "logprobs": True, **FEATURES[name]}
    if not stream:
        reply = client.chat.completions.create(**kwargs)
        assert reply.usage is not None
        choices = []
        for choice in sorted(reply.choices, key=lambda c: c.index):
            assert choice.logprobs is not None and choice.logprobs.content is not None
            choices.append(Choice(choice.message.content or "", tuple(t.token for t in choice.logprobs.content)))
        return FeatureAnswer(tuple(choices), reply.usage.completion_tokens)
    texts: dict[int, str] = {}
    tokens: dict[int, list[str]] = {}
    used = 0
    for chunk in client.chat.completions.create(**kwargs, stream=True, stream_options={"include_usage": True}):
        if chunk.usage is not None:
            used = chunk.usage.completion_tokens
        for choice in chunk.choices:
            texts[choice.index] = texts.get(choice.index, "") + (choice.delta.content or "")
            if choice.logprobs is not None and choice.logprobs.content:
                tokens.setdefault(choice.index, []).extend(t.token for t in choice.logprobs.content)
    return FeatureAnswer(tuple(Choice(texts[i], tuple(tokens.get(i, ()))) for i in sorted(texts)), used)

def feature_reference_answers(client: openai.OpenAI) -> dict[tuple[str, bool], FeatureAnswer]:
    """Every feature case's answer, asked whole (a streamed answer must equal it too)."""
    return {(name, stream): ask_feature(client, name, False, feature_variant(name, stream))
            for name, stream in FEATURE_CASES}

