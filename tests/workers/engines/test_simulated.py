"""The simulated engine: prefill time from what its prefix cache misses, one prefill at a time, LRU blocks, the
hand-off, abort. Times are asserted on the engine's own counters (simulated seconds), never on the wall clock,
except as lower bounds that a sleep cannot undercut."""

from __future__ import annotations

import asyncio
import time

import numpy as np
import orjson
import pytest

from frontend.errors import HandoffError
from frontend.sampling import SamplingParams
from frontend.token_codec import TOKEN_DTYPE, TokenArray
from workers.engines.base import ExposesMetrics, ReportsKvCapacity
from workers.engines.factory import EngineOptions, create_engine
from workers.engines.outputs import EngineOutput
from workers.engines.request import GenerationRequest, Handoff, Phase
from workers.engines.simulated import BLOCK_TOKENS, SimulatedConfig, SimulatedEngine
from workers.engines.synthetic import EOS_TOKEN_ID, SYNTHETIC_TEXT

RATE = 100_000.0  # tokens per second: a 1,000-token miss costs 10 ms
BASE = 0.001


def engine(cache_tokens: int = 65_536, rate: float = RATE, base: float = BASE) -> SimulatedEngine:
    return SimulatedEngine(SimulatedConfig(prefill_base_s=base, prefill_tokens_per_s=rate,
                                           prefix_cache_tokens=cache_tokens, inter_token_latency_s=0.0))


def prompt(length: int, seed: int) -> TokenArray:
    return np.random.default_rng(seed).integers(0, 50_000, length).astype(TOKEN_DTYPE)


def request(request_id: str, tokens: TokenArray, max_tokens: int = 4, phase: Phase = Phase.AGGREGATED,
            handoff: Handoff | None = None) -> GenerationRequest:
    return GenerationRequest(request_id, tokens, SamplingParams(max_tokens=max_tokens), phase=phase, handoff=handoff)


async def run(e: SimulatedEngine, r: GenerationRequest) -> list[EngineOutput]:
    return [output async for output in e.generate(r)]


def text(outputs: list[EngineOutput]) -> list[int]:
    return [t for o in outputs for t in o.token_ids]


