"""What a ``disagg-serve bench`` run measured: the summary, the final table, the live progress line."""

from __future__ import annotations

import sys
import time
from collections import Counter
from collections.abc import Sequence
from itertools import pairwise
from typing import Any, TextIO

from entrypoints.bench.load import Record
from entrypoints.bench.statistics import summarize


def summary(records: Sequence[Record], duration_s: float) -> dict[str, Any]:
    """Throughput over the whole run; latencies of the requests that succeeded; failures by kind."""
    ok = [r for r in records if r.ok and r.ended is not None]
    span = max(duration_s, 1e-9)
    itl = [(b - a) * 1e3 for r in ok for a, b in pairwise(r.token_times)]
    output_tokens = sum(r.output_tokens or 0 for r in ok)
    prompt_tokens = [r.prompt_tokens for r in ok if r.prompt_tokens is not None]
    return {
        "requests": len(records),
        "ok": len(ok),
        "errors": dict(Counter(r.error_kind or "unknown" for r in records if not r.ok)),
        "error_samples": sorted({r.error for r in records if r.error})[:5],
        "duration_s": duration_s,
        "requests_per_s": len(ok) / span,
        "output_tokens": output_tokens,
        "output_tokens_per_s": output_tokens / span,
        "mean_prompt_tokens": sum(prompt_tokens) / len(prompt_tokens) if prompt_tokens else None,
        "ttft_ms": summarize([(r.first - r.started) * 1e3 for r in ok if r.first is not None]),
        "itl_ms": summarize(itl),
        "e2e_ms": summarize([(r.ended - r.started) * 1e3 for r in ok if r.ended is not None]),
    }


def per_request(records: Sequence[Record], origin: float) -> list[dict[str, Any]]:
    """Each request's own figures (ms, from the run's start), for the JSON file and the plot."""
    rows = []
    for r in records:
        times = r.token_times
        rows.append({
            "start_ms": (r.started - origin) * 1e3,
            "ok": r.ok,
            "error_kind": r.error_kind,
            "ttft_ms": (r.first - r.started) * 1e3 if r.ok and r.first is not None else None,
            "e2e_ms": (r.ended - r.started) * 1e3 if r.ended is not None else None,
            "itl_ms": [round((b - a) * 1e3, 3) for a, b in pairwise(times)],
            "output_tokens": r.output_tokens,
            "prompt_tokens": r.prompt_tokens,
        })
    return rows


def table(result: dict[str, Any]) -> str:
    def ms(value: float | None) -> str:
        return "-" if value is None or value != value else f"{value:,.1f}"

    lines = [
        f"requests        {result['ok']} ok of {result['requests']} in {result['duration_s']:.2f} s",
        f"throughput      {result['requests_per_s']:.2f} req/s, {result['output_tokens_per_s']:,.1f} output tok/s",
    ]
    if result.get("mean_prompt_tokens") is not None:
        lines.append(f"prompt tokens   {result['mean_prompt_tokens']:,.1f} on average (as the server counted)")
    lines += ["", f"{'latency (ms)':<16}{'p50':>10}{'p90':>10}{'p99':>10}{'mean':>10}{'n':>8}"]
    for label, key in (("TTFT", "ttft_ms"), ("ITL", "itl_ms"), ("end-to-end", "e2e_ms")):
        s = result[key]
        lines.append(f"{label:<16}{ms(s['p50']):>10}{ms(s['p90']):>10}{ms(s['p99']):>10}{ms(s['mean']):>10}"
                     f"{s['n']:>8}")
    lines += ["", "errors          " + (", ".join(f"{kind}: {n}" for kind, n in sorted(result["errors"].items()))
                                       or "none")]
    return "\n".join(lines)


class Progress:
    """A live progress bar on a terminal (redrawn in place), one line per tenth of the run elsewhere (logs)."""

    def __init__(self, total: int, stream: TextIO | None = None, width: int = 30) -> None:
        self.total = total
        self.stream = stream or sys.stderr
        self.width = width
        self.started = time.perf_counter()
        self.done = 0
        self.failed = 0
        self.live = self.stream.isatty()
        self._next_line = 0

    def update(self, record: Record) -> None:
        self.done += 1
        self.failed += not record.ok
        if self.live:
            self._draw("\r", "")
        elif self.done * 10 >= self._next_line * self.total:
            self._next_line = self.done * 10 // self.total + 1
            self._draw("", "\n")

    def close(self) -> None:
        if self.live:
            self.stream.write("\n")
            self.stream.flush()

    def _draw(self, before: str, after: str) -> None:
        elapsed = time.perf_counter() - self.started
        filled = self.width * self.done // max(self.total, 1)
        self.stream.write(f"{before}[{'#' * filled}{'.' * (self.width - filled)}] {self.done}/{self.total} "
                          f"{self.done / max(elapsed, 1e-9):.1f} req/s, {self.failed} errors, {elapsed:.1f} s"
                          f"{after}")
        self.stream.flush()
