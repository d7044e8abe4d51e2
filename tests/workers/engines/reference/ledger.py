"""The KV hand-off ledger, read the way an operator reads it: ``GET /v1/disagg/handoffs`` with the admin key.

``assert_ledger_balances`` is what every fault and cancellation test on the reference engine ends with: nothing
parked, no parked bytes (the endpoint and the ``disagg_kv_store_bytes`` gauge), and every hand-off ever parked
accounted for as taken, released or expired.
"""

from __future__ import annotations

from typing import Any

import httpx

from tests.waiting import eventually

ADMIN_KEY = "test-admin-key"  # every reference-engine test worker is started with it


def handoff_ledger(worker_url: str, admin_key: str = ADMIN_KEY) -> dict[str, Any]:
    reply = httpx.get(worker_url + "/v1/disagg/handoffs", headers={"Authorization": f"Bearer {admin_key}"},
                      timeout=60)
    assert reply.status_code == 200, reply.text
    ledger: dict[str, Any] = reply.json()
    return ledger


def parked_bytes_gauge(worker_url: str) -> float:
    text = httpx.get(worker_url + "/metrics", timeout=10).text
    line = next(line for line in text.splitlines() if line.startswith("disagg_kv_store_bytes "))
    return float(line.split()[1])


def _balances(ledger: dict[str, Any]) -> bool:
    totals = ledger["totals"]
    return (not ledger["parked_now"] and ledger["parked_bytes"] == 0
            and totals["parked"] == totals["taken"] + totals["released"] + totals["expired"])


def assert_ledger_balances(worker_url: str, admin_key: str = ADMIN_KEY) -> dict[str, Any]:
    """Wait until the CTX worker's ledger balances (releases travel asynchronously), then return it."""
    assert eventually(lambda: _balances(handoff_ledger(worker_url, admin_key))
                      and parked_bytes_gauge(worker_url) == 0, every_s=0.05), handoff_ledger(worker_url, admin_key)
    return handoff_ledger(worker_url, admin_key)
