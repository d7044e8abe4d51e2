"""Metadata-only mode on the reference engine (tiny model): output equal to the real-token path, every fallback
taken and counted, and with real tokens beside the KV a GEN body that does not grow with the prompt."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import orjson
import pytest

from tests.cluster import sample
from tests.workers.engines.reference.cluster import RefCluster, reference_cluster
from tests.workers.engines.reference.tiny_model import write_tiny_model
from workers.engines.reference.options import ReferenceOptions

MESSAGES = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(write_tiny_model(tmp_path_factory.mktemp("tiny") / "tiny.gguf", seed=0))


def _options(path: str, **extra: Any) -> ReferenceOptions:
    return ReferenceOptions(model_path=path, served_model_name="tiny", blas_threads=1, **extra)


@pytest.fixture(scope="module")
def without_tokens_in_handoff(tiny_model: str) -> Iterator[RefCluster]:
    with reference_cluster(_options(tiny_model, prompt_tokens_in_handoff=False),
                           gen_tokids_metadata_only=True) as cluster:
        yield cluster


@pytest.fixture(scope="module")
def with_tokens_in_handoff(tiny_model: str) -> Iterator[RefCluster]:
    with reference_cluster(_options(tiny_model), gen_tokids_metadata_only=True) as cluster:
        yield cluster


def _gen_bodies(cluster: RefCluster) -> list[dict[str, Any]]:
    assert cluster.gen.recorder is not None
    return [e.request_json() for e in cluster.gen.recorder.posts()]


def _chat(cluster: RefCluster, node: str, **options: Any) -> tuple[str, Any]:
    with getattr(cluster, node).client() as client:
        reply = client.chat.completions.create(model=cluster.model, messages=MESSAGES, max_tokens=10, **options)
    return reply.choices[0].message.content or "", reply.usage


def _gen_path_count(cluster: RefCluster, path: str) -> float:
    return sample(cluster.gen.app.state.metrics, "disagg_gen_prompt_path_total", path=path)


def _echo_through_both(cluster: RefCluster) -> list[str]:
    """An echo completion through the orchestrator, then from the aggregated worker."""
    texts = []
    for node in ("orchestrator", "aggregated"):
        with getattr(cluster, node).client() as client:
            reply = client.completions.create(model=cluster.model, prompt="Hello there", max_tokens=6,
                                              temperature=0, echo=True)
        texts.append(reply.choices[0].text)
    return texts


def _fallbacks(cluster: RefCluster, reason: str) -> float:
    return sample(cluster.orchestrator.app.state.metrics, "disagg_metadata_only_fallback_total", reason=reason)


def test_admitted_metadata_only_equals_the_real_token_output(without_tokens_in_handoff: RefCluster) -> None:
    cluster = without_tokens_in_handoff
    before = _gen_path_count(cluster, "metadata_only")
    for options in ({"temperature": 0}, {"temperature": 0.7, "seed": 5, "top_p": 0.9}):
        disagg = _chat(cluster, "orchestrator", **options)
        aggregated = _chat(cluster, "aggregated", **options)
        assert disagg == aggregated
    assert _gen_path_count(cluster, "metadata_only") == before + 2
    body = _gen_bodies(cluster)[-1]
    assert "prompt_token_ids_b64" not in body and "prompt_token_ids" not in body
    assert body["disaggregated_params"]["prompt_len"] > 0


def test_structured_output_takes_the_metadata_only_path(without_tokens_in_handoff: RefCluster) -> None:
    # The grammar reads output tokens only: GEN rebuilds it from the body and replays CTX's first token over it.
    cluster = without_tokens_in_handoff
    before = _gen_path_count(cluster, "metadata_only")
    # Short enough for the 10 tokens _chat allows (the tiny vocab spends about a token per character).
    schema = {"type": "object", "properties": {"n": {"enum": [1, 2, 3]}}, "required": ["n"],
              "additionalProperties": False}
    response_format = {"type": "json_schema", "json_schema": {"name": "s", "schema": schema}}
    disagg = _chat(cluster, "orchestrator", temperature=0, response_format=response_format)
    assert disagg == _chat(cluster, "aggregated", temperature=0, response_format=response_format)
    assert orjson.loads(disagg[0])["n"] in (1, 2, 3)
    assert _gen_path_count(cluster, "metadata_only") == before + 1


def test_n_sequences_on_a_length_only_prompt_equal_the_aggregated_ones(without_tokens_in_handoff: RefCluster) -> None:
    """n reads no prompt token values: the forked sequences decode on the placeholder like one sequence does."""
    cluster = without_tokens_in_handoff
    before = _gen_path_count(cluster, "metadata_only")
    answers = []
    for node in ("orchestrator", "aggregated"):
        with getattr(cluster, node).client() as client:
            reply = client.chat.completions.create(model=cluster.model, messages=MESSAGES, max_tokens=6, n=3,
                                                   temperature=1.0, seed=11, logprobs=True)
        answers.append([(c.index, c.finish_reason, [t.logprob for t in c.logprobs.content or ()] if c.logprobs
                         else None) for c in reply.choices])
    assert answers[0] == answers[1]
    assert [index for index, _, _ in answers[0]] == [0, 1, 2]
    assert _gen_path_count(cluster, "metadata_only") == before + 1


@pytest.mark.parametrize(
    ("reason", "options"),
    [
        ("frequency_penalty", {"frequency_penalty": 0.7}),
        ("presence_penalty", {"presence_penalty": 0.7}),
        ("repetition_penalty", {"extra_body": {"repetition_penalty": 1.3}}),
        ("logit_bias", {"logit_bias": {"50": 5.0}}),
        ("prompt_logprobs", {"extra_body": {"prompt_logprobs": 1}}),
        ("harmony", {"extra_body": {"chat_template_kwargs": {"format": "harmony"}}}),
    ],
)
def test_each_fallback_relays_real_tokens_counts_it_and_keeps_the_output(
    without_tokens_in_handoff: RefCluster, reason: str, options: dict[str, Any]
) -> None:
    cluster = without_tokens_in_handoff
    before, array_before = _fallbacks(cluster, reason), _gen_path_count(cluster, "array")
    disagg = _chat(cluster, "orchestrator", temperature=0, **options)
    aggregated = _chat(cluster, "aggregated", temperature=0, **options)
    assert disagg == aggregated
    assert _fallbacks(cluster, reason) == before + 1
    assert _gen_path_count(cluster, "array") == array_before + 1
    assert "prompt_token_ids_b64" in _gen_bodies(cluster)[-1]


def test_echo_falls_back_and_keeps_the_output(without_tokens_in_handoff: RefCluster) -> None:
    cluster = without_tokens_in_handoff
    before = _fallbacks(cluster, "echo")
    texts = _echo_through_both(cluster)
    assert texts[0] == texts[1] and texts[0].startswith("Hello there")
    assert _fallbacks(cluster, "echo") == before + 1


def test_block_reuse_on_gen_forces_the_fallback(tiny_model: str) -> None:
    with reference_cluster(_options(tiny_model, prompt_tokens_in_handoff=False),
                           gen_options=_options(tiny_model, prompt_tokens_in_handoff=False, kv_block_reuse=True),
                           gen_tokids_metadata_only=True) as cluster:
        disagg = _chat(cluster, "orchestrator", temperature=0)
        aggregated = _chat(cluster, "aggregated", temperature=0)
        assert disagg == aggregated
        assert _fallbacks(cluster, "kv_block_reuse") == 1
        assert _gen_path_count(cluster, "metadata_only") == 0


def test_gen_refuses_a_placeholder_that_a_penalty_would_read(without_tokens_in_handoff: RefCluster) -> None:
    """The GEN side of the guardrail: a body that skipped the orchestrator's check is refused, not decoded."""
    import httpx

    cluster = without_tokens_in_handoff
    ctx_body = {"model": cluster.model, "messages": MESSAGES, "max_tokens": 8, "temperature": 0,
                "disaggregated_params": {"request_type": "context_only", "return_prompt_token_ids_b64": True,
                                         "native_extensions": True}}
    ctx = httpx.post(cluster.ctx.url + "/v1/chat/completions", json=ctx_body, timeout=60).json()
    params = {**ctx["choices"][0]["disaggregated_params"], "request_type": "generation_only"}
    gen_body = {"model": cluster.model, "messages": MESSAGES, "max_tokens": 8, "temperature": 0,
                "presence_penalty": 1.0, "disaggregated_params": params}
    reply = httpx.post(cluster.gen.url + "/v1/chat/completions", json=gen_body, timeout=60)
    assert reply.status_code == 400
    error = reply.json()["error"]
    assert error["code"] == "metadata_only_refused" and error["param"] == "presence_penalty"


