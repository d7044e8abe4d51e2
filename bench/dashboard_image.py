"""docs/images/dashboard.png: the Grafana dashboard's main panels from a real run, without Grafana or Prometheus.

    python -m bench.dashboard_image [--seconds 40] [--out docs/images/dashboard.png]

The system runs on the synthetic engine under ``disagg-serve bench``'s Poisson load (one rate, then four times
it); every process's ``/metrics`` is scraped each second, and the dashboard's own PromQL (from
deploy/grafana/disagg-serve.json, the few shapes it uses) is evaluated over the scrapes and drawn with matplotlib.
"""

from __future__ import annotations

import json
import math
import re
import sys
import tempfile
import threading
import time
from collections import defaultdict
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

from bench.driver.common import (
    PYTHON,
    REPO_ROOT,
    Processes,
    arguments,
    free_port,
    orchestrator_config,
    wait_healthy,
    worker_args,
)

DASHBOARD = REPO_ROOT / "deploy" / "grafana" / "disagg-serve.json"
MAIN_PANELS = ("Request rate by endpoint and status", "Errors by endpoint and status", "In flight per process",
               "Time to first token", "Inter-token latency", "End-to-end latency by endpoint",
               "Time in CTX per worker (p90)", "To GEN's first byte per worker (p90)", "Event-loop lag (p99)")
RATES = (2.0, 8.0)  # requests/s: a comfortable rate, then four times as many
ENGINE = ("--synthetic-ttft-ms", "40", "--synthetic-itl-ms", "10")
RATE_WINDOW_S = 10.0

Labels = tuple[tuple[str, str], ...]
Scrape = tuple[float, dict[tuple[str, Labels], float]]  # (time, {(sample name, labels): value})


# -- scraping ------------------------------------------------------------------------------------------------
class Scraper:
    def __init__(self, targets: dict[str, str], every_s: float = 1.0) -> None:
        self.targets = targets
        self.every_s = every_s
        self.scrapes: list[Scrape] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        with httpx.Client(timeout=5.0) as client:
            while not self._stop.is_set():
                now = time.monotonic()
                samples: dict[tuple[str, Labels], float] = {}
                for instance, url in self.targets.items():
                    try:
                        text = client.get(url + "/metrics").text
                    except httpx.HTTPError:
                        continue
                    for family in text_string_to_metric_families(text):
                        for sample in family.samples:
                            labels = tuple(sorted({**sample.labels, "instance": instance}.items()))
                            samples[(sample.name, labels)] = sample.value
                self.scrapes.append((now, samples))
                self._stop.wait(self.every_s)

    def __enter__(self) -> Scraper:
        self._thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self._stop.set()
        self._thread.join()


# -- the dashboard's PromQL, over the scrapes ----------------------------------------------------------------
_MATCHER = re.compile(r'(\w+)(=~|!~|!=|=)"([^"]*)"')
_QUANTILE = re.compile(r"histogram_quantile\(([\d.]+), sum by \(([^)]*)\) \(rate\((\w+)\{([^}]*)\}\[[^\]]+\]\)\)\)")
_RATE = re.compile(r"sum(?: by \(([^)]*)\))? \(rate\((\w+)\{([^}]*)\}\[[^\]]+\]\)\)")
_GAUGE = re.compile(r"sum by \(([^)]*)\) \((\w+)\{([^}]*)\}\)")


def _matches(labels: Labels, matchers: str) -> bool:
    values = dict(labels)
    for name, op, pattern in _MATCHER.findall(matchers):
        if pattern.startswith("$"):
            continue  # a dashboard variable: every value
        hit = re.fullmatch(pattern, values.get(name, "")) if "~" in op else values.get(name, "") == pattern
        if bool(hit) == op.startswith("!"):
            return False
    return True


def _grouped(samples: dict[tuple[str, Labels], float], metric: str, matchers: str,
             by: list[str]) -> dict[Labels, float]:
    groups: dict[Labels, float] = defaultdict(float)
    for (name, labels), value in samples.items():
        if name == metric and _matches(labels, matchers):
            values = dict(labels)
            groups[tuple((k, values.get(k, "")) for k in by)] += value
    return groups


def _rates(scrapes: list[Scrape], metric: str, matchers: str, by: list[str]) -> dict[Labels, list[tuple[float, float]]]:
    """``sum by (by) (rate(metric[10s]))`` at each scrape: counters summed per group, then differenced."""
    series: dict[Labels, list[tuple[float, float]]] = defaultdict(list)
    sums = [(t, _grouped(samples, metric, matchers, by)) for t, samples in scrapes]
    for index, (now, current) in enumerate(sums):
        before = next((s for s in reversed(sums[:index]) if now - s[0] >= RATE_WINDOW_S), None)
        if before is None:
            continue
        for group, value in current.items():
            series[group].append((now, max(0.0, value - before[1].get(group, 0.0)) / (now - before[0])))
    return series


def _quantile(q: float, buckets: list[tuple[float, float]]) -> float:
    """Prometheus's histogram_quantile: linear interpolation inside the bucket that holds the rank."""
    buckets = sorted(buckets)
    if not buckets or buckets[-1][1] <= 0:
        return math.nan
    rank = q * buckets[-1][1]
    lower_bound, lower_count = 0.0, 0.0
    for bound, count in buckets:
        if count >= rank:
            if math.isinf(bound):
                return lower_bound
            return lower_bound + (bound - lower_bound) * (rank - lower_count) / max(count - lower_count, 1e-12)
        lower_bound, lower_count = bound, count
    return math.nan


