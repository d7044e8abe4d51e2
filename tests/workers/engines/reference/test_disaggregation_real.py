"""The real SmolLM2-135M model: disaggregated serving (CTX + GEN) equals aggregated serving, token for token."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from tests.workers.engines.reference.cluster import RefCluster, reference_cluster
from workers.engines.reference.engine import ReferenceOptions

pytestmark = pytest.mark.real_model

FRANCE = [{"role": "user", "content": "What is the capital of France?"}]
PROMPTS = [
    FRANCE,
    [{"role": "system", "content": "You answer in one short sentence."},
     {"role": "user", "content": "Why is the sky blue?"}],
    [{"role": "user", "content": "Write a haiku about the sea."}],
]


@pytest.fixture(scope="module")
def real_cluster() -> Iterator[RefCluster]:
    with reference_cluster(ReferenceOptions(blas_threads=1)) as cluster:
        yield cluster


def test_greedy_france_answers_paris(real_cluster: RefCluster) -> None:
    with real_cluster.orchestrator.client() as client:
        reply = client.chat.completions.create(model=real_cluster.model, messages=FRANCE, max_tokens=16,
                                               temperature=0)
    assert reply.choices[0].message.content == "The capital of France is Paris."
    assert reply.choices[0].finish_reason == "stop"
    assert reply.usage is not None and reply.usage.prompt_tokens == 37


@pytest.mark.parametrize(
    "options",
    [
        {"temperature": 0},
        {"temperature": 0, "frequency_penalty": 0.8, "presence_penalty": 0.4,
         "extra_body": {"repetition_penalty": 1.3}},
        {"temperature": 0, "stop": [" is", "."]},
        {"temperature": 0.8, "top_p": 0.9, "seed": 1234, "extra_body": {"top_k": 40}},
    ],
    ids=["greedy", "penalties", "stop-strings", "seeded-sampling"],
)
def test_disaggregated_equals_aggregated(real_cluster: RefCluster, options: dict[str, Any]) -> None:
    with real_cluster.orchestrator.client() as disagg, real_cluster.aggregated.client() as agg:
        for messages in PROMPTS:
            a = disagg.chat.completions.create(model=real_cluster.model, messages=messages,  # type: ignore[arg-type]
                                               max_tokens=12, **options)
            b = agg.chat.completions.create(model=real_cluster.model, messages=messages,  # type: ignore[arg-type]
                                            max_tokens=12, **options)
            assert a.choices[0].message.content == b.choices[0].message.content
            assert a.choices[0].finish_reason == b.choices[0].finish_reason
            assert a.usage == b.usage


def test_streamed_disaggregated_completion_equals_aggregated(real_cluster: RefCluster) -> None:
    with real_cluster.orchestrator.client() as disagg, real_cluster.aggregated.client() as agg:
        stream = disagg.completions.create(model=real_cluster.model, prompt="The three primary colours are",
                                           max_tokens=12, temperature=0, stream=True)
        streamed = "".join(chunk.choices[0].text for chunk in stream if chunk.choices)
        whole = agg.completions.create(model=real_cluster.model, prompt="The three primary colours are",
                                       max_tokens=12, temperature=0)
    assert streamed == whole.choices[0].text


def test_kv_store_is_empty_after_the_real_model_requests(real_cluster: RefCluster) -> None:
    text = httpx.get(real_cluster.ctx.url + "/metrics", timeout=10).text
    assert "disagg_kv_store_entries 0.0" in text
    assert "disagg_kv_store_bytes 0.0" in text
