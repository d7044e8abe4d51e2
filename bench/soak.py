"""Soak: orchestrator + CTX + GEN under a mixed load for minutes, with the GEN worker restarted midway.

    python -m bench.soak --minutes 3 --concurrency 64 [--json bench-results/soak.json]

Every process is a real ``disagg-serve`` subprocess on loopback (synthetic engine, small inter-token latency), so
the figures are the front end's own. The load is a bounded asyncio loop of the official OpenAI wire format over
httpx: half streaming, ~10% of clients hanging up early on purpose. Midway the GEN worker gets SIGTERM and is
started again on the same port; errors that overlap that window are *expected*, every other error is not.

Reported: requests ok / cancelled by the client / expected errors / unexpected errors (with samples), the RSS
of each process over time (flat after warm-up: the last quarter's median against the second quarter's), the KV
store entries and in-flight gauges at the end (all 0), and the open file descriptors of each process at its start
and at the end (``/proc/PID/fd``). It prints a table and writes JSON; the exit status is 1 if anything unexpected
happened.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx
import orjson
import yaml

from entrypoints.launcher import free_port
from frontend.process_lifetime import die_with_parent

REPO_ROOT = Path(__file__).resolve().parent.parent
MODEL = "synthetic"
SYNTHETIC_TEXT = b"The quick brown fox jumps over the lazy dog. "
HEALTH_INTERVAL_S = 0.5
STOP_GRACE_S = 40.0


def synthetic_text(n: int) -> str:
    return bytes(SYNTHETIC_TEXT[i % len(SYNTHETIC_TEXT)] for i in range(n)).decode()


# -- processes --------------------------------------------------------------------------------------------------
@dataclass
class Proc:
    role: str
    port: int
    argv: list[str]
    log: Path
    process: subprocess.Popen[bytes] | None = None
    fds_at_start: int | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def pid(self) -> int:
        assert self.process is not None
        return self.process.pid

    def start(self) -> None:
        with open(self.log, "ab") as log:
            self.process = subprocess.Popen(
                [sys.executable, "-m", "entrypoints.cli", "--log-level", "warning", *self.argv],
                stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, cwd=REPO_ROOT,
                preexec_fn=die_with_parent,
            )

    def stop(self) -> int | None:
        if self.process is None:
            return None
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
        try:
            return self.process.wait(timeout=STOP_GRACE_S)
        except subprocess.TimeoutExpired:
            self.process.kill()
            return self.process.wait(timeout=10)

    def wait_healthy(self, timeout_s: float = 60.0) -> None:
        deadline = time.monotonic() + timeout_s
        while True:
            assert self.process is not None
            if self.process.poll() is not None:
                raise RuntimeError(f"{self.role} exited with {self.process.returncode}:\n{self.log_tail()}")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return
            if time.monotonic() > deadline:
                raise RuntimeError(f"{self.role} not healthy after {timeout_s:.0f} s:\n{self.log_tail()}")
            time.sleep(0.1)

    def log_tail(self) -> str:
        with contextlib.suppress(OSError):
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-20:])
        return ""


def rss_mb(pid: int) -> float | None:
    with contextlib.suppress(OSError, ValueError, IndexError):
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return None


def open_fds(pid: int) -> int | None:
    try:
        return len(os.listdir(f"/proc/{pid}/fd"))
    except OSError:
        return None


def gauges(url: str) -> dict[str, float]:
    """The in-flight and KV-store gauges a process reports at /metrics (absent ones are left out)."""
    text = httpx.get(url + "/metrics", timeout=10).text
    found: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith(("disagg_engine_inflight_requests{", "disagg_kv_store_entries ")):
            name, value = line.rsplit(" ", 1)
            found[name] = float(value)
    return found


# -- the load ---------------------------------------------------------------------------------------------------
@dataclass
class Outcome:
    started: float
    ended: float
    kind: str  # ok | cancelled | error
    detail: str = ""
    streaming: bool = False


@dataclass
class RestartWindow:
    sigterm_at: float | None = None
    healthy_at: float | None = None
    old_pid: int | None = None
    new_pid: int | None = None
    exit_status: int | None = None

    def covers(self, started: float, ended: float, slack_s: float) -> bool:
        if self.sigterm_at is None:
            return False
        end = (self.healthy_at if self.healthy_at is not None else float("inf")) + slack_s
        return started <= end and ended >= self.sigterm_at


@dataclass
class Settings:
    duration_s: float
    concurrency: int
    itl_ms: float
    disconnect_fraction: float
    stream_fraction: float
    restart_at: float
    sample_every_s: float
    settle_s: float
    seed: int


async def one_request(client: httpx.AsyncClient, url: str, rng: random.Random, settings: Settings) -> Outcome:
    streaming = rng.random() < settings.stream_fraction
    disconnect = rng.random() < settings.disconnect_fraction
    max_tokens = rng.randint(4, 48)
    words = rng.randint(5, 400)
    content = " ".join(rng.choice(("alpha", "beta", "gamma", "delta", "ünïcödé")) for _ in range(words))
    body = {"model": MODEL, "messages": [{"role": "user", "content": content}], "max_tokens": max_tokens,
            "stream": streaming}
    started = time.monotonic()
    try:
        if streaming:
            return await _streamed(client, url, body, max_tokens, disconnect, started, rng)
        if disconnect:
            # The client gives up before the answer: the task is cancelled, its connection closed.
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(client.post(url + "/v1/chat/completions", content=orjson.dumps(body)),
                                       timeout=rng.uniform(0.001, 0.03))
            return Outcome(started, time.monotonic(), "cancelled")
        reply = await client.post(url + "/v1/chat/completions", content=orjson.dumps(body))
        if reply.status_code != 200:
            return Outcome(started, time.monotonic(), "error", f"HTTP {reply.status_code}: {reply.text[:200]}")
        text = reply.json()["choices"][0]["message"]["content"]
        if text != synthetic_text(max_tokens):
            return Outcome(started, time.monotonic(), "error", f"wrong text {text[:60]!r}")
        return Outcome(started, time.monotonic(), "ok")
    except httpx.HTTPError as exc:
        return Outcome(started, time.monotonic(), "error", f"{type(exc).__name__}: {exc}", streaming)


async def _streamed(client: httpx.AsyncClient, url: str, body: dict[str, Any], max_tokens: int, disconnect: bool,
                    started: float, rng: random.Random) -> Outcome:
    leave_after = rng.randint(1, 4) if disconnect else None
    parts: list[str] = []
    frames = 0
    buffer = b""
    async with client.stream("POST", url + "/v1/chat/completions", content=orjson.dumps(body)) as response:
        if response.status_code != 200:
            text = (await response.aread()).decode(errors="replace")
            return Outcome(started, time.monotonic(), "error", f"HTTP {response.status_code}: {text[:200]}", True)
        async for chunk in response.aiter_raw():
            buffer += chunk
            while b"\n\n" in buffer:
                frame, buffer = buffer.split(b"\n\n", 1)
                frames += 1
                if frame == b"data: [DONE]":
                    text = "".join(parts)
                    if text != synthetic_text(max_tokens):
                        return Outcome(started, time.monotonic(), "error", f"wrong text {text[:60]!r}", True)
                    return Outcome(started, time.monotonic(), "ok", streaming=True)
                payload = orjson.loads(frame.removeprefix(b"data: "))
                if "error" in payload:
                    return Outcome(started, time.monotonic(), "error",
                                   f"stream error event: {payload['error'].get('message', '')[:200]}", True)
                if payload.get("choices"):
                    parts.append(payload["choices"][0]["delta"].get("content") or "")
            if leave_after is not None and frames >= leave_after:
                return Outcome(started, time.monotonic(), "cancelled", streaming=True)  # leaves: closes the stream
    return Outcome(started, time.monotonic(), "error", "the stream ended without [DONE]", True)


# -- the run ----------------------------------------------------------------------------------------------------
@dataclass
class Run:
    settings: Settings
    processes: dict[str, Proc]
    outcomes: list[Outcome] = field(default_factory=list)
    samples: list[dict[str, Any]] = field(default_factory=list)
    restart: RestartWindow = field(default_factory=RestartWindow)
    load_started: float = 0.0
    load_ended: float = 0.0


async def _load(run: Run, url: str) -> None:
    s = run.settings
    deadline = run.load_started + s.duration_s
    rng = random.Random(s.seed)
    limits = httpx.Limits(max_connections=s.concurrency, max_keepalive_connections=s.concurrency)
    async with httpx.AsyncClient(timeout=httpx.Timeout(60.0, connect=10.0), limits=limits,
                                 headers={"Content-Type": "application/json"}) as client:
        async def user(index: int) -> None:
            user_rng = random.Random(rng.random() + index)
            while time.monotonic() < deadline:
                started = time.monotonic()
                try:
                    run.outcomes.append(await one_request(client, url, user_rng, s))
                except Exception as exc:  # a malformed answer is an unexpected error, not a crash of the soak
                    run.outcomes.append(Outcome(started, time.monotonic(), "error", f"{type(exc).__name__}: {exc}"))

        await asyncio.gather(*(user(i) for i in range(s.concurrency)))


async def _sampler(run: Run, stop: asyncio.Event) -> None:
    while not stop.is_set():
        now = time.monotonic() - run.load_started
        for role, proc in run.processes.items():
            if proc.process is not None and proc.process.poll() is None:
                run.samples.append({"t": round(now, 3), "role": role, "pid": proc.pid, "rss_mb": rss_mb(proc.pid),
                                    "fds": open_fds(proc.pid)})
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), timeout=run.settings.sample_every_s)


async def _restart_gen(run: Run) -> None:
    """SIGTERM the GEN worker, wait for it to exit, start it again on the same port, wait until it is healthy.

    Everything happens on the event loop's own thread: a child started from a helper thread would get its
    PR_SET_PDEATHSIG signal when that thread ends, not when this process does.
    """
    gen = run.processes["gen"]
    assert gen.process is not None
    run.restart.old_pid = gen.pid
    run.restart.sigterm_at = time.monotonic()
    gen.process.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + STOP_GRACE_S
    while gen.process.poll() is None and time.monotonic() < deadline:  # noqa: ASYNC110 - a child process, no event
        await asyncio.sleep(0.05)
    if gen.process.poll() is None:
        gen.process.kill()
    run.restart.exit_status = gen.process.wait(timeout=10)
    gen.start()
    deadline = time.monotonic() + 60
    async with httpx.AsyncClient(timeout=2) as probe:
        while True:
            if gen.process.poll() is not None:
                raise RuntimeError(f"the restarted GEN exited with {gen.process.returncode}:\n{gen.log_tail()}")
            with contextlib.suppress(httpx.HTTPError):
                if (await probe.get(gen.url + "/health")).status_code == 200:
                    break
            if time.monotonic() > deadline:
                raise RuntimeError(f"the restarted GEN is not healthy:\n{gen.log_tail()}")
            await asyncio.sleep(0.05)
    run.restart.healthy_at = time.monotonic()
    run.restart.new_pid = gen.pid
    gen.fds_at_start = open_fds(gen.pid)


async def _drive(run: Run) -> None:
    url = run.processes["orchestrator"].url
    stop_sampling = asyncio.Event()
    sampler = asyncio.create_task(_sampler(run, stop_sampling))
    run.load_started = time.monotonic()

    async def restart_later() -> None:
        await asyncio.sleep(run.settings.duration_s * run.settings.restart_at)
        await _restart_gen(run)

    restarter = asyncio.create_task(restart_later())
    try:
        await _load(run, url)
        await restarter  # a restart slower than the load still finishes before the end figures
    finally:
        run.load_ended = time.monotonic()
        restarter.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await restarter
        stop_sampling.set()
        await sampler


def _wait_idle(run: Run, timeout_s: float = 30.0) -> dict[str, dict[str, float]]:
    deadline = time.monotonic() + timeout_s
    while True:
        found = {role: gauges(proc.url) for role, proc in run.processes.items()}
        if all(v == 0 for g in found.values() for v in g.values()) or time.monotonic() > deadline:
            return found
        time.sleep(0.2)


def soak(settings: Settings, log_dir: Path) -> dict[str, Any]:
    ports = {role: free_port() for role in ("ctx", "gen", "orchestrator")}
    engine = ["--engine", "synthetic", "--synthetic-itl-ms", str(settings.itl_ms)]
    config = log_dir / "orchestrator.yaml"
    config.write_text(yaml.safe_dump({
        "hostname": "127.0.0.1", "port": ports["orchestrator"],
        "context_servers": {"urls": [f"http://127.0.0.1:{ports['ctx']}"]},
        "generation_servers": {"urls": [f"http://127.0.0.1:{ports['gen']}"]},
        "health_check_interval_s": HEALTH_INTERVAL_S, "max_retries": 1,
    }))
    processes = {
        "ctx": Proc("ctx", ports["ctx"], ["worker", "--role", "context", *engine, "--port", str(ports["ctx"])],
                    log_dir / "ctx.log"),
        "gen": Proc("gen", ports["gen"], ["worker", "--role", "generation", *engine, "--port", str(ports["gen"])],
                    log_dir / "gen.log"),
        "orchestrator": Proc("orchestrator", ports["orchestrator"], ["orchestrator", "--config", str(config)],
                             log_dir / "orchestrator.log"),
    }
    run = Run(settings, processes)
    try:
        for proc in processes.values():
            proc.start()
        for proc in processes.values():
            proc.wait_healthy()
        for proc in processes.values():
            proc.fds_at_start = open_fds(proc.pid)
        asyncio.run(_drive(run))
        end_gauges = _wait_idle(run)
        time.sleep(settings.settle_s)  # idle keep-alive connections expire (httpx: 5 s) before fds are counted
        fds_end = {role: open_fds(proc.pid) for role, proc in processes.items()}
        rss_end = {role: rss_mb(proc.pid) for role, proc in processes.items()}
    finally:
        for role in ("orchestrator", "gen", "ctx"):
            processes[role].stop()
    return _report(run, end_gauges, fds_end, rss_end)


def _quarter_median(samples: list[dict[str, Any]], role: str, low: float, high: float, length: float) -> float | None:
    values = [s["rss_mb"] for s in samples
              if s["role"] == role and s["rss_mb"] is not None and low * length <= s["t"] < high * length]
    return round(statistics.median(values), 1) if values else None


def _report(run: Run, end_gauges: dict[str, dict[str, float]], fds_end: dict[str, int | None],
            rss_end: dict[str, float | None]) -> dict[str, Any]:
    slack = 2 * HEALTH_INTERVAL_S + 1.0
    counts = {"ok": 0, "cancelled": 0, "expected_errors": 0, "unexpected_errors": 0}
    unexpected: list[str] = []
    unexpected_at: list[float] = []
    expected: list[str] = []
    for outcome in run.outcomes:
        if outcome.kind in ("ok", "cancelled"):
            counts[outcome.kind] += 1
        elif run.restart.covers(outcome.started, outcome.ended, slack) and not outcome.detail.startswith("wrong"):
            counts["expected_errors"] += 1
            expected.append(outcome.detail)
        else:
            counts["unexpected_errors"] += 1
            unexpected.append(outcome.detail)
            unexpected_at.append(round(outcome.started - run.load_started, 3))
    length = run.load_ended - run.load_started
    rss = {}
    for role in run.processes:
        q2 = _quarter_median(run.samples, role, 0.25, 0.5, length)
        q4 = _quarter_median(run.samples, role, 0.75, 1.01, length)
        growth = round(100 * (q4 - q2) / q2, 1) if q2 and q4 else None
        rss[role] = {"q2_median_mb": q2, "q4_median_mb": q4, "growth_pct": growth, "end_mb": rss_end[role]}
    fds: dict[str, dict[str, int | None]] = {}
    for role, proc in run.processes.items():
        start, end = proc.fds_at_start, fds_end[role]
        fds[role] = {"pid": proc.pid, "start": start, "end": end,
                     "growth": end - start if end is not None and start is not None else None}
    restart = asdict(run.restart)
    for key in ("sigterm_at", "healthy_at"):
        if restart[key] is not None:
            restart[key] = round(restart[key] - run.load_started, 3)
    return {
        "settings": asdict(run.settings),
        "duration_s": round(length, 2),
        "requests": len(run.outcomes),
        "requests_per_s": round(len(run.outcomes) / length, 1) if length else None,
        "streaming_share": round(sum(o.streaming for o in run.outcomes) / max(1, len(run.outcomes)), 3),
        **counts,
        "expected_error_samples": sorted(set(expected))[:10],
        "unexpected_error_samples": sorted(set(unexpected))[:10],
        "unexpected_error_times_s": sorted(unexpected_at)[:100],
        "gen_restart": restart,
        "end_gauges": end_gauges,
        "end_gauges_all_zero": all(v == 0 for g in end_gauges.values() for v in g.values()),
        "rss_mb": rss,
        "open_fds": fds,
        "samples": run.samples,
    }


def table(result: dict[str, Any]) -> str:
    lines = [
        f"soak: {result['duration_s']} s at concurrency {result['settings']['concurrency']}, "
        f"{result['requests']} requests ({result['requests_per_s']}/s, {result['streaming_share']:.0%} streamed)",
        "",
        "| outcome | count |", "| --- | --- |",
        *(f"| {k.replace('_', ' ')} | {result[k]} |"
          for k in ("ok", "cancelled", "expected_errors", "unexpected_errors")),
        "",
        "| process | RSS Q2 median MB | RSS Q4 median MB | growth % | fds start | fds end |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for role, rss in result["rss_mb"].items():
        fds = result["open_fds"][role]
        lines.append(f"| {role} | {rss['q2_median_mb']} | {rss['q4_median_mb']} | {rss['growth_pct']} | "
                     f"{fds['start']} | {fds['end']} |")
    restart = result["gen_restart"]
    lines += ["", f"GEN restart: SIGTERM at {restart['sigterm_at']} s (exit {restart['exit_status']}), healthy again "
                  f"at {restart['healthy_at']} s (pid {restart['old_pid']} -> {restart['new_pid']})",
              "end gauges: " + ", ".join(f"{k} {v:g}" for g in result["end_gauges"].values() for k, v in g.items())]
    if result["unexpected_error_samples"]:
        lines += ["unexpected errors:", *(f"  {e}" for e in result["unexpected_error_samples"])]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--minutes", type=float, default=3.0)
    parser.add_argument("--seconds", type=float, default=None, help="overrides --minutes")
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--itl-ms", type=float, default=1.0, help="synthetic inter-token latency")
    parser.add_argument("--disconnect-fraction", type=float, default=0.1)
    parser.add_argument("--stream-fraction", type=float, default=0.5)
    parser.add_argument("--restart-at", type=float, default=0.5, help="fraction of the run when GEN restarts")
    parser.add_argument("--settle-s", type=float, default=7.0, help="idle time before the end figures")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--json", type=Path, default=REPO_ROOT / "bench-results" / "soak.json")
    args = parser.parse_args(argv)
    duration = args.seconds if args.seconds is not None else args.minutes * 60
    settings = Settings(duration_s=duration, concurrency=args.concurrency, itl_ms=args.itl_ms,
                        disconnect_fraction=args.disconnect_fraction, stream_fraction=args.stream_fraction,
                        restart_at=args.restart_at, sample_every_s=min(2.0, max(0.25, duration / 80)),
                        settle_s=args.settle_s, seed=args.seed)
    with tempfile.TemporaryDirectory(prefix="disagg-soak-") as log_dir:
        result = soak(settings, Path(log_dir))
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(result, indent=1) + "\n")
    print(table(result))
    print(f"\nwrote {args.json}")
    return 0 if result["unexpected_errors"] == 0 and result["end_gauges_all_zero"] else 1


if __name__ == "__main__":
    sys.exit(main())
