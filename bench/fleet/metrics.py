"""What a fleet's processes say of a run, read from their /metrics: each worker's prefix-cache and prefill
counters, and the orchestrator's routing decisions and prefill placements."""

from __future__ import annotations

import contextlib
from typing import Any

from bench.driver.common import http_get


def metric_samples(url: str) -> dict[str, float]:
    """A /metrics page as ``name{labels}`` -> value (sample lines only)."""
    status, body = http_get(url, "/metrics", timeout_s=10.0)
    if status != 200:
        raise RuntimeError(f"{url}/metrics answered {status}")
    samples: dict[str, float] = {}
    for line in body.decode().splitlines():
        if not line or line.startswith("#"):
            continue
        name, _, value = line.rpartition(" ")
        with contextlib.suppress(ValueError):
            samples[name] = float(value)
    return samples


_ENGINE_COUNTERS = {"queried": "disagg_engine_prefix_cache_queried_tokens_total",
                    "hit": "disagg_engine_prefix_cache_hit_tokens_total",
                    "prefills": "disagg_engine_prefills_total",
                    "busy_s": "disagg_engine_prefill_busy_seconds_total"}


def worker_counters(url: str) -> dict[str, float]:
    samples = metric_samples(url)
    return {key: samples.get(name, 0.0) for key, name in _ENGINE_COUNTERS.items()}


def _label(name: str, label: str) -> str | None:
    marker = f'{label}="'
    return name.split(marker, 1)[1].split('"', 1)[0] if marker in name else None


def orchestrator_counters(url: str) -> dict[str, Any]:
    """What the orchestrator says of the run, where it says it: its CTX pool's routing decisions, where prompts
    were prefilled, and the requests that skipped CTX (a prefill on GEN alone)."""
    samples = metric_samples(url)
    decisions: dict[str, float] = {}
    placements: dict[str, float] = {}
    for name, value in samples.items():
        if name.startswith("disagg_routing_decisions_total{") and _label(name, "pool") == "ctx":
            decisions[_label(name, "decision") or "?"] = value
        elif name.startswith("disagg_prefill_placement_total{"):
            placements[_label(name, "placement") or "?"] = value
    if placements:
        skipped: float | None = sum(v for k, v in placements.items() if k != "ctx")
    else:
        skipped = samples.get("disagg_local_prefill_requests_total")
    return {"skipped_ctx": skipped, "prefill_placement": placements,
            "ctx_finished": samples.get("disagg_ctx_finished_requests_total"), "routing_decisions": decisions}
