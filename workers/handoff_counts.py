"""The worker's own Prometheus series for what its engine counts: exported at 0 from start-up, then brought up to
the engine's running totals at each scrape; the hand-offs of an engine that keeps no store of them, counted as the
worker sees them; and the head of a GEN answer that says what of its prompt came through the hand-off."""

from __future__ import annotations

from collections.abc import Mapping

from frontend.metrics import CounterFeed, Metrics
from frontend.prompt_report import PROMPT_TOKENS_HEADER, PromptReport
from workers.engines.base import HANDOFF_TOTALS, Engine, KVHandoffStore
from workers.engines.request import PromptPath
from workers.prepared_generation import PreparedGeneration
from workers.settings import Role


def export_known_series(metrics: Metrics, engine: Engine, role: Role) -> None:
    """Create the child of every label combination this worker can count, so each series is exported at 0 from
    start-up: left to its first event, a fresh worker's hand-off ledger and GEN prompt paths are absent, and a
    dashboard shows "No data" where the truth is "none so far"."""
    if isinstance(engine, KVHandoffStore) or role != "generation":  # a CTX hands off, with a store or without
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


class StorelessHandoffs:
    """The ledger of an engine that hands off but parks nothing in a store of ours (synthetic and simulated: their
    hand-off carries all GEN needs; vLLM: its KV connector holds the KV), as the worker sees it: a CTX answer that
    hands off counts ``parked``, a GEN that accepts a hand-off counts ``taken``, the orchestrator's release of one no
    GEN will take counts ``released``; nothing is held, so nothing expires. Summed over CTX and GEN workers (as the
    dashboard does) it is the same ledger a store keeps. An engine with a store (``KVHandoffStore``) keeps its own:
    nothing is counted here then, so no hand-off counts twice."""

    def __init__(self, metrics: Metrics, engine: Engine) -> None:
        self.counts = not isinstance(engine, KVHandoffStore)
        self.metrics = metrics

    def parked(self) -> None:
        if self.counts:
            self.metrics.kv_handoffs.labels(outcome="parked").inc()

    def taken(self) -> None:
        if self.counts:
            self.metrics.kv_handoffs.labels(outcome="taken").inc()

    def released(self) -> None:
        if self.counts:
            self.metrics.kv_handoffs.labels(outcome="released").inc()


def prompt_report_headers(prepared: PreparedGeneration) -> dict[str, str]:
    """A GEN answer's head: how many prompt tokens came through the hand-off and how many its engine computed
    itself (``frontend.prompt_report``); nothing for any other answer."""
    computed = prepared.recomputed_tokens
    if computed is None:
        return {}
    report = PromptReport(max(0, prepared.request.prompt_len - computed), computed)
    return {PROMPT_TOKENS_HEADER: report.header_value()}
