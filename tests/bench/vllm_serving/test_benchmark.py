"""Smoke run of ``bench.vllm_serving`` at a tiny size on real vLLM processes (skipped, with the reason, where vLLM
is not installed); its in-process and reporting parts, which need no vLLM, are tested beside their modules. Only
that the benchmark runs end to end and returns well-formed results is asserted; the figures come from
``python -m bench.vllm_serving``."""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import pytest

from bench.peers.vllm_processes import vllm_missing_reason
from bench.vllm_serving import benchmark as vllm_serving
from bench.vllm_serving import measure as vllm_serving_measure
from bench.vllm_serving import report as vllm_serving_report

TINY = vllm_serving_measure.Settings(prompts=(160,), runs=1, max_tokens=4, cost_requests=2, gen_cpu_rounds=1,
                                     gen_cpu_batch=1, inprocess_runs=1, inprocess_ops=1)


def _positive(value: Any) -> bool:
    return isinstance(value, int | float) and math.isfinite(value) and value > 0


@pytest.mark.skipif(vllm_missing_reason() is not None, reason=vllm_missing_reason() or "")
def test_the_disaggregated_phase_runs_on_real_vllm() -> None:
    # One phase, not four: each vLLM start costs ~50 s of CPU, and all four phases took 5.5 min here, past the
    # suite's budget. This one runs every measurement the benchmark has (latency, the orchestrator's CPU, GEN's CPU
    # on both paths); the other phases differ only in the command lines they start (tests/vllm runs those servers).
    result = vllm_serving.run(dataclasses.replace(TINY, setups=(vllm_serving_measure.DISAGGREGATED,)))
    assert list(result["phases"]) == [vllm_serving_measure.DISAGGREGATED]
    (found,) = result["phases"][vllm_serving_measure.DISAGGREGATED]["points"]
    assert found["prompt_tokens"] >= 128 and found["completion_tokens"] == TINY.max_tokens
    assert _positive(found["ttft_ms"]) and _positive(found["decode_tokens_per_s"])
    cost = result["phases"][vllm_serving_measure.DISAGGREGATED]["orchestrator_cpu"]
    assert cost["requests"] == TINY.cost_requests and cost["cpu_ms_per_request"] >= 0
    (gen,) = result["phases"][vllm_serving_measure.DISAGGREGATED]["gen_cpu"]
    assert all(gen["process"][kind]["requests"] == 1 and gen["process"][kind]["body_bytes"] > 0
               for kind in ("list", "array"))
    assert all(_positive(gen["in_process"][kind]["us"]) for kind in ("list", "array", "tolist"))
    assert f"| {vllm_serving_measure.DISAGGREGATED} |" in vllm_serving_report.tables(result)
