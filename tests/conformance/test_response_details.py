"""Item 8: system_fingerprint, usage.prompt_tokens_details.cached_tokens, and ``usage: null`` on every stream chunk
but the last when usage is asked for, through the disaggregated pair and on an aggregated worker alike."""

from __future__ import annotations

import pytest
from openai.types.chat import ChatCompletionMessageParam

from frontend.openai_output import SYSTEM_FINGERPRINT
from tests.workers.engines.reference.cluster import RefCluster

USER: list[ChatCompletionMessageParam] = [{"role": "user", "content": "Hello there"}]


@pytest.mark.parametrize("max_tokens", [1, 4], ids=["ctx-finishes", "ctx-then-gen"])
def test_whole_answers_carry_the_fingerprint_and_cached_tokens(conformance_cluster: RefCluster,
                                                                max_tokens: int) -> None:
    for node in (conformance_cluster.orchestrator, conformance_cluster.aggregated):
        with node.client() as client:
            chat = client.chat.completions.create(model="tiny", messages=USER, max_tokens=max_tokens)
            text = client.completions.create(model="tiny", prompt="Hello", max_tokens=max_tokens)
        for reply in (chat, text):
            assert reply.system_fingerprint == SYSTEM_FINGERPRINT
            assert reply.usage is not None and reply.usage.prompt_tokens_details is not None
            assert reply.usage.prompt_tokens_details.cached_tokens == 0  # no KV block reuse on these workers


@pytest.mark.parametrize("max_tokens", [1, 4], ids=["ctx-finishes", "ctx-then-gen"])
def test_stream_chunks_have_null_usage_until_the_last(conformance_cluster: RefCluster, max_tokens: int) -> None:
    with conformance_cluster.orchestrator.client() as client:
        chat = list(client.chat.completions.create(model="tiny", messages=USER, max_tokens=max_tokens,
                                                   stream=True, stream_options={"include_usage": True}))
        text = list(client.completions.create(model="tiny", prompt="Hello", max_tokens=max_tokens, stream=True,
                                              stream_options={"include_usage": True}))
    for chunks in (chat, text):
        assert all(c.usage is None for c in chunks[:-1])
        last = chunks[-1]
        assert last.choices == [] and last.usage is not None
        assert last.usage.prompt_tokens_details is not None and last.usage.prompt_tokens_details.cached_tokens == 0
        assert all(c.system_fingerprint == SYSTEM_FINGERPRINT for c in chunks)
