"""The load generator's bodies: words or real text, and a distinct prompt per request (--distinct-prompts), which
differs from its first character."""

from __future__ import annotations

import pytest

from bench.driver.bodies import client_completion_body, corpus_text
from bench.driver.loadgen import client_body, distinct_body


def test_words_as_ever_or_real_text() -> None:
    assert client_body("completions", 300, 8) == client_completion_body(300, 8)  # words: as the benchmarks always sent
    assert client_body("completions", 300, 8, text="corpus")["prompt"] == corpus_text(300)
    assert client_body("chat", 300, 8, text="corpus")["messages"][0]["content"] == corpus_text(300)
    with pytest.raises(ValueError, match="unknown text"):
        client_body("chat", 300, 8, text="emoji")


def test_a_distinct_body_opens_its_prompt_with_its_number_and_leaves_the_rest() -> None:
    for endpoint in ("completions", "chat"):
        body = client_body(endpoint, 200, 8)
        first, second = distinct_body(body, 1), distinct_body(body, 2)
        texts = [b["prompt"] if endpoint == "completions" else b["messages"][0]["content"]
                 for b in (body, first, second)]
        assert texts[1] == "Request 1. " + texts[0] and texts[2] == "Request 2. " + texts[0]
        assert {k: v for k, v in first.items() if k not in ("prompt", "messages")} == \
            {k: v for k, v in body.items() if k not in ("prompt", "messages")}
        assert client_body(endpoint, 200, 8) == body  # the shared body is left as it was
