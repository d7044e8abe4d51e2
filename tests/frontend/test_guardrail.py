from __future__ import annotations

from typing import Any

import pytest

from frontend.guardrail import (
    FallbackReason,
    GenEngineFacts,
    PromptFacts,
    decide_for_reading,
    metadata_only_decision,
    prompt_facts_of_body,
    read_body,
    sampling_from_body,
)
from frontend.sampling import SamplingParams

PLAIN_GEN = GenEngineFacts()
REUSE = GenEngineFacts(kv_block_reuse=True)
HANDOFF = GenEngineFacts(prompt_tokens_in_handoff=True)
REUSE_AND_HANDOFF = GenEngineFacts(kv_block_reuse=True, prompt_tokens_in_handoff=True)
TEXT = PromptFacts()
MEDIA = PromptFacts(multimodal=True)
HARMONY = PromptFacts(harmony=True)

# The pure function, over typed values: (row id, sampling changes, prompt facts, prompt_len, GEN facts, expected)
TABLE: list[tuple[str, dict[str, Any], PromptFacts, int | None, GenEngineFacts, FallbackReason | None]] = [
    ("admit", {}, TEXT, 128, PLAIN_GEN, None),
    ("admit-sampling-that-reads-no-prompt-values", {"temperature": 0.7, "top_p": 0.9, "top_k": 5, "seed": 1,
                                                     "stop": ("x",), "logprobs": 2, "ignore_eos": True,
                                                     "n": 3},
     TEXT, 128, PLAIN_GEN, None),
    # A grammar reads only output tokens: GEN rebuilds it from the request and CTX's first token.
    ("admit-structured-output", {"json_schema": '{"type": "object"}'}, TEXT, 128, PLAIN_GEN, None),
    ("no_prompt_len", {}, TEXT, None, PLAIN_GEN, FallbackReason.NO_PROMPT_LEN),
    ("no_prompt_len-even-with-handoff", {}, TEXT, None, HANDOFF, FallbackReason.NO_PROMPT_LEN),
    ("frequency_penalty", {"frequency_penalty": 0.5}, TEXT, 128, PLAIN_GEN, FallbackReason.FREQUENCY_PENALTY),
    ("presence_penalty", {"presence_penalty": -0.5}, TEXT, 128, PLAIN_GEN, FallbackReason.PRESENCE_PENALTY),
    ("repetition_penalty", {"repetition_penalty": 1.1}, TEXT, 128, PLAIN_GEN, FallbackReason.REPETITION_PENALTY),
    ("no_repeat_ngram_size", {"no_repeat_ngram_size": 3}, TEXT, 128, PLAIN_GEN, FallbackReason.NO_REPEAT_NGRAM),
    ("echo", {"echo": True}, TEXT, 128, PLAIN_GEN, FallbackReason.ECHO),
    ("prompt_logprobs", {"prompt_logprobs": 0}, TEXT, 128, PLAIN_GEN, FallbackReason.PROMPT_LOGPROBS),
    ("logit_bias", {"logit_bias": ((42, 5.0),)}, TEXT, 128, PLAIN_GEN, FallbackReason.LOGIT_BIAS),
    ("multimodal", {}, MEDIA, 128, PLAIN_GEN, FallbackReason.MULTIMODAL),
    ("multimodal-even-with-handoff", {}, MEDIA, 128, HANDOFF, FallbackReason.MULTIMODAL),
    ("harmony", {}, HARMONY, 128, PLAIN_GEN, FallbackReason.HARMONY),
    ("harmony-even-with-handoff", {}, HARMONY, 128, HANDOFF, FallbackReason.HARMONY),
    ("kv_block_reuse", {}, TEXT, 128, REUSE, FallbackReason.KV_BLOCK_REUSE),
    ("value-reader-reported-before-block-reuse", {"echo": True}, TEXT, 128, REUSE, FallbackReason.ECHO),
    ("first-value-reader-is-reported", {"echo": True, "frequency_penalty": 1.0}, TEXT, 128, PLAIN_GEN,
     FallbackReason.FREQUENCY_PENALTY),
    ("prompt_tokens_in_handoff-admits-penalties", {"frequency_penalty": 1.0, "echo": True}, TEXT, 128, HANDOFF,
     None),
    ("prompt_tokens_in_handoff-admits-block-reuse", {"logit_bias": ((1, 1.0),)}, TEXT, 128, REUSE_AND_HANDOFF,
     None),
]


