"""Overload: a burst of several times what the workers can run, from two tenants of mixed classes, against simulated
workers; what admission (docs/admission.md) keeps for the interactive user, and what it costs.

    python -m bench.overload [--json PATH] [--seconds S]

Three phases: ``light`` alone (unloaded TTFT); ``heavy``'s burst while ``light`` keeps sending (its TTFT, how
heavy's requests ended, every request answered exactly once); the orchestrator's CPU per request with tenants and
the prefill gate against an orchestrator with neither.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import httpx

from bench.driver.common import (
    Processes,
    Server,
    arguments,
    child_env,
    free_port,
    orchestrator_config,
    wait_healthy,
    worker_args,
)
from bench.driver.machine import cpu_seconds
from bench.driver.report import fmt, markdown_table, print_and_save
from entrypoints.bench.statistics import median, percentile, ratio

MODEL = "simulated"
KEYS = {"heavy": "heavy-key", "light": "light-key"}
TARGET_TTFT_RATIO = 2.0
TARGET_CPU_RATIO = 1.10


@dataclass(frozen=True)
class Settings:
    running: int = 16  # the orchestrator's max_concurrent_requests
    burst_factor: int = 5
    heavy_concurrent: int = 48  # heavy's tenant limit: the rest of its burst is refused at once
    prefill_base_ms: float = 20.0
    prefill_tokens_per_s: float = 20_000.0
    itl_ms: float = 5.0
    max_tokens: int = 16
    prompt_words: int = 200
    burst_s: float = 20.0
    light_every_s: float = 0.25
    unloaded_requests: int = 40
    cost_requests: int = 300
    cost_rounds: int = 4

    @property
    def burst(self) -> int:
        return self.burst_factor * self.running


def _worker_extra(settings: Settings) -> list[str]:
    return ["--served-model-name", MODEL, "--simulated-prefill-base-ms", str(settings.prefill_base_ms),
            "--simulated-prefill-tokens-per-s", str(settings.prefill_tokens_per_s),
            "--simulated-itl-ms", str(settings.itl_ms), "--simulated-prefix-cache-tokens", "1",
            "--kv-events-endpoint", "off"]


def _rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


def _body(settings: Settings, n: int, stream: bool) -> dict[str, Any]:
    # A prompt of its own each time: the simulated prefix cache (1 token) holds nothing, every prefill is whole.
    words = " ".join(f"w{n}x{i}" for i in range(settings.prompt_words))
    return {"model": MODEL, "messages": [{"role": "user", "content": words}], "max_tokens": settings.max_tokens,
            "stream": stream}


async def _streamed_ttft(client: httpx.AsyncClient, url: str, body: dict[str, Any], key: str) -> tuple[int, float]:
    """(status, seconds to the first content chunk) of one streamed request."""
    started = time.perf_counter()
    async with client.stream("POST", url + "/v1/chat/completions", json=body,
                             headers={"authorization": f"Bearer {key}"}) as answer:
        if answer.status_code != 200:
            await answer.aread()
            return answer.status_code, float("nan")
        ttft = float("nan")
        async for line in answer.aiter_lines():
            if ttft != ttft and line.startswith("data: ") and '"content"' in line:
                ttft = time.perf_counter() - started
        return 200, ttft


async def _unloaded(url: str, settings: Settings) -> list[float]:
    async with httpx.AsyncClient(timeout=60) as client:
        await _streamed_ttft(client, url, _body(settings, -1, True), KEYS["light"])  # warm-up
        return [(await _streamed_ttft(client, url, _body(settings, n, True), KEYS["light"]))[1]
                for n in range(settings.unloaded_requests)]


async def _burst(url: str, settings: Settings) -> dict[str, Any]:
    outcomes: dict[str, int] = {}
    sent = {"heavy": 0, "light": 0}
    answered = {"heavy": 0, "light": 0}
    response_ids: list[str] = []
    light_ttft: list[float] = []
    light_status: dict[str, int] = {}
    deadline = time.monotonic() + settings.burst_s
    limits = httpx.Limits(max_connections=settings.burst + 64, max_keepalive_connections=settings.burst + 64)

    async with httpx.AsyncClient(timeout=120, limits=limits) as client:
        async def heavy_loop(lane: int) -> None:
            n = 0
            while time.monotonic() < deadline:
                sent["heavy"] += 1
                n += 1
                reply = await client.post(url + "/v1/chat/completions", json=_body(settings, lane * 100_000 + n,
                                                                                  False),
                                          headers={"authorization": f"Bearer {KEYS['heavy']}"})
                answered["heavy"] += 1
                if reply.status_code == 200:
                    outcome = "200"
                    response_ids.append(reply.json()["id"])
                elif reply.status_code == 429:
                    code = reply.json()["error"]["code"]
                    outcome = f"429 {code}"
                    retry_after = float(reply.headers.get("retry-after", "1"))
                    await asyncio.sleep(min(retry_after, 1.0))  # a client that honours Retry-After, briefly
                else:
                    outcome = str(reply.status_code)
                outcomes[outcome] = outcomes.get(outcome, 0) + 1

        async def light_loop() -> None:
            n = 0
            tasks = []
            while time.monotonic() < deadline:
                n += 1
                sent["light"] += 1
                tasks.append(asyncio.create_task(_streamed_ttft(client, url, _body(settings, 10_000_000 + n, True),
                                                                KEYS["light"])))
                await asyncio.sleep(settings.light_every_s)
            for status, ttft in await asyncio.gather(*tasks):
                answered["light"] += 1
                light_status[str(status)] = light_status.get(str(status), 0) + 1
                if status == 200:
                    light_ttft.append(ttft)

        await asyncio.gather(light_loop(), *(heavy_loop(lane) for lane in range(settings.burst)))
    return {"heavy_outcomes": outcomes, "light_status": light_status, "light_ttft_s": light_ttft, "sent": sent,
            "answered": answered, "duplicate_ids": len(response_ids) - len(set(response_ids))}


async def _cpu_per_request(server: Server, settings: Settings, key: str | None) -> float:
    headers = {"authorization": f"Bearer {key}"} if key else {}
    async with httpx.AsyncClient(timeout=60) as client:
        for n in range(20):  # warm-up
            await client.post(server.url + "/v1/chat/completions", json=_body(settings, n, False), headers=headers)
        before = cpu_seconds(server.pid)
        for n in range(settings.cost_requests):
            await client.post(server.url + "/v1/chat/completions", json=_body(settings, n, False), headers=headers)
        return (cpu_seconds(server.pid) - before) / settings.cost_requests


def run(settings: Settings = Settings(), log_dir: Path | None = None) -> dict[str, Any]:
    with Processes(log_dir=log_dir) if log_dir else Processes() as processes:
        ports = [free_port() for _ in range(6)]
        workers = [processes.disagg_serve(f"{role}{n}", worker_args(role, "simulated", port, *_worker_extra(settings)),
                                          port)
                   for n, (role, port) in enumerate(zip(["context", "context", "generation", "generation"],
                                                        ports, strict=False))]
        ctx_urls, gen_urls = [w.url for w in workers[:2]], [w.url for w in workers[2:]]
        guarded_config = orchestrator_config(
            processes.log_dir / "guarded.yaml", ports[4], ctx_urls, gen_urls,
            max_concurrent_requests=settings.running,
            context_servers={"urls": ctx_urls, "max_running_prefills": 1},
            admission={"queue_timeout_s": 10.0},
            tenants=[{"name": "heavy", "api_key_env": "HEAVY_KEY", "priority": "batch",
                      "max_concurrent": settings.heavy_concurrent},
                     {"name": "light", "api_key_env": "LIGHT_KEY", "priority": "interactive"}])
        plain_config = orchestrator_config(processes.log_dir / "plain.yaml", ports[5], ctx_urls, gen_urls)
        env = child_env(HEAVY_KEY=KEYS["heavy"], LIGHT_KEY=KEYS["light"])
        guarded = processes.disagg_serve("guarded", ["orchestrator", "--config", str(guarded_config)], ports[4], env)
        plain = processes.disagg_serve("plain", ["orchestrator", "--config", str(plain_config)], ports[5])
        wait_healthy([*workers, guarded, plain], 120)
        unloaded = asyncio.run(_unloaded(guarded.url, settings))
        rss_before = _rss_bytes(guarded.pid)
        burst = asyncio.run(_burst(guarded.url, settings))
        rss_after = _rss_bytes(guarded.pid)
        # Paired rounds, the order swapped each time: one round's ratio swings by ~10 % with the machine.
        rounds = []
        for n in range(settings.cost_rounds):
            pair = [(plain, None), (guarded, KEYS["light"])][:: 1 if n % 2 == 0 else -1]
            costs = {server.name: asyncio.run(_cpu_per_request(server, settings, key)) for server, key in pair}
            rounds.append({"plain_ms": costs["plain"] * 1000, "guarded_ms": costs["guarded"] * 1000,
                           "ratio": ratio(costs["guarded"], costs["plain"])})
        cost_plain = median([r["plain_ms"] for r in rounds]) / 1000
        cost_guarded = median([r["guarded_ms"] for r in rounds]) / 1000
    p99_unloaded, p99_burst = percentile(unloaded, 99), percentile(burst["light_ttft_s"], 99)
    return {
        "benchmark": "overload",
        "settings": {**asdict(settings), "burst": settings.burst},
        "unloaded_ttft_s": unloaded,
        "burst": burst,
        "summary": {
            "light_ttft_p50_unloaded_ms": percentile(unloaded, 50) * 1000,
            "light_ttft_p99_unloaded_ms": p99_unloaded * 1000,
            "light_ttft_p50_burst_ms": percentile(burst["light_ttft_s"], 50) * 1000,
            "light_ttft_p99_burst_ms": p99_burst * 1000,
            "light_ttft_p99_ratio": ratio(p99_burst, p99_unloaded),
            "lost": sum(burst["sent"].values()) - sum(burst["answered"].values()),
            "duplicate_ids": burst["duplicate_ids"],
            "rss_before_mib": rss_before / 2**20, "rss_after_mib": rss_after / 2**20,
            "cpu_ms_per_request_plain": cost_plain * 1000, "cpu_ms_per_request_guarded": cost_guarded * 1000,
            "cpu_ratio": median([r["ratio"] for r in rounds]),
            "cpu_ratios": [r["ratio"] for r in rounds],
        },
    }


def tables(result: dict[str, Any]) -> str:
    s, settings, burst = result["summary"], result["settings"], result["burst"]
    header = (f"Overload: {settings['burst']} batch requests of tenant heavy kept open at once "
              f"({settings['burst_factor']}x the orchestrator's {settings['running']} running slots; heavy may hold "
              f"{settings['heavy_concurrent']}) for {settings['burst_s']:g} s, while tenant light sends an "
              f"interactive streamed request every {settings['light_every_s']:g} s; 2 CTX (one prefill at a time "
              "each) + 2 GEN simulated workers\n\n")
    rows = [
        ["light TTFT p50 / p99, unloaded", f"{fmt(s['light_ttft_p50_unloaded_ms'], 0)} / "
                                           f"{fmt(s['light_ttft_p99_unloaded_ms'], 0)} ms", ""],
        ["light TTFT p50 / p99, during the burst", f"{fmt(s['light_ttft_p50_burst_ms'], 0)} / "
                                                   f"{fmt(s['light_ttft_p99_burst_ms'], 0)} ms",
         f"p99 {fmt(s['light_ttft_p99_ratio'], 2)}x unloaded (target <= {TARGET_TTFT_RATIO:g}x)"],
        ["light requests by status", ", ".join(f"{k}: {v}" for k, v in sorted(burst["light_status"].items())), ""],
        ["heavy requests by outcome", ", ".join(f"{k}: {v}" for k, v in sorted(burst["heavy_outcomes"].items())),
         ""],
        ["lost / answered twice", f"{s['lost']} / {s['duplicate_ids']}", "target 0 / 0"],
        ["orchestrator RSS before / after", f"{fmt(s['rss_before_mib'], 0)} / {fmt(s['rss_after_mib'], 0)} MiB", ""],
        ["CPU per request, no queueing: plain / tenants + prefill gate",
         f"{fmt(s['cpu_ms_per_request_plain'], 3)} / {fmt(s['cpu_ms_per_request_guarded'], 3)} ms",
         f"median of paired rounds {fmt(s['cpu_ratio'], 2)}x ("
         f"{', '.join(fmt(r, 2) for r in s['cpu_ratios'])}; target <= {TARGET_CPU_RATIO:.2f}x)"],
    ]
    return header + markdown_table(["measure", "value", "against the target"], rows)


def main(argv: list[str] | None = None) -> int:
    parser = arguments(__doc__)
    parser.add_argument("--seconds", type=float, default=Settings.burst_s, help="how long the burst lasts")
    parser.add_argument("--json", default="bench-results/overload.json", help="write the result here")
    args = parser.parse_args(argv)
    return print_and_save(run(Settings(burst_s=args.seconds)), tables, args.json)


if __name__ == "__main__":
    raise SystemExit(main())
