"""Item 4: any 64-bit signed seed; the same seed gives the same output on the disaggregated pair (CTX then GEN)
and on an aggregated worker; a seed beyond 64 bits is a 400 naming it, from CTX, GEN and the orchestrator."""

from __future__ import annotations

import httpx
import openai
import pytest
from openai.types.chat import ChatCompletionMessageParam

from tests.workers.engines.reference.cluster import RefCluster

USER: list[ChatCompletionMessageParam] = [{"role": "user", "content": "Tell me a story"}]


@pytest.mark.parametrize("seed", [-1, -(2**63), 2**63 - 1, 0, 12345])
@pytest.mark.parametrize("streamed", [False, True])
def test_same_seed_same_output_everywhere(conformance_cluster: RefCluster, seed: int, streamed: bool) -> None:
    texts = []
    for node in (conformance_cluster.orchestrator, conformance_cluster.aggregated):
        with node.client() as client:
            for _ in range(2):
                if streamed:
                    chunks = client.chat.completions.create(model="tiny", messages=USER, max_tokens=6,
                                                            temperature=1.0, seed=seed, stream=True)
                    texts.append("".join(c.choices[0].delta.content or "" for c in chunks if c.choices))
                else:
                    reply = client.chat.completions.create(model="tiny", messages=USER, max_tokens=6,
                                                           temperature=1.0, seed=seed)
                    texts.append(reply.choices[0].message.content or "")
    assert len(set(texts)) == 1


@pytest.mark.parametrize("seed", [2**63, -(2**63) - 1])
def test_a_seed_beyond_64_bits_is_a_400_naming_it(conformance_cluster: RefCluster, seed: int) -> None:
    with conformance_cluster.orchestrator.client() as client, pytest.raises(openai.BadRequestError) as caught:
        client.completions.create(model="tiny", prompt="Hi", max_tokens=2, seed=seed)
    assert caught.value.param == "seed"
    for node in (conformance_cluster.ctx, conformance_cluster.gen, conformance_cluster.aggregated):
        reply = httpx.post(node.url + "/v1/completions", json={"model": "tiny", "prompt": "Hi", "seed": seed},
                           timeout=60)
        assert reply.status_code == 400
        assert reply.json()["error"]["param"] == "seed"
