"""Item 2: echo's prompt logprobs, running text offsets, vLLM's prompt_logprobs, whole and streamed, and the
disaggregated answer equal to the aggregated one (CTX scores the prompt; the hand-off carries the scores)."""

from __future__ import annotations

from typing import Any

import httpx
import orjson
import pytest

from tests.workers.engines.reference.cluster import RefCluster
from tests.workers.engines.reference.tiny_model import CONTROL_TOKENS

PROMPT = "The capital of Germany is"


def post(url: str, path: str, body: dict[str, Any]) -> dict[str, Any]:
    reply = httpx.post(url + path, json={"model": "tiny", **body}, timeout=120)
    assert reply.status_code == 200, reply.text
    answer: dict[str, Any] = reply.json()
    return answer


def stream(url: str, path: str, body: dict[str, Any]) -> list[dict[str, Any]]:
    with httpx.stream("POST", url + path, json={"model": "tiny", "stream": True, **body}, timeout=120) as reply:
        assert reply.status_code == 200
        lines = [line[6:] for line in reply.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [orjson.loads(line) for line in lines[:-1]]


def test_echo_gives_every_prompt_token_its_text_and_logprob(conformance_cluster: RefCluster) -> None:
    url = conformance_cluster.orchestrator.url
    answer = post(url, "/v1/completions", {"prompt": PROMPT, "echo": True, "logprobs": 2, "max_tokens": 3,
                                           "temperature": 0})
    choice = answer["choices"][0]
    lp = choice["logprobs"]
    prompt_tokens = answer["usage"]["prompt_tokens"]
    assert "".join(lp["tokens"][:prompt_tokens]) == PROMPT
    assert lp["token_logprobs"][0] is None and all(v is not None for v in lp["token_logprobs"][1:])
    offsets = [0]
    for token in lp["tokens"][:-1]:
        offsets.append(offsets[-1] + len(token))
    assert lp["text_offset"] == offsets
    assert choice["text"].startswith(PROMPT)


def test_streamed_text_offsets_run_over_the_whole_text(conformance_cluster: RefCluster) -> None:
    url = conformance_cluster.orchestrator.url
    body = {"prompt": PROMPT, "echo": True, "logprobs": 1, "max_tokens": 4, "temperature": 0}
    whole = post(url, "/v1/completions", body)["choices"][0]["logprobs"]
    chunks = stream(url, "/v1/completions", body)
    tokens, offsets, logprobs = [], [], []
    for chunk in chunks:
        for choice in chunk["choices"]:
            if choice["logprobs"]:
                tokens += choice["logprobs"]["tokens"]
                offsets += choice["logprobs"]["text_offset"]
                logprobs += choice["logprobs"]["token_logprobs"]
    assert tokens == whole["tokens"]
    assert offsets == whole["text_offset"]
    assert logprobs == whole["token_logprobs"]


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_prompt_logprobs_are_returned_and_disaggregated_equals_aggregated(
    conformance_cluster: RefCluster, path: str
) -> None:
    body: dict[str, Any] = {"max_tokens": 3, "temperature": 0, "prompt_logprobs": 2}
    body |= {"prompt": PROMPT} if path == "/v1/completions" else {"messages": [{"role": "user", "content": PROMPT}]}
    disagg = post(conformance_cluster.orchestrator.url, path, body)
    agg = post(conformance_cluster.aggregated.url, path, body)

    def prompt_logprobs(answer: dict[str, Any]) -> Any:
        return answer["prompt_logprobs"] if path == "/v1/chat/completions" else answer["choices"][0]["prompt_logprobs"]

    scores = prompt_logprobs(disagg)
    assert len(scores) == disagg["usage"]["prompt_tokens"]
    assert scores[0] is None
    assert all(isinstance(entry, dict) and len(entry) >= 1 for entry in scores[1:])
    first = next(iter(scores[1].values()))
    assert set(first) == {"logprob", "rank", "decoded_token"}
    assert scores == prompt_logprobs(agg)
    streamed = stream(conformance_cluster.orchestrator.url, path, body)
    sent = [prompt_logprobs(c) if path == "/v1/chat/completions" else c["choices"][0].get("prompt_logprobs")
            for c in streamed if (c.get("prompt_logprobs") if path == "/v1/chat/completions"
                                  else c["choices"] and c["choices"][0].get("prompt_logprobs"))]
    assert sent == [scores]


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_a_stream_ctx_finishes_keeps_its_logprobs(conformance_cluster: RefCluster, path: str) -> None:
    body: dict[str, Any] = {"max_tokens": 1, "temperature": 0}
    if path == "/v1/completions":
        body |= {"prompt": PROMPT, "logprobs": 2}
    else:
        body |= {"messages": [{"role": "user", "content": PROMPT}], "logprobs": True, "top_logprobs": 2}
    url = conformance_cluster.orchestrator.url
    whole = post(url, path, body)["choices"][0]["logprobs"]
    chunks = stream(url, path, body)
    streamed = [c["choices"][0]["logprobs"] for c in chunks if c["choices"] and c["choices"][0]["logprobs"]]
    assert streamed == [whole]



# The tiny vocabulary has the 256 byte tokens, in byte order, right after its control tokens: these are the ids of
# the two halves of "é", each only part of a character.
E_ACUTE = "é".encode()
E_ACUTE_HALVES = [len(CONTROL_TOKENS) + byte for byte in E_ACUTE]


@pytest.mark.parametrize("stream_it", [False, True], ids=["whole", "stream"])
@pytest.mark.parametrize("node", ["aggregated", "orchestrator"])
def test_logprob_bytes_are_each_tokens_own_bytes(conformance_cluster: RefCluster, node: str,
                                                 stream_it: bool) -> None:
    """A token that is only part of a character has U+FFFD as its text; its bytes are still its own."""
    url = getattr(conformance_cluster, node).url
    body = {"messages": [{"role": "user", "content": "Say something."}], "max_tokens": 2, "temperature": 0,
            "logprobs": True, "top_logprobs": 20, "logit_bias": {str(t): 100 for t in E_ACUTE_HALVES}}
    if stream_it:
        entries = [entry for chunk in stream(url, "/v1/chat/completions", body) for choice in chunk["choices"]
                   for entry in (choice["logprobs"] or {}).get("content") or ()]
    else:
        entries = post(url, "/v1/chat/completions", body)["choices"][0]["logprobs"]["content"]
    assert len(entries) == 2
    for entry in entries:  # the bias made each one half of "é"
        assert entry["token"] == "\ufffd"
        assert len(entry["bytes"]) == 1 and entry["bytes"][0] in E_ACUTE  # not U+FFFD's ef bf bd
    alternatives = [top for entry in entries for top in entry["top_logprobs"]]
    partial = [top for top in alternatives if top["token"] == "\ufffd"]
    assert partial  # the tiny model's 20 likeliest always hold some of its 128 bytes >= 0x80
    for top in alternatives:
        if top["token"] == "\ufffd":  # a lone byte token of a character's middle or start: one byte >= 0x80
            assert len(top["bytes"]) == 1 and top["bytes"][0] >= 0x80
        else:
            assert bytes(top["bytes"]).decode() == top["token"]