async def test_a_cache_hit_cuts_the_prefill_to_the_uncached_tokens() -> None:
    e = engine()
    tokens = prompt(1_000, 1)
    first = await run(e, request("a", tokens))
    cold = e.stats()
    assert (cold.prefills, cold.queried_tokens, cold.hit_tokens) == (1, 1_000, 0)
    assert cold.busy_prefill_s == pytest.approx(BASE + 1_000 / RATE)
    assert first[0].cached_tokens == 0
    second = await run(e, request("b", tokens))
    warm = e.stats()
    hit = (999 // BLOCK_TOKENS) * BLOCK_TOKENS  # 992: the last token is always computed
    assert warm.hit_tokens == hit and second[0].cached_tokens == hit
    assert warm.busy_prefill_s - cold.busy_prefill_s == pytest.approx(BASE + (1_000 - hit) / RATE)
    assert text(first) == text(second) == list(SYNTHETIC_TEXT[:4])


async def test_only_a_shared_prefix_hits_and_the_last_token_is_always_prefilled() -> None:
    e = engine()
    tokens = prompt(32, 2)
    await run(e, request("a", tokens))
    await run(e, request("b", tokens))  # 32 tokens: 2 blocks held, only the first usable (token 32 is computed)
    assert e.stats().hit_tokens == BLOCK_TOKENS
    changed = tokens.copy()
    changed[0] += 1  # the first block differs: no later block can match either (keys chain the prefix)
    await run(e, request("c", changed))
    assert e.stats().hit_tokens == BLOCK_TOKENS


async def test_the_cache_is_bounded_and_evicts_the_least_recently_used() -> None:
    e = engine(cache_tokens=8 * BLOCK_TOKENS)
    a, b, c = (prompt(4 * BLOCK_TOKENS + 1, seed) for seed in (10, 11, 12))  # 4 full blocks each
    await run(e, request("a", a))
    await run(e, request("b", b))
    assert e.stats().cached_tokens == 8 * BLOCK_TOKENS
    await run(e, request("a2", a))  # a is now the more recent
    await run(e, request("c", c))  # evicts b, not a
    assert e.stats().cached_tokens == 8 * BLOCK_TOKENS
    hits = e.stats().hit_tokens
    await run(e, request("a3", a))
    assert e.stats().hit_tokens - hits == 4 * BLOCK_TOKENS
    hits = e.stats().hit_tokens
    await run(e, request("b2", b))
    assert e.stats().hit_tokens - hits == 0


async def test_eviction_takes_a_prompt_s_tail_before_its_head() -> None:
    e = engine(cache_tokens=6 * BLOCK_TOKENS)
    a, b = prompt(4 * BLOCK_TOKENS + 1, 20), prompt(4 * BLOCK_TOKENS + 1, 21)
    await run(e, request("a", a))
    await run(e, request("b", b))  # 8 blocks > 6: a's last two go, its first two stay usable
    hits = e.stats().hit_tokens
    await run(e, request("a2", a))
    assert e.stats().hit_tokens - hits == 2 * BLOCK_TOKENS


async def test_no_cache_means_no_reuse_and_says_so() -> None:
    e = engine(cache_tokens=0)
    tokens = prompt(200, 3)
    await run(e, request("a", tokens))
    await run(e, request("b", tokens))
    assert e.stats().hit_tokens == 0
    assert e.kv_capacity_tokens() == 0 and e.info.kv_block_reuse is False


async def test_one_prefill_at_a_time_first_come_first_served() -> None:
    e = engine(rate=10_000.0, base=0.0)  # 500 tokens: 50 ms each
    order: list[str] = []

    async def one(name: str, seed: int) -> None:
        async for output in e.generate(request(name, prompt(500, seed), max_tokens=1)):
            if output.token_ids:
                order.append(name)

    started = time.monotonic()
    await asyncio.gather(*(one(f"r{i}", 30 + i) for i in range(3)))
    elapsed = time.monotonic() - started
    assert order == ["r0", "r1", "r2"]
    stats = e.stats()
    assert stats.peak_concurrent_prefills == 1
    assert stats.busy_prefill_s == pytest.approx(0.15)
    assert elapsed >= 0.15  # three 50 ms prefills one after another: never less


async def test_decode_runs_for_every_sequence_at_once() -> None:
    """Batched decode: the four sequences' tokens arrive in turns (each step of each sequence is one latency after
    its last), never one sequence's run after another's. Judged by the order tokens arrive in, which equal timers
    keep however slow the machine is, not by a clock."""
    e = SimulatedEngine(SimulatedConfig(prefill_base_s=0.0, prefill_tokens_per_s=1e9, inter_token_latency_s=0.02))
    arrivals: list[str] = []

    async def one(name: str, seed: int) -> list[EngineOutput]:
        outputs = []
        async for output in e.generate(request(name, prompt(20, seed), max_tokens=6)):
            arrivals.extend(name for _ in output.token_ids)
            outputs.append(output)
        return outputs

    outputs = await asyncio.gather(*(one(f"d{i}", 40 + i) for i in range(4)))
    assert all(len(text(o)) == 6 for o in outputs)
    last_first = max(arrivals.index(f"d{i}") for i in range(4))
    first_done = min(len(arrivals) - 1 - arrivals[::-1].index(f"d{i}") for i in range(4))
    assert last_first < first_done  # every sequence had started before any had finished
    assert len({arrivals[i] for i in range(4, 8)}) == 4  # and each step went round all four


async def test_a_handoff_continues_the_text_and_gen_then_holds_the_prompt() -> None:
    ctx, gen = engine(), engine()
    tokens = prompt(640, 4)
    (first,) = await run(ctx, request("c", tokens, max_tokens=9, phase=Phase.CONTEXT_ONLY))
    assert first.handoff_state is not None and first.finish_reason is None
    assert orjson.loads(first.handoff_state) == {"engine": "simulated", "prompt_len": 640, "position": 1}
    rest = await run(gen, request("g", tokens, max_tokens=9, phase=Phase.GENERATION_ONLY,
                                  handoff=Handoff(first.token_ids, first.handoff_state)))
    assert list(first.token_ids) + text(rest) == list(SYNTHETIC_TEXT[:9])
    assert gen.stats().prefills == 0 and gen.stats().handoff_inserted_tokens == 640
    aggregated = await run(gen, request("a", tokens, max_tokens=9))  # GEN prefills it itself: a hit
    assert gen.stats().hit_tokens == (639 // BLOCK_TOKENS) * BLOCK_TOKENS
    assert text(aggregated) == list(first.token_ids) + text(rest)


@pytest.mark.parametrize("state", [b"not json", b'{"engine": "synthetic", "prompt_len": 10, "position": 1}',
                                   b'{"engine": "simulated", "prompt_len": 11, "position": 1}'])
async def test_an_unusable_handoff_is_a_handoff_error(state: bytes) -> None:
    with pytest.raises(HandoffError):
        await run(engine(), request("g", prompt(10, 5), phase=Phase.GENERATION_ONLY, handoff=Handoff((1,), state)))


async def test_abort_while_queued_while_prefilling_and_while_decoding() -> None:
    e = SimulatedEngine(SimulatedConfig(prefill_base_s=0.0, prefill_tokens_per_s=1_000.0,
                                        inter_token_latency_s=0.01))
    long_prompt = prompt(2_000, 6)  # 2 s of prefill unless aborted
    running = asyncio.ensure_future(run(e, request("running", long_prompt)))
    queued = asyncio.ensure_future(run(e, request("queued", prompt(100, 7))))
    await asyncio.sleep(0.05)
    await e.abort("queued")
    await e.abort("running")
    assert (await running)[-1].finish_reason == "abort"
    assert (await queued)[-1].finish_reason == "abort"
    stats = e.stats()
    assert stats.prefills == 1 and stats.busy_prefill_s < 1.0  # the queued one never ran; the other stopped early
    assert stats.cached_tokens == 0  # an unfinished prefill leaves nothing in the cache
    decoding = e.generate(request("decoding", prompt(10, 8), max_tokens=1_000))
    seen = [await anext(decoding), await anext(decoding)]
    await e.abort("decoding")
    seen += [output async for output in decoding]
    assert seen[-1].finish_reason == "abort" and len(seen) < 100
    await e.abort("unknown")  # nothing running under that id: nothing happens


async def test_counters_are_on_metrics_and_the_capabilities_are_discoverable() -> None:
    e = create_engine("simulated", EngineOptions(served_model_name="sim",
                                                 simulated=SimulatedConfig(prefix_cache_tokens=4_096)))
    assert isinstance(e, SimulatedEngine) and e.info.model == "sim" and e.info.kv_block_reuse
    assert isinstance(e, ReportsKvCapacity) and isinstance(e, ExposesMetrics)
    assert e.kv_capacity_tokens() == 4_096
    tokens = prompt(100, 9)
    await run(e, request("a", tokens))
    await run(e, request("b", tokens))
    exposition = e.metrics_text().decode()
    samples = {line.split()[0]: float(line.split()[1]) for line in exposition.splitlines()
               if line and not line.startswith("#")}
    assert samples["disagg_engine_prefix_cache_queried_tokens_total"] == 200
    assert samples["disagg_engine_prefix_cache_hit_tokens_total"] == 96
    assert samples["disagg_engine_prefills_total"] == 2
    assert samples["disagg_engine_prefix_cache_capacity_tokens"] == 4_096
    assert samples["disagg_engine_prefill_busy_seconds_total"] > 0


def test_a_reference_tokenizer_worker_counts_real_tokens_and_a_follow_up_hits_its_cache() -> None:
    from tests.workers.engines.test_synthetic import CHAT, reference_count, serve_chats

    first_turn = CHAT[:2]
    first, follow_up = serve_chats("simulated", [first_turn, CHAT], 6)
    assert first["usage"]["prompt_tokens"] == reference_count(first_turn)
    assert follow_up["usage"]["prompt_tokens"] == reference_count(CHAT)
    assert first["choices"][0]["message"]["content"] == "The quick brown fox jumps over"  # 6 BPE tokens
    # The follow-up's prompt starts with the first one's ids (the template renders earlier turns alike): the
    # engine's cache, keyed by those ids, holds its whole blocks.
    held = (first["usage"]["prompt_tokens"] - 1) // BLOCK_TOKENS * BLOCK_TOKENS
    assert follow_up["usage"]["prompt_tokens_details"]["cached_tokens"] == held > 0


async def test_a_stream_continued_after_its_eos_ends_at_once() -> None:
    # The continuation of a stream that broke after its EOS reached the client: it ends there, not past it.
    ctx, gen = (SimulatedEngine(SimulatedConfig(prefill_base_s=BASE, prefill_tokens_per_s=RATE,
                                                inter_token_latency_s=0.0, output_tokens=3)) for _ in range(2))
    tokens = prompt(64, 5)
    (first,) = await run(ctx, request("c", tokens, max_tokens=9, phase=Phase.CONTEXT_ONLY))
    assert first.handoff_state is not None
    handed = (*SYNTHETIC_TEXT[:3], EOS_TOKEN_ID)
    rest = await run(gen, request("g", tokens, max_tokens=9, phase=Phase.GENERATION_ONLY,
                                  handoff=Handoff(handed, first.handoff_state)))
    assert text(rest) == [] and [o.finish_reason for o in rest] == ["stop"]
