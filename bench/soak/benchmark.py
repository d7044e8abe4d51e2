"""Soak: orchestrator + CTX + GEN under a mixed load for minutes, with GEN workers stopped and started again.

    python -m bench.soak --minutes 3 --concurrency 64 [--json bench-results/soak.json]
    python -m bench.soak --minutes 2 --concurrency 64 --gens 2 --kill-gen-every-s 20
    python -m bench.soak --minutes 2 --concurrency 64 --gens 2 --roll-gen-every-s 20

By default the only GEN worker is restarted with SIGTERM midway. A SIGTERM drains a worker, so no client may see an
error for it; errors that overlap a SIGKILL are reported apart (a stream cut mid-way is mid-stream migration's to
continue), and every other error is unexpected. The table also says what each stop cost the clients that met it:
the time to their first token, and the longest stall inside their stream. RSS must stay flat after warm-up, the
in-flight gauges end at 0 and no descriptor leaks (docs/reliability.md, "Soak"). The exit status is 1 if anything
unexpected happened.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import random
import signal
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import yaml

from bench.driver.common import REPO_ROOT, arguments
from bench.driver.machine import open_fds, rss_mb
from bench.soak.load import Outcome, Settings, one_request
from bench.soak.report import summarize_run, table
from bench.soak.run import STOP_GRACE_S, GenEvent, Proc, Run
from entrypoints.launcher import free_port

HEALTH_INTERVAL_S = 0.5


# -- processes -------------------------------------------------------------------------------------------------
def gauges(url: str) -> dict[str, float]:
    """The in-flight and KV-store gauges a process reports at /metrics (absent ones are left out)."""
    text = httpx.get(url + "/metrics", timeout=10).text
    found: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith(("disagg_engine_inflight_requests{", "disagg_kv_store_entries ")):
            name, value = line.rsplit(" ", 1)
            found[name] = float(value)
    return found


# -- the run ---------------------------------------------------------------------------------------------------
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


async def _restart_gen(run: Run, gen: Proc, kind: str) -> None:
    """Stop a GEN worker with ``kind`` (SIGTERM: it drains first; SIGKILL: at once), wait for it to exit, start it
    again on the same port, wait until it is healthy.

    Everything happens on the event loop's own thread: a child started from a helper thread would get its
    PR_SET_PDEATHSIG signal when that thread ends, not when this process does.
    """
    assert gen.process is not None
    event = GenEvent(kind, gen.role, time.monotonic(), old_pid=gen.pid)
    run.events.append(event)
    gen.process.send_signal(signal.SIGTERM if kind == "SIGTERM" else signal.SIGKILL)
    deadline = time.monotonic() + STOP_GRACE_S
    while gen.process.poll() is None and time.monotonic() < deadline:  # noqa: ASYNC110 - a child process, no event
        await asyncio.sleep(0.01)
    if gen.process.poll() is None:
        gen.process.kill()
    event.exit_status = gen.process.wait(timeout=10)
    event.exited_at = time.monotonic()
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
            await asyncio.sleep(0.02)
    event.healthy_at = time.monotonic()
    event.new_pid = gen.pid
    gen.fds_at_start = open_fds(gen.pid)


def schedule(settings: Settings) -> list[tuple[float, str, int]]:
    """When each GEN stop comes, in seconds from the load's start: (when, signal, which GEN), in time order. Every
    ``kill_every_s`` a SIGKILL and every ``roll_every_s`` a SIGTERM, each to the GENs in turn; with neither, one
    SIGTERM at ``restart_at`` of the run."""
    planned: list[tuple[float, str, int]] = []
    for every, kind in ((settings.kill_every_s, "SIGKILL"), (settings.roll_every_s, "SIGTERM")):
        if every:
            planned += [(every * k, kind, (k - 1) % settings.gens)
                        for k in range(1, int(settings.duration_s / every) + 1) if every * k < settings.duration_s]
    if not settings.kill_every_s and not settings.roll_every_s and settings.restart_at > 0:
        planned.append((settings.duration_s * settings.restart_at, "SIGTERM", 0))
    return sorted(planned)


async def _disrupt(run: Run) -> None:
    """The schedule's GEN stops, one after another (one still restarting delays the next)."""
    gens = run.gens
    for at, kind, index in schedule(run.settings):
        await asyncio.sleep(max(0.0, run.load_started + at - time.monotonic()))
        if time.monotonic() >= run.load_started + run.settings.duration_s:
            return
        await _restart_gen(run, gens[index], kind)


