"""bench.vllm_serving's measurements that need no vLLM: GEN's parse path in this process, the prompts."""

from __future__ import annotations

import math
from typing import Any

from bench.driver.bodies import gen_body, random_tokens
from bench.vllm_serving import measure as vllm_serving_measure

TINY = vllm_serving_measure.Settings(prompts=(160,), runs=1, max_tokens=4, cost_requests=2, gen_cpu_rounds=1,
                                     gen_cpu_batch=1, inprocess_runs=1, inprocess_ops=1)


def _positive(value: Any) -> bool:
    return isinstance(value, int | float) and math.isfinite(value) and value > 0


def test_list_and_array_gen_bodies_give_vllm_the_same_prompt() -> None:
    tokens = random_tokens(512)
    bodies = {kind: gen_body(tokens, kind, max_tokens=2) for kind in ("list", "array")}
    timing = vllm_serving_measure.gen_prompt_path_in_process(bodies, TINY)
    assert set(timing) == {"list", "array", "tolist"}
    assert all(_positive(t["us"]) for t in timing.values())


def test_prompts_are_distinct_and_of_the_asked_length() -> None:
    first, second = vllm_serving_measure.prompt_words(160, seed=1), vllm_serving_measure.prompt_words(160, seed=2)
    assert first != second and len(first.split()) == len(second.split()) == 160
