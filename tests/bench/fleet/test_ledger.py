"""The fleet's oracle: what any cache of the fleet could have hit, recorded from the simulated engines' prefills."""

from __future__ import annotations

import pytest

from bench.fleet.ledger import FleetLedger, record_every_prefill
from tests.workers.engines.test_simulated import engine, prompt, request, run
from workers.engines import simulated


async def test_the_fleet_ledger_counts_what_any_cache_could_have_hit(monkeypatch: pytest.MonkeyPatch) -> None:
    ledger = FleetLedger()
    monkeypatch.setattr(simulated, "_PREFILL_OBSERVER", ledger.record)
    one, two = engine(), engine()
    tokens = prompt(320, 11)
    await run(one, request("a", tokens))
    await run(two, request("b", tokens))  # a miss on this worker, a prefix the fleet had prefilled
    assert two.stats().hit_tokens == 0
    assert ledger.snapshot() == {"prefills": 2, "queried_tokens": 640, "reachable_tokens": 304, "blocks": 20}
    assert one.stats().hit_tokens + two.stats().hit_tokens <= ledger.reachable_tokens


def test_record_every_prefill_puts_a_ledger_behind_every_engine(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(simulated, "_PREFILL_OBSERVER", None)
    ledger = record_every_prefill()
    assert ledger.record == simulated._PREFILL_OBSERVER
