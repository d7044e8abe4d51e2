"""What the orchestrator makes of each GEN answer's prompt report: a counter per GEN worker, and one log line per
worker per minute however many answers recomputed (the clock is the watch's own, so no test waits on time)."""

from __future__ import annotations

import logging

import pytest

from frontend.metrics import Metrics
from frontend.prompt_report import PromptReport
from orchestrator.recompute_watch import RecomputeWatch
from tests.cluster import sample

GEN_A, GEN_B, CTX = "http://gen-a:8000", "http://gen-b:8000", "http://ctx:8000"


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def header(received: int, computed: int) -> bytes:
    return PromptReport(received, computed).header_value().encode()


def recomputed(metrics: Metrics, worker: str) -> float:
    return sample(metrics, "disagg_gen_prompt_tokens_recomputed_total", pool="gen", worker=worker)


def test_tokens_a_gen_computed_itself_are_counted_per_worker() -> None:
    metrics = Metrics()
    watch = RecomputeWatch(metrics, "gen", clock=Clock())
    assert watch.saw(GEN_A, 200, header(100, 0), CTX) == PromptReport(100, 0)
    assert watch.saw(GEN_A, 200, header(0, 100), CTX) == PromptReport(0, 100)
    watch.saw(GEN_A, 200, header(60, 40), CTX)
    watch.saw(GEN_B, 200, header(0, 7), CTX)
    assert recomputed(metrics, GEN_A) == 140 and recomputed(metrics, GEN_B) == 7


def test_error_answers_and_answers_without_a_report_count_nothing() -> None:
    metrics = Metrics()
    watch = RecomputeWatch(metrics, "gen", clock=Clock())
    assert watch.saw(GEN_A, 502, header(0, 100), CTX) is None  # an error answer is no account of a prompt
    assert watch.saw(GEN_A, 200, None, CTX) is None  # a worker of another make says nothing
    assert watch.saw(GEN_A, 200, b"garbage", CTX) is None
    assert recomputed(metrics, GEN_A) == 0


def test_the_first_case_of_each_worker_is_logged_once_a_minute(caplog: pytest.LogCaptureFixture) -> None:
    clock = Clock()
    watch = RecomputeWatch(Metrics(), "gen", clock=clock)

    def lines() -> list[str]:
        return [r.getMessage() for r in caplog.records if r.name == "disagg_serve.recompute"]

    with caplog.at_level(logging.WARNING, logger="disagg_serve.recompute"):
        watch.saw(GEN_A, 200, header(0, 64), CTX)
        assert len(lines()) == 1 and GEN_A in lines()[0] and CTX in lines()[0] and "64 of 64" in lines()[0]
        for _ in range(5):
            clock.now += 10
            watch.saw(GEN_A, 200, header(0, 64), CTX)
        watch.saw(GEN_B, 200, header(32, 32), CTX)  # another worker's first case is its own line
        assert len(lines()) == 2 and GEN_B in lines()[1]
        clock.now += 10  # a minute after GEN_A's line
        watch.saw(GEN_A, 200, header(0, 64), CTX)
        assert len(lines()) == 3
        assert "5 more such answers since its last line" in lines()[2]