async def _drive(run: Run) -> None:
    url = run.processes["orchestrator"].url
    stop_sampling = asyncio.Event()
    sampler = asyncio.create_task(_sampler(run, stop_sampling))
    run.load_started = time.monotonic()
    disrupter = asyncio.create_task(_disrupt(run))
    try:
        await _load(run, url)
        await disrupter  # a restart slower than the load still finishes before the end figures
    finally:
        run.load_ended = time.monotonic()
        disrupter.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await disrupter
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
    gen_roles = ["gen"] if settings.gens == 1 else [f"gen{i}" for i in range(settings.gens)]
    ports = {role: free_port() for role in ("ctx", *gen_roles, "orchestrator")}
    engine = ["--engine", "synthetic", "--synthetic-itl-ms", str(settings.itl_ms)]
    config = log_dir / "orchestrator.yaml"
    config.write_text(yaml.safe_dump({
        "hostname": "127.0.0.1", "port": ports["orchestrator"],
        "context_servers": {"urls": [f"http://127.0.0.1:{ports['ctx']}"]},
        "generation_servers": {"urls": [f"http://127.0.0.1:{ports[role]}" for role in gen_roles]},
        "health_check_interval_s": HEALTH_INTERVAL_S, "max_retries": 1,
        **({"migration_limit": settings.migration_limit} if settings.migration_limit is not None else {}),
    }))
    processes = {
        "ctx": Proc("ctx", ports["ctx"], ["worker", "--role", "context", *engine, "--port", str(ports["ctx"])],
                    log_dir / "ctx.log"),
        **{role: Proc(role, ports[role], ["worker", "--role", "generation", *engine, "--port", str(ports[role])],
                      log_dir / f"{role}.log") for role in gen_roles},
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
        for role in ("orchestrator", *gen_roles, "ctx"):
            processes[role].stop()
    return summarize_run(run, end_gauges, fds_end, rss_end, slack=2 * HEALTH_INTERVAL_S + 1.0)


def settings(duration_s: float, concurrency: int = 64, itl_ms: float = 1.0, disconnect_fraction: float = 0.1,
             stream_fraction: float = 0.5, restart_at: float = 0.5, settle_s: float = 7.0, seed: int = 1,
             gens: int = 1, kill_every_s: float | None = None, roll_every_s: float | None = None,
             migration_limit: int | None = None) -> Settings:
    """A run's settings, the command's defaults unless given; RSS is sampled about 80 times a run."""
    return Settings(duration_s=duration_s, concurrency=concurrency, itl_ms=itl_ms,
                    disconnect_fraction=disconnect_fraction, stream_fraction=stream_fraction, restart_at=restart_at,
                    sample_every_s=min(2.0, max(0.25, duration_s / 80)), settle_s=settle_s, seed=seed, gens=gens,
                    kill_every_s=kill_every_s, roll_every_s=roll_every_s, migration_limit=migration_limit)


def run(settings: Settings) -> dict[str, Any]:
    """One soak, its processes' logs in a temporary folder."""
    with tempfile.TemporaryDirectory(prefix="disagg-soak-") as log_dir:
        return soak(settings, Path(log_dir))


def main(argv: list[str] | None = None) -> int:
    parser = arguments(__doc__)
    parser.add_argument("--minutes", type=float, default=3.0)
    parser.add_argument("--seconds", type=float, default=None, help="overrides --minutes")
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--itl-ms", type=float, default=1.0, help="synthetic inter-token latency")
    parser.add_argument("--disconnect-fraction", type=float, default=0.1)
    parser.add_argument("--stream-fraction", type=float, default=0.5)
    parser.add_argument("--restart-at", type=float, default=0.5,
                        help="fraction of the run when GEN restarts with SIGTERM (0: never), unless --kill-gen-every-s "
                             "or --roll-gen-every-s say otherwise")
    parser.add_argument("--gens", type=int, default=1, help="GEN workers (default 1)")
    parser.add_argument("--kill-gen-every-s", type=float, default=None, metavar="S",
                        help="SIGKILL one GEN every S seconds, the GENs in turn, and start it again")
    parser.add_argument("--roll-gen-every-s", type=float, default=None, metavar="S",
                        help="SIGTERM one GEN every S seconds (it drains), the GENs in turn, and start it again")
    parser.add_argument("--migration-limit", type=int, default=None, metavar="N",
                        help="the orchestrator's --migration-limit (default: its own, 2; 0: streams that break "
                             "mid-way end with an error event)")
    parser.add_argument("--settle-s", type=float, default=7.0, help="idle time before the end figures")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--json", type=Path, default=REPO_ROOT / "bench-results" / "soak.json")
    args = parser.parse_args(argv)
    duration = args.seconds if args.seconds is not None else args.minutes * 60
    result = run(settings(duration, concurrency=args.concurrency, itl_ms=args.itl_ms,
                          disconnect_fraction=args.disconnect_fraction, stream_fraction=args.stream_fraction,
                          restart_at=args.restart_at, settle_s=args.settle_s, seed=args.seed, gens=args.gens,
                          kill_every_s=args.kill_gen_every_s, roll_every_s=args.roll_gen_every_s,
                          migration_limit=args.migration_limit))
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(result, indent=1) + "\n")
    print(table(result))
    print(f"\nwrote {args.json}")
    return 0 if result["unexpected_errors"] == 0 and result["end_gauges_all_zero"] else 1
