"""Asking through the official openai SDK, whole or streamed, and keeping the answer token by token."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import openai

from tests.vllm.prompts import MODEL, long_chat, long_prompt

MAX_TOKENS = 12


def sdk_client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key="test", max_retries=0, timeout=600)


@dataclass(frozen=True)
class Answer:
    text: str
    tokens: tuple[str, ...]  # the token strings of the output, one a token (from logprobs)
    completion_tokens: int


def _client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key="test", max_retries=0, timeout=600)


def chat(client: openai.OpenAI, stream: bool, variant: str) -> Answer:
    kwargs: dict[str, Any] = {"model": MODEL, "messages": long_chat(variant), "max_tokens": MAX_TOKENS,
                              "temperature": 0, "logprobs": True}
    if not stream:
        reply = client.chat.completions.create(**kwargs)
        assert reply.choices[0].logprobs is not None and reply.choices[0].logprobs.content is not None
        assert reply.usage is not None
        return Answer(reply.choices[0].message.content or "",
                      tuple(t.token for t in reply.choices[0].logprobs.content), reply.usage.completion_tokens)
    text, tokens, used = "", [], 0
    for chunk in client.chat.completions.create(**kwargs, stream=True, stream_options={"include_usage": True}):
        if chunk.usage is not None:
            used = chunk.usage.completion_tokens
        for choice in chunk.choices:
            text += choice.delta.content or ""
            if choice.logprobs is not None and choice.logprobs.content:
                tokens += [t.token for t in choice.logprobs.content]
    return Answer(text, tuple(tokens), used)


def complete(client: openai.OpenAI, stream: bool, variant: str) -> Answer:
    # ignore_eos: a raw prompt may well be answered by EOS at once, and then CTX (or P) finishes the request alone
    # and the hand-off is never exercised.
    kwargs: dict[str, Any] = {"model": MODEL, "prompt": long_prompt(variant), "max_tokens": MAX_TOKENS,
                              "temperature": 0, "logprobs": 0, "extra_body": {"ignore_eos": True}}
    if not stream:
        reply = client.completions.create(**kwargs)
        assert reply.choices[0].logprobs is not None and reply.choices[0].logprobs.tokens is not None
        assert reply.usage is not None
        return Answer(reply.choices[0].text, tuple(reply.choices[0].logprobs.tokens), reply.usage.completion_tokens)
    text, tokens, used = "", [], 0
    for chunk in client.completions.create(**kwargs, stream=True, stream_options={"include_usage": True}):
        if chunk.usage is not None:
            used = chunk.usage.completion_tokens
        for choice in chunk.choices:
            text += choice.text
            if choice.logprobs is not None and choice.logprobs.tokens:
                tokens += choice.logprobs.tokens
    return Answer(text, tuple(tokens), used)


# A prompt of exactly two 128-token KV blocks, as token ids. ExampleConnector once killed GEN's engine core on a
# prompt of a whole number of blocks, when GEN's prompt was CTX's plus its first token (docs/engines.md); distinct
# ids from the middle of the vocabulary, so no other test's prompt shares a block with it.
WHOLE_BLOCKS_PROMPT = [1000 + (7 * i) % 4000 for i in range(256)]


def complete_ids(client: openai.OpenAI, prompt: list[int]) -> Answer:
    reply = client.completions.create(model=MODEL, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0, logprobs=0,
                                      extra_body={"ignore_eos": True})
    assert reply.choices[0].logprobs is not None and reply.choices[0].logprobs.tokens is not None
    assert reply.usage is not None and reply.usage.prompt_tokens == len(prompt)
    return Answer(reply.choices[0].text, tuple(reply.choices[0].logprobs.tokens), reply.usage.completion_tokens)


ASK = {"chat": chat, "completions": complete}
# (endpoint, streamed): one prompt variant each, asked whole of the reference and as given of the system under test.
CASES = [(endpoint, stream) for stream in (False, True) for endpoint in ASK]


def case_variant(endpoint: str, stream: bool) -> str:
    return f"{endpoint}, {'streamed' if stream else 'whole'}"


def reference_answers(client: openai.OpenAI) -> dict[tuple[str, bool], Answer]:
    """Every case's answer, asked whole (the reference a streamed answer must equal too)."""
    return {(endpoint, stream): ASK[endpoint](client, False, case_variant(endpoint, stream))
            for endpoint, stream in CASES}
