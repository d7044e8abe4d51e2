"""KV that never moved, seen: each GEN answer's account of its prompt (``frontend.prompt_report``), counted.

A GEN whose KV transfer failed, or whose connector is misconfigured, may prefill the whole prompt again and still
answer correctly: only slower, at twice the cost, and silently. Every GEN answer of ours says in its head how many
prompt tokens its engine computed itself; the orchestrator adds them to
``disagg_gen_prompt_tokens_recomputed_total{pool,worker}`` and logs the first case of each worker in a minute (with
how many it did not log since), so a fleet doing this all day writes one line a minute per worker, not one a request.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

from frontend.metrics import LabelledChildren, Metrics
from frontend.prompt_report import PromptReport, read_prompt_report

logger = logging.getLogger("disagg_serve.recompute")

LOG_EVERY_S = 60.0


@dataclass(slots=True)
class _Logged:
    at: float
    unlogged: int = 0  # cases since that line


class RecomputeWatch:
    def __init__(self, metrics: Metrics, pool: str, clock: Callable[[], float] = time.monotonic,
                 log_every_s: float = LOG_EVERY_S) -> None:
        self.pool = pool
        self.recomputed = LabelledChildren(metrics.gen_prompt_recomputed)
        self.clock = clock
        self.log_every_s = log_every_s
        self._logged: dict[str, _Logged] = {}

    def saw(self, gen_worker: str, status_code: int, header: bytes | None,
            ctx_worker: str | None = None) -> PromptReport | None:
        """What GEN ``gen_worker`` said of its prompt in an answer's head (None: an error answer, or a worker that
        says nothing); what it computed itself is counted, and logged as above."""
        if status_code != 200:
            return None
        report = read_prompt_report(header)
        if report is None or not report.computed:
            return report
        self.recomputed(self.pool, gen_worker).inc(report.computed)
        now = self.clock()
        logged = self._logged.get(gen_worker)
        if logged is not None and now - logged.at < self.log_every_s:
            logged.unlogged += 1
            return report
        since = f"; {logged.unlogged} more such answers since its last line" if logged and logged.unlogged else ""
        logger.warning("GEN worker %s computed %d of %d prompt tokens itself: their KV did not come from CTX %s "
                       "(a failed or misconfigured KV transfer; the answer is right, its prefill paid twice)%s",
                       gen_worker, report.computed, report.received + report.computed, ctx_worker or "(unknown)",
                       since)
        self._logged[gen_worker] = _Logged(now)
        return report
