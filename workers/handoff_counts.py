"""The worker's own Prometheus series for what its engine counts: exported at 0 from start-up, then brought up to
the engine's running totals at each scrape."""

from __future__ import annotations

from collections.abc import Mapping

from frontend.metrics import CounterFeed, Metrics
from workers.engines.base import HANDOFF_TOTALS, Engine, KVHandoffStore
from workers.engines.request import PromptPath
from workers.settings import Role


def export_known_series(metrics: Metrics, engine: Engine, role: Role) -> None:
    """Create the child of every label combination this worker can count, so each series is exported at 0 from
    start-up: left to its first event, a fresh worker's hand-off ledger and GEN prompt paths are absent, and a
    dashboard shows "No data" where the truth is "none so far"."""
    if isinstance(engine, KVHandoffStore):  # only a store that parks hand-offs counts how they leave it
        for outcome in HANDOFF_TOTALS:
            metrics.kv_handoffs.labels(outcome=outcome)
    if role != "context":  # the roles that take generation_only requests, the ones counted by prompt path
        for path in PromptPath:
            metrics.gen_prompt_path.labels(path=path.value)


class LedgerCounts:
    """Moves the engine's running totals into the Prometheus counters: each scrape adds what is new. A restarted
    engine core starts its totals again from zero; what it counts then is new too."""

    def __init__(self, metrics: Metrics) -> None:
        self.metrics = metrics
        self._feed = CounterFeed()

    def bring_up_to(self, totals: Mapping[str, int]) -> None:
        for outcome, total in totals.items():
            self._feed.add(self.metrics.kv_handoffs.labels(outcome=outcome), outcome, total)
