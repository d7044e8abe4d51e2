"""One closed-loop load point, as every load benchmark measures it: warm-up, a measurement window and a tail
(``Phases``), driven by the load generator in its own process (``bench.driver.loadgen``), with the event-loop prober
(``bench.driver.prober``) beside it when asked."""

from __future__ import annotations

import json
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.driver.common import PYTHON, REPO_ROOT, Processes, Server, child_env
from entrypoints.bench.statistics import summarize

_PROBER_START_S = 120.0  # a bound on a start-up that takes 0.2 s alone and seconds on a busy machine


@dataclass(frozen=True)
class Phases:
    warmup_s: float = 1.5
    max_warmup_s: float = 30.0
    measure_s: float = 6.0
    max_measure_s: float = 25.0
    tail_s: float = 60.0
    max_total_s: float = 110.0
    quiet_wait_s: float = 10.0  # before each point, wait this long at most for other users' load to go away

    def loadgen(self, concurrency: int) -> dict[str, Any]:
        return {"warmup_s": self.warmup_s, "max_warmup_s": self.max_warmup_s, "measure_s": self.measure_s,
                "min_requests": max(20, concurrency), "max_measure_s": self.max_measure_s,
                "tail_s": self.tail_s, "max_total_s": self.max_total_s}


def run_loadgen(processes: Processes, config: dict[str, Any]) -> dict[str, Any]:
    workdir = processes.log_dir
    stamp = f"{config['mode']}-{config['prompt_chars']}-{config['concurrency']}-{time.monotonic_ns()}"
    config_path, out_path = workdir / f"loadgen-{stamp}.json", workdir / f"loadgen-{stamp}.out.json"
    config_path.write_text(json.dumps(config))
    log_path = workdir / f"loadgen-{stamp}.log"
    with open(log_path, "wb") as log:
        try:
            subprocess.run([PYTHON, "-m", "bench.driver.loadgen", "--config", str(config_path), "--out", str(out_path)],
                           stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=child_env(),
                           cwd=REPO_ROOT, timeout=config["max_total_s"] + 60,
                           check=True)
        except (subprocess.TimeoutExpired, subprocess.CalledProcessError) as exc:
            raise RuntimeError(f"the load generator failed ({exc}):\n{log_path.read_text()[-3000:]}") from exc
    result: dict[str, Any] = json.loads(out_path.read_text())
    return result


def start_prober(processes: Processes, targets: dict[str, str], out: Path, max_s: float,
                 samples: int | None = None) -> Server:
    """Start the prober and return once it is probing (it says so with a file), however slow its start-up."""
    ready = out.with_suffix(".ready")
    argv = [PYTHON, "-m", "bench.driver.prober", "--out", str(out), "--interval-ms", "20", "--max-s", str(max_s),
            "--ready-file", str(ready)]
    if samples is not None:
        argv += ["--samples", str(samples)]
    for name, url in targets.items():
        argv += ["--target", f"{name}={url}"]
    prober = processes.spawn(f"prober-{out.stem}", argv)
    deadline = time.monotonic() + _PROBER_START_S
    while not ready.exists():
        if prober.process.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"the prober did not start:\n{prober.log_tail()}")
        time.sleep(0.01)
    return prober


def stop_prober(processes: Processes, prober: Server, out: Path) -> dict[str, list[list[float | None]]]:
    processes.stop([prober])
    samples: dict[str, list[list[float | None]]] = json.loads(out.read_text()) if out.exists() else {}
    return samples


def lag_in_window(samples: dict[str, list[list[float | None]]], window: tuple[float, float]) -> dict[str, Any]:
    stats: dict[str, Any] = {}
    for name, series in samples.items():
        inside = [s for s in series if window[0] <= (s[0] or 0) <= window[1]]
        values = [float(s[1]) for s in inside if s[1] is not None]
        stats[name] = {**summarize(values), "failed": sum(1 for s in inside if s[1] is None)}
    return stats
