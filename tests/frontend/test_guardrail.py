from __future__ import annotations

from typing import Any

import pytest

from frontend.guardrail import FallbackReason, GenEngineFacts, metadata_only_decision

PLAIN: dict[str, Any] = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
PLAIN_GEN = GenEngineFacts()
REUSE = GenEngineFacts(kv_block_reuse=True)
HANDOFF = GenEngineFacts(prompt_tokens_in_handoff=True)
REUSE_AND_HANDOFF = GenEngineFacts(kv_block_reuse=True, prompt_tokens_in_handoff=True)
IMAGE = {"role": "user", "content": [{"type": "text", "text": "see"}, {"type": "image_url", "image_url": {"url": "x"}}]}
AUDIO_INPUT = [{"role": "user", "content": [{"type": "input_audio", "input_audio": {}}]}]

# (row id, body changes, prompt_len, GEN facts, expected decision)
TABLE: list[tuple[str, dict[str, Any], int | None, GenEngineFacts, FallbackReason | None]] = [
    ("admit", {}, 128, PLAIN_GEN, None),
    ("admit-neutral-values", {"frequency_penalty": 0, "presence_penalty": 0.0, "repetition_penalty": 1.0,
                              "no_repeat_ngram_size": 0, "echo": False, "logit_bias": {},
                              "prompt_logprobs": None}, 128, PLAIN_GEN, None),
    ("admit-text-parts", {"messages": [{"role": "user", "content": [{"type": "text", "text": "a"}]}]},
     128, PLAIN_GEN, None),
    ("no_prompt_len", {}, None, PLAIN_GEN, FallbackReason.NO_PROMPT_LEN),
    ("no_prompt_len-even-with-handoff", {}, None, HANDOFF, FallbackReason.NO_PROMPT_LEN),
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
    ("harmony-even-with-handoff", {"chat_template_kwargs": {"format": "harmony"}}, 128, HANDOFF,
     FallbackReason.HARMONY),
    ("kv_block_reuse", {}, 128, REUSE, FallbackReason.KV_BLOCK_REUSE),
    ("value-reader-reported-before-block-reuse", {"echo": True}, 128, REUSE, FallbackReason.ECHO),
    ("prompt_tokens_in_handoff-admits-penalties", {"frequency_penalty": 1.0, "echo": True}, 128, HANDOFF, None),
    ("prompt_tokens_in_handoff-admits-block-reuse", {"logit_bias": {"1": 1}}, 128, REUSE_AND_HANDOFF, None),
]


def test_the_table_has_a_row_for_every_reason() -> None:
    assert {row[4] for row in TABLE} == {*FallbackReason, None}


@pytest.mark.parametrize(("changes", "prompt_len", "facts", "expected"), [row[1:] for row in TABLE],
                         ids=[row[0] for row in TABLE])
def test_metadata_only_decision(
    changes: dict[str, Any], prompt_len: int | None, facts: GenEngineFacts, expected: FallbackReason | None
) -> None:
    body = {**PLAIN, **changes}
    assert metadata_only_decision(body, prompt_len, facts) is expected


def test_the_decision_does_not_modify_the_body() -> None:
    body = {**PLAIN, "frequency_penalty": 0.5}
    snapshot = repr(body)
    metadata_only_decision(body, 10, PLAIN_GEN)
    assert repr(body) == snapshot


def test_reason_values_are_the_wire_field_names() -> None:
    assert FallbackReason.NO_REPEAT_NGRAM.value == "no_repeat_ngram_size"
    assert FallbackReason.KV_BLOCK_REUSE.value == "kv_block_reuse"