def evaluate(expr: str, scrapes: list[Scrape]) -> dict[Labels, list[tuple[float, float]]]:
    if found := _QUANTILE.fullmatch(expr):
        q, by, metric, matchers = float(found[1]), [b.strip() for b in found[2].split(",")], found[3], found[4]
        rates = _rates(scrapes, metric, matchers, by)
        others = [b for b in by if b != "le"]
        series: dict[Labels, list[tuple[float, float]]] = defaultdict(list)
        by_group: dict[Labels, dict[float, list[tuple[float, float]]]] = defaultdict(dict)
        for labels, points in rates.items():
            values = dict(labels)
            group = tuple((k, values[k]) for k in others)
            by_group[group][float(values["le"])] = points
        for group, per_bound in by_group.items():
            times = sorted({t for points in per_bound.values() for t, _ in points})
            for now in times:
                buckets = [(bound, dict(points).get(now, 0.0)) for bound, points in per_bound.items()]
                value = _quantile(q, buckets)
                if not math.isnan(value):
                    series[group].append((now, value))
        return series
    if found := _RATE.fullmatch(expr):
        by = [b.strip() for b in (found[1] or "").split(",") if b.strip()]
        return _rates(scrapes, found[2], found[3], by)
    if found := _GAUGE.fullmatch(expr):
        by = [b.strip() for b in found[1].split(",")]
        gauges: dict[Labels, list[tuple[float, float]]] = defaultdict(list)
        for now, samples in scrapes:
            for group, value in _grouped(samples, found[2], found[3], by).items():
                gauges[group].append((now, value))
        return gauges
    raise ValueError(f"a query shape this script does not evaluate: {expr}")


def _legend(template: str, labels: Labels) -> str:
    values = dict(labels)
    return re.sub(r"\{\{(\w+)\}\}", lambda m: values.get(m[1], ""), template).strip() or "value"


# -- the run and the picture ---------------------------------------------------------------------------------
def run(seconds: float, workdir: Path) -> list[Scrape]:
    ctx_port, gen_port, orch_port = free_port(), free_port(), free_port()
    with Processes(log_dir=workdir) as processes:
        ctx = processes.disagg_serve("ctx", worker_args("context", "synthetic", ctx_port, *ENGINE), ctx_port)
        gen = processes.disagg_serve("gen", worker_args("generation", "synthetic", gen_port, *ENGINE), gen_port)
        config = orchestrator_config(workdir / "orchestrator.yaml", orch_port, [ctx.url], [gen.url])
        orchestrator = processes.disagg_serve("orchestrator", ["orchestrator", "--config", str(config)], orch_port)
        wait_healthy([ctx, gen, orchestrator], timeout_s=300)
        targets = {f"orchestrator:{orch_port}": orchestrator.url, f"ctx:{ctx_port}": ctx.url,
                   f"gen:{gen_port}": gen.url}
        with Scraper(targets) as scraper:
            for rate in RATES:
                load = processes.spawn(f"bench-{rate}", [
                    PYTHON, "-m", "entrypoints.cli", "bench", "--url", orchestrator.url, "--endpoint", "chat",
                    "--prompt-tokens", "256", "--output-tokens", "16", "--request-rate", str(rate),
                    "--num-requests", str(int(rate * seconds))])
                load.process.wait(timeout=seconds * 20)
            time.sleep(2.0)  # two more scrapes after the last request: the panels' right edge
        return scraper.scrapes


def draw(scrapes: list[Scrape], out: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = {p["title"]: p for p in json.loads(DASHBOARD.read_text())["panels"] if p["type"] != "row"}
    origin = scrapes[0][0]
    figure, axes = plt.subplots(3, 3, figsize=(15, 10))
    for axis, title in zip(axes.flat, MAIN_PANELS, strict=True):
        panel = panels[title]
        unit = panel["fieldConfig"]["defaults"].get("unit")
        scale, suffix = (1e3, " (ms)") if unit == "s" else (1.0, "")
        for target in panel["targets"]:
            for labels, points in sorted(evaluate(target["expr"], scrapes).items()):
                if points:
                    axis.plot([t - origin for t, _ in points], [v * scale for _, v in points],
                              label=_legend(target["legendFormat"], labels), linewidth=1.2)
        axis.set_title(title + suffix, fontsize=10)
        axis.set_xlabel("s", fontsize=8)
        axis.tick_params(labelsize=8)
        axis.grid(alpha=0.3)
        if axis.get_legend_handles_labels()[0]:
            axis.legend(fontsize=7, loc="upper left")
        else:  # as Grafana shows a query with no series
            axis.text(0.5, 0.5, "No data (none in this run)", ha="center", va="center", transform=axis.transAxes,
                      color="#777777")
    figure.suptitle("deploy/grafana/disagg-serve.json, main panels: its PromQL over a real run's scrapes "
                    f"(synthetic engine, 256-word prompts, Poisson load {RATES[0]:.0f} then {RATES[1]:.0f} req/s)",
                    fontsize=11)
    figure.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(out, dpi=90)
    plt.close(figure)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = arguments(__doc__)
    parser.add_argument("--seconds", type=float, default=30.0, help="load time per rate (default 30)")
    parser.add_argument("--out", type=Path, default=REPO_ROOT / "docs" / "images" / "dashboard.png")
    args = parser.parse_args(argv)
    workdir = Path(tempfile.mkdtemp(prefix="disagg-dashboard-"))
    scrapes = run(args.seconds, workdir)
    print(f"{len(scrapes)} scrapes; wrote {draw(scrapes, args.out)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
