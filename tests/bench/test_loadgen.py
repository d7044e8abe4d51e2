"""bench.loadgen's bodies: a distinct prompt per request (--distinct-prompts) differs from its first character."""

from __future__ import annotations

from bench.loadgen import client_body, distinct_body


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