def test_the_table_has_a_row_for_every_reason() -> None:
    assert {row[5] for row in TABLE} == {*FallbackReason, None}


@pytest.mark.parametrize(("changes", "prompt", "prompt_len", "facts", "expected"), [row[1:] for row in TABLE],
                         ids=[row[0] for row in TABLE])
def test_metadata_only_decision(
    changes: dict[str, Any], prompt: PromptFacts, prompt_len: int | None, facts: GenEngineFacts,
    expected: FallbackReason | None,
) -> None:
    assert metadata_only_decision(SamplingParams(**changes), prompt, prompt_len, facts) is expected


# The orchestrator's entry, over raw client bodies: the same decisions, read from JSON.
PLAIN: dict[str, Any] = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
IMAGE = {"role": "user", "content": [{"type": "text", "text": "see"}, {"type": "image_url", "image_url": {"url": "x"}}]}
AUDIO_INPUT = [{"role": "user", "content": [{"type": "input_audio", "input_audio": {}}]}]

BODY_TABLE: list[tuple[str, dict[str, Any], int | None, GenEngineFacts, FallbackReason | None]] = [
    ("admit", {}, 128, PLAIN_GEN, None),
    ("admit-neutral-values", {"frequency_penalty": 0, "presence_penalty": 0.0, "repetition_penalty": 1.0,
                              "no_repeat_ngram_size": 0, "echo": False, "logit_bias": {},
                              "prompt_logprobs": None}, 128, PLAIN_GEN, None),
    ("admit-text-parts", {"messages": [{"role": "user", "content": [{"type": "text", "text": "a"}]}]},
     128, PLAIN_GEN, None),
    ("admit-other-fields-are-not-read", {"temperature": "hot", "stop": 7}, 128, PLAIN_GEN, None),
    ("admit-structured-output", {"response_format": {"type": "json_object"}, "tool_choice": "required",
                                 "tools": [{"type": "function", "function": {"name": "f"}}]}, 128, PLAIN_GEN, None),
    ("no_prompt_len", {}, None, PLAIN_GEN, FallbackReason.NO_PROMPT_LEN),
    ("frequency_penalty", {"frequency_penalty": 0.5}, 128, PLAIN_GEN, FallbackReason.FREQUENCY_PENALTY),
    ("presence_penalty", {"presence_penalty": -0.5}, 128, PLAIN_GEN, FallbackReason.PRESENCE_PENALTY),
    ("repetition_penalty", {"repetition_penalty": 1.1}, 128, PLAIN_GEN, FallbackReason.REPETITION_PENALTY),
    ("no_repeat_ngram_size", {"no_repeat_ngram_size": 3}, 128, PLAIN_GEN, FallbackReason.NO_REPEAT_NGRAM),
    ("echo", {"prompt": "x", "echo": True}, 128, PLAIN_GEN, FallbackReason.ECHO),
    ("prompt_logprobs", {"prompt_logprobs": 0}, 128, PLAIN_GEN, FallbackReason.PROMPT_LOGPROBS),
    ("logit_bias", {"logit_bias": {"42": 5.0}}, 128, PLAIN_GEN, FallbackReason.LOGIT_BIAS),
    ("multimodal-chat", {"messages": [IMAGE]}, 128, PLAIN_GEN, FallbackReason.MULTIMODAL),
    ("multimodal-responses-input", {"messages": None, "input": AUDIO_INPUT}, 128, PLAIN_GEN,
     FallbackReason.MULTIMODAL),
    ("multimodal-even-with-handoff", {"messages": [IMAGE]}, 128, HANDOFF, FallbackReason.MULTIMODAL),
    ("harmony", {"chat_template_kwargs": {"format": "harmony"}}, 128, PLAIN_GEN, FallbackReason.HARMONY),
    ("kv_block_reuse", {}, 128, REUSE, FallbackReason.KV_BLOCK_REUSE),
    ("prompt_tokens_in_handoff-admits-penalties", {"frequency_penalty": 1.0, "echo": True}, 128, HANDOFF, None),
    # A value that cannot be judged (wrong type, out of range) falls back under its own name: relaying real
    # tokens is always safe, and CTX refuses such a body anyway.
    ("unreadable-number", {"frequency_penalty": "0.5"}, 128, HANDOFF, FallbackReason.FREQUENCY_PENALTY),
    ("a-bool-is-not-a-number", {"repetition_penalty": True}, 128, PLAIN_GEN, FallbackReason.REPETITION_PENALTY),
    ("out-of-range", {"repetition_penalty": -1}, 128, PLAIN_GEN, FallbackReason.REPETITION_PENALTY),
    ("unreadable-echo", {"echo": 1}, 128, PLAIN_GEN, FallbackReason.ECHO),
    ("unreadable-prompt-logprobs", {"prompt_logprobs": 1.5}, 128, PLAIN_GEN, FallbackReason.PROMPT_LOGPROBS),
    ("unreadable-logit-bias-key", {"logit_bias": {"a": 1}}, 128, PLAIN_GEN, FallbackReason.LOGIT_BIAS),
    ("unreadable-logit-bias", {"logit_bias": [1]}, 128, PLAIN_GEN, FallbackReason.LOGIT_BIAS),
]


