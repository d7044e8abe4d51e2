from __future__ import annotations

import numpy as np
import orjson
import pytest

from frontend.errors import HandoffError
from frontend.sampling import SamplingParams
from frontend.token_codec import TOKEN_DTYPE
from workers.engines.outputs import EngineOutput
from workers.engines.request import GenerationRequest, Handoff, Phase
from workers.engines.synthetic import EOS_TOKEN_ID, SYNTHETIC_TEXT, SyntheticConfig, SyntheticEngine

PROMPT = np.arange(10, dtype=TOKEN_DTYPE)


async def run(engine: SyntheticEngine, request: GenerationRequest) -> list[EngineOutput]:
    return [output async for output in engine.generate(request)]


def tokens(outputs: list[EngineOutput]) -> list[int]:
    return [t for o in outputs for t in o.token_ids]


async def test_aggregated_emits_the_text_cyclically_to_max_tokens() -> None:
    outputs = await run(SyntheticEngine(), GenerationRequest("a", PROMPT, SamplingParams(max_tokens=100)))
    assert tokens(outputs) == [SYNTHETIC_TEXT[i % len(SYNTHETIC_TEXT)] for i in range(100)]
    assert [o.finish_reason for o in outputs[-2:]] == [None, "length"]


async def test_context_only_yields_one_output_with_a_handoff() -> None:
    (output,) = await run(SyntheticEngine(), GenerationRequest("c", PROMPT, SamplingParams(max_tokens=9),
                                                               phase=Phase.CONTEXT_ONLY))
    assert output.token_ids == (SYNTHETIC_TEXT[0],)
    assert output.finish_reason is None
    assert output.handoff_state is not None
    assert orjson.loads(output.handoff_state) == {"engine": "synthetic", "prompt_len": 10, "position": 1}


async def test_generation_only_continues_where_ctx_stopped() -> None:
    engine = SyntheticEngine()
    (ctx,) = await run(engine, GenerationRequest("c", PROMPT, SamplingParams(max_tokens=9), phase=Phase.CONTEXT_ONLY))
    assert ctx.handoff_state is not None
    gen = await run(engine, GenerationRequest("g", PROMPT, SamplingParams(max_tokens=9), phase=Phase.GENERATION_ONLY,
                                              handoff=Handoff(ctx.token_ids, ctx.handoff_state)))
    assert list(ctx.token_ids) + tokens(gen) == list(SYNTHETIC_TEXT[:9])


@pytest.mark.parametrize(
    "state",
    [b"not json", b'{"engine": "reference", "prompt_len": 10, "position": 1}',
     b'{"engine": "synthetic", "prompt_len": 11, "position": 1}', b'{"engine": "synthetic"}'],
)
async def test_an_unusable_handoff_is_a_handoff_error(state: bytes) -> None:
    request = GenerationRequest("g", PROMPT, SamplingParams(max_tokens=3), phase=Phase.GENERATION_ONLY,
                                handoff=Handoff((1,), state))
    with pytest.raises(HandoffError):
        await run(SyntheticEngine(), request)


async def test_eos_after_output_tokens_unless_ignored() -> None:
    engine = SyntheticEngine(SyntheticConfig(output_tokens=3))
    outputs = await run(engine, GenerationRequest("a", PROMPT, SamplingParams(max_tokens=10)))
    assert tokens(outputs) == [*SYNTHETIC_TEXT[:3], EOS_TOKEN_ID]
    assert outputs[-1].finish_reason == "stop"
    ignoring = await run(engine, GenerationRequest("b", PROMPT, SamplingParams(max_tokens=6, ignore_eos=True)))
    assert len(tokens(ignoring)) == 6
    assert ignoring[-1].finish_reason == "length"


async def test_eos_as_the_first_token_finishes_ctx_without_a_handoff() -> None:
    engine = SyntheticEngine(SyntheticConfig(output_tokens=0))
    (output,) = await run(engine, GenerationRequest("c", PROMPT, SamplingParams(max_tokens=9),
                                                    phase=Phase.CONTEXT_ONLY))
    assert output.finish_reason == "stop"
    assert output.handoff_state is None


async def test_abort_ends_a_running_request() -> None:
    engine = SyntheticEngine()
    outputs = engine.generate(GenerationRequest("a", PROMPT, SamplingParams(max_tokens=1000)))
    await anext(outputs)
    await engine.abort("a")
    rest = [o async for o in outputs]
    assert rest[-1].finish_reason == "abort"
    assert len(rest) < 999
    await engine.abort("never-started")  # harmless


async def test_logprobs_and_prompt_logprobs() -> None:
    sampling = SamplingParams(max_tokens=2, logprobs=3, prompt_logprobs=0)
    outputs = await run(SyntheticEngine(), GenerationRequest("a", PROMPT, sampling))
    first = outputs[0]
    assert first.logprobs[0].token_id == SYNTHETIC_TEXT[0]
    assert len(first.logprobs[0].top) == 3
    assert first.prompt_logprobs is not None
    assert len(first.prompt_logprobs) == PROMPT.size
    assert first.prompt_logprobs[0] is None


async def test_the_synthetic_engine_never_reads_prompt_values_unless_asked() -> None:
    request = GenerationRequest("a", PROMPT, SamplingParams(max_tokens=5))
    await run(SyntheticEngine(), request)
    assert request.prompt_list_built is False


def test_engine_info() -> None:
    info = SyntheticEngine(SyntheticConfig(model="m", vocab_size=1000, max_context=77)).info
    assert (info.engine, info.model, info.vocab_size, info.max_context) == ("synthetic", "m", 1000, 77)
    assert info.kv_block_reuse is False
    assert info.prompt_tokens_in_handoff is False