def test_tokens_beside_the_kv_admit_penalties_with_equal_output(with_tokens_in_handoff: RefCluster) -> None:
    cluster = with_tokens_in_handoff
    options: dict[str, Any] = {"temperature": 0, "frequency_penalty": 0.9, "presence_penalty": 0.5,
                               "extra_body": {"repetition_penalty": 1.3}}
    before = _gen_path_count(cluster, "metadata_only")
    assert _chat(cluster, "orchestrator", **options) == _chat(cluster, "aggregated", **options)
    assert _gen_path_count(cluster, "metadata_only") == before + 1
    body = _gen_bodies(cluster)[-1]
    for field in ("prompt_token_ids_b64", "prompt_token_ids", "messages"):
        assert field not in body


def test_tokens_beside_the_kv_admit_echo(with_tokens_in_handoff: RefCluster) -> None:
    cluster = with_tokens_in_handoff
    texts = _echo_through_both(cluster)
    assert texts[0] == texts[1] and texts[0].startswith("Hello there")
    assert "prompt" not in _gen_bodies(cluster)[-1]


def test_the_gen_body_does_not_grow_with_the_prompt(with_tokens_in_handoff: RefCluster) -> None:
    cluster = with_tokens_in_handoff
    sizes = []
    for words in (5, 120):
        with cluster.orchestrator.client() as client:
            client.chat.completions.create(model=cluster.model, max_tokens=2, temperature=0,
                                           messages=[{"role": "user", "content": "word " * words}])
        assert cluster.gen.recorder is not None
        body = cluster.gen.recorder.posts()[-1].request_body
        sizes.append(len(body))
        assert b"word word" not in body
    assert abs(sizes[1] - sizes[0]) < 16  # only the digits of prompt_len and ids differ