@pytest.mark.parametrize(("changes", "prompt_len", "facts", "expected"), [row[1:] for row in BODY_TABLE],
                         ids=[row[0] for row in BODY_TABLE])
def test_decide_for_reading_of_a_raw_body(
    changes: dict[str, Any], prompt_len: int | None, facts: GenEngineFacts, expected: FallbackReason | None
) -> None:
    body = {**PLAIN, **changes}
    assert decide_for_reading(read_body(body), prompt_len, facts) is expected


def test_the_body_is_read_into_the_typed_values() -> None:
    body = {**PLAIN, "frequency_penalty": 0.5, "repetition_penalty": 2, "echo": True, "prompt_logprobs": 1,
            "logit_bias": {"9": 1, "3": -2.0}, "chat_template_kwargs": {"format": "harmony"}}
    assert sampling_from_body(body) == SamplingParams(frequency_penalty=0.5, repetition_penalty=2.0, echo=True,
                                                      prompt_logprobs=1, logit_bias=((3, -2.0), (9, 1.0)))
    assert prompt_facts_of_body(body) == PromptFacts(harmony=True)


def test_a_body_that_sets_none_of_the_fields_reads_as_the_defaults() -> None:
    assert sampling_from_body(PLAIN) == SamplingParams()
    assert sampling_from_body({**PLAIN, "echo": None, "logit_bias": None}) == SamplingParams()


def test_the_prompt_text_is_never_read() -> None:
    class Untouchable(str):
        def __getattribute__(self, name: str) -> Any:
            if name == "__class__":  # isinstance() may ask what it is; reading it is another matter
                return super().__getattribute__(name)
            raise AssertionError(f"the guardrail read the prompt text ({name})")

    body = {**PLAIN, "messages": [{"role": "user", "content": Untouchable("x" * 1000)}]}
    assert decide_for_reading(read_body(body), 10, PLAIN_GEN) is None


def test_the_decision_does_not_modify_the_body() -> None:
    body = {**PLAIN, "frequency_penalty": 0.5}
    snapshot = repr(body)
    decide_for_reading(read_body(body), 10, PLAIN_GEN)
    assert repr(body) == snapshot


def test_reason_values_are_the_wire_field_names() -> None:
    assert FallbackReason.NO_REPEAT_NGRAM.value == "no_repeat_ngram_size"
    assert FallbackReason.KV_BLOCK_REUSE.value == "kv_block_reuse"
    assert {FallbackReason(name) for name in SamplingParams(
        frequency_penalty=1, presence_penalty=1, repetition_penalty=2, no_repeat_ngram_size=2, echo=True,
        prompt_logprobs=0, logit_bias=((1, 1.0),)).reads_prompt_token_values} <= set(FallbackReason)
