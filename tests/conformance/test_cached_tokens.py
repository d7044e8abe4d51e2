"""Item 8: ``usage.prompt_tokens_details.cached_tokens`` is real. On workers with KV block reuse, a repeated long
prompt reports the prompt tokens whose KV was reused, whole and streamed, chat and completions, through the
disaggregated pair (CTX's figure crosses the hand-off to GEN, or is replayed when CTX finishes) and on an aggregated
worker alike; a prompt seen for the first time reports 0."""

from __future__ import annotations

import itertools
from typing import Any

import pytest

from tests.workers.engines.reference.cluster import RefCluster, RefNode
from workers.engines.reference.prefix_cache import BLOCK_TOKENS

STORY = "The quick brown fox jumps over the lazy dog and runs into the forest, where it finds a river. " * 4
_fresh = itertools.count()


def cached_and_prompt_tokens(node: RefNode, endpoint: str, text: str, streamed: bool,
                             max_tokens: int) -> tuple[int, int]:
    body: dict[str, Any] = {"model": "tiny", "max_tokens": max_tokens, "temperature": 0}
    with node.client() as client:
        if endpoint == "chat":
            create: Any = client.chat.completions.create
            body["messages"] = [{"role": "user", "content": text}]
        else:
            create = client.completions.create
            body["prompt"] = text
        if streamed:
            chunks = list(create(**body, stream=True, stream_options={"include_usage": True}))
            usage = chunks[-1].usage
        else:
            usage = create(**body).usage
    assert usage is not None and usage.prompt_tokens_details is not None
    cached = usage.prompt_tokens_details.cached_tokens
    assert cached is not None
    return cached, usage.prompt_tokens


@pytest.mark.parametrize("max_tokens", [1, 4], ids=["ctx-finishes", "ctx-then-gen"])
@pytest.mark.parametrize("streamed", [False, True], ids=["whole", "streamed"])
@pytest.mark.parametrize("endpoint", ["chat", "completions"])
@pytest.mark.parametrize("node", ["orchestrator", "aggregated"])
def test_a_repeated_long_prompt_reports_its_reused(
    reuse_cluster: RefCluster, node: str, endpoint: str, streamed: bool, max_tokens: int
) -> None:
    text = f"Story number {next(_fresh)}. {STORY}"  # its first block is new: nothing of it is cached yet
    worker = getattr(reuse_cluster, node)
    first, prompt_tokens = cached_and_prompt_tokens(worker, endpoint, text, streamed, max_tokens)
    again, _ = cached_and_prompt_tokens(worker, endpoint, text, streamed, max_tokens)
    if endpoint == "completions":
        assert first == 0
    assert again > first
    # Whole blocks, and never the last prompt token: its logits must be computed.
    assert again % BLOCK_TOKENS == 0
    assert again == (prompt_tokens - 1) // BLOCK_TOKENS * BLOCK_TOKENS
