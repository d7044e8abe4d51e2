"""The vllm adapter's hand-off logic that needs no vLLM: GEN's first token(s), chosen again, are the answer's,
counted where they are not CTX's."""

from __future__ import annotations

import re
from collections.abc import AsyncIterator
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest

from frontend.sampling import SamplingParams
from frontend.token_codec import TOKEN_DTYPE
from workers.engines.options import VllmConfig
from workers.engines.outputs import EngineInfo
from workers.engines.request import GenerationRequest, Handoff, Phase
from workers.engines.vllm.engine import VllmEngine
from workers.engines.vllm.handoff import VllmHandoff


# -- GEN's path through the adapter, vLLM's AsyncLLM played by a stand-in ---------------------------------------
@dataclass
class Completion:
    token_ids: list[int]
    index: int = 0
    finish_reason: str | None = None
    logprobs: None = None


@dataclass
class RequestOutput:
    outputs: list[Completion]
    finished: bool
    kv_transfer_params: dict[str, Any] | None = None
    num_cached_tokens: int | None = None  # vLLM's count, on every output of a request


class StandInLLM:
    """``AsyncLLM.generate``, answering with ``tokens`` one a step (what GEN's vLLM chooses from the loaded KV)."""

    def __init__(self, tokens: list[int], cached: int | None = None) -> None:
        self.tokens = tokens
        self.cached = cached  # prompt tokens it found cached or loaded through the connector
        self.asked: list[Any] = []
        self.aborted: list[str] = []
        self.vllm_config = SimpleNamespace(cache_config=SimpleNamespace(block_size=4))

    async def generate(self, prompt: Any, sampling: Any, request_id: str) -> AsyncIterator[RequestOutput]:
        self.asked.append(sampling)
        for position, token in enumerate(self.tokens):
            last = position == len(self.tokens) - 1
            yield RequestOutput([Completion([token], finish_reason="length" if last else None)], last,
                                num_cached_tokens=self.cached)

    async def abort(self, request_id: str) -> None:
        self.aborted.append(request_id)


def vllm_namespace() -> Any:
    return SimpleNamespace(SamplingParams=lambda **fields: fields, RequestOutputKind=SimpleNamespace(DELTA="delta"),
                           TokensPrompt=lambda prompt_token_ids: prompt_token_ids, ClientError=RuntimeError,
                           StructuredOutputsParams=dict)


def started_engine(llm: StandInLLM) -> VllmEngine:
    engine = VllmEngine(VllmConfig())
    engine._vllm, engine._llm = vllm_namespace(), llm
    engine._tokenizer = SimpleNamespace(eos_token_ids=frozenset({2}))  # type: ignore[assignment]
    engine._info = EngineInfo(engine="vllm", model="m", vocab_size=100, max_context=64, model_hash="h")
    return engine


def gen_request(ctx_first_token: int, temperature: float = 0.0) -> GenerationRequest:
    prompt = np.arange(10, 20, dtype=TOKEN_DTYPE)
    state = VllmHandoff("h", len(prompt), {"remote_block_ids": [1]}, seed=7).encode()
    return GenerationRequest("g", prompt, SamplingParams(max_tokens=4, temperature=temperature),
                             phase=Phase.GENERATION_ONLY, handoff=Handoff((ctx_first_token,), state))


def differed(engine: VllmEngine, sampling: str) -> float:
    text = engine.metrics_text().decode()
    match = re.search(rf'^disagg_vllm_first_token_differed_total{{sampling="{sampling}"}} (\S+)$', text, re.M)
    assert match is not None, text
    return float(match.group(1))


@pytest.mark.parametrize("temperature", [0.0, 0.8], ids=["greedy", "sampled"])
async def test_gens_first_token_is_the_answers_when_it_is_not_ctxs_and_is_counted(temperature: float) -> None:
    llm = StandInLLM([41, 42, 43, 44])  # GEN's vLLM chooses 41 first
    engine = started_engine(llm)
    label = "greedy" if temperature == 0 else "sampled"
    assert differed(engine, "greedy") == differed(engine, "sampled") == 0  # both exported from start-up
    outputs = [o async for o in engine.generate(gen_request(ctx_first_token=40, temperature=temperature))]
    # The answer continues from GEN's 41 (not a failed request, not CTX's 40 followed by GEN's 42...).
    assert [t for o in outputs for t in o.token_ids] == [41, 42, 43, 44]
    assert outputs[0].chose_first_tokens and not any(o.chose_first_tokens for o in outputs[1:])
    assert outputs[-1].finish_reason == "length"
    assert differed(engine, label) == 1 and differed(engine, "sampled" if label == "greedy" else "greedy") == 0
    # vLLM was asked for the whole budget on the prompt alone, fetching CTX's KV with CTX's seed.
    (asked,) = llm.asked
    assert asked["max_tokens"] == 4 and asked["seed"] == 7
    assert asked["extra_args"]["kv_transfer_params"]["do_remote_prefill"] is True


@pytest.mark.parametrize(("cached", "recomputed"), [(8, 0), (9, 0), (4, 4), (0, 8), (None, 8)])
async def test_gen_reports_the_whole_blocks_of_the_prompt_vllm_computed_itself(cached: int | None,
                                                                               recomputed: int) -> None:
    """A 10-token prompt in 4-token blocks: the connector moves the two whole blocks before the last token (8
    tokens); what vLLM computed of those is reported, never the tail it computes anyway (frontend/prompt_report.py)."""
    engine = started_engine(StandInLLM([40, 42, 43, 44], cached=cached))
    outputs = [o async for o in engine.generate(gen_request(ctx_first_token=40))]
    assert outputs[0].recomputed_tokens == recomputed
    assert not any(o.recomputed_tokens for o in outputs[1:])


async def test_gens_first_token_equal_to_ctxs_counts_nothing() -> None:
    engine = started_engine(StandInLLM([40, 42, 43, 44]))
    outputs = [o async for o in engine.generate(gen_request(ctx_first_token=40))]
    assert [t for o in outputs for t in o.token_ids] == [40, 42, 43, 44]
    assert outputs[0].chose_first_tokens
    assert differed(engine, "greedy") == 0
