"""Serving on vLLM: vLLM's own server against our aggregated worker, our CTX + GEN pair and our orchestrator in
front of a vLLM P/D pair; GEN's CPU per request on the array path vs the list path; the orchestrator's CPU.

``python -m bench.vllm_serving [--quick] [--docs]``, with vLLM installed, under ``flock /work/vllm.lock`` on a
shared machine. Four phases, one after the other, each with at most two vLLM instances alive (~5 GB each; every
instance float32, eager, one OMP thread, 2 GiB of KV cache, ``bench.vllm_processes``):

- ``vLLM server``: ``python -m vllm.entrypoints.openai.api_server``, alone: the baseline;
- ``ours, aggregated``: ``disagg-serve worker --engine vllm --role both``;
- ``ours, CTX + GEN``: our orchestrator and our CTX and GEN workers on ``--engine vllm``, KV through vLLM's
  ExampleConnector (a folder both instances share);
- ``ours in front of vLLM P/D``: our orchestrator (``protocol: vllm``) in front of two plain vLLM servers, P and D,
  sharing ExampleConnector's folder.

Latency: one client streams ``/v1/completions`` at temperature 0 with ``ignore_eos``, one request at a time, a
distinct prompt per request (random common words, one token each) so that no prefix cache hides the prefill, the
same prompts on every set-up; TTFT (request sent -> first text frame) and decode tokens/s after the first token
((tokens - 1) / first-to-last text frame), the median of the runs, after one warm-up request per size.

GEN's CPU per request (phase 3): the CTX worker's context-only answer for one prompt per size is turned into two
generation-only bodies for the GEN worker, one carrying CTX's ``prompt_token_ids_b64`` (the array path, what our
orchestrator sends) and one carrying the same tokens as a ``prompt_token_ids`` JSON list (the list path: the
prompt is a Python ``list[int]`` from the moment the body is parsed, as a naive front end has it). Both are wire
forms GEN already accepts, so no switch in the product is needed. Sent straight to GEN (``max_tokens`` 2: one
decode step), in alternating batches; the figure is the GEN worker process's own utime + stime (``/proc/<pid>/stat``,
not vLLM's engine-core child) per request. The same bodies also go through GEN's parse path in this process (
``WorkerService.prepare`` on a synthetic engine, then the vLLM adapter's own ``_vllm_prompt``), which resolves what
10 ms clock ticks cannot, and the adapter's one unavoidable ``tolist()`` is timed alone.

The orchestrator's CPU per request (phases 3 and 4): chat, streamed, 8 tokens, one ~1k-token prompt repeated (the
orchestrator's work does not depend on the prefill, and vLLM's prefix cache makes each request short), from
``/proc/<pid>/stat`` of the orchestrator process over the batch, beside the toy-proxy figures quoted from issue 14.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import tempfile
import time
import types
from collections.abc import Iterator
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import orjson
import pybase64

from bench import report
from bench.common import Processes, Server, free_port, http_get, wait_healthy
from bench.figures import ratio
from bench.machine import cpu_seconds, loadavg, machine_info
from bench.reference import _WORDS, stream_once
from bench.report import fmt, markdown_table, write_json
from bench.vllm_processes import example_connector, our_worker, vllm_api_server, vllm_instances

BEGIN, END = report.markers("vllm_serving")

VLLM = "vLLM server"
AGGREGATED = "ours, aggregated"
DISAGGREGATED = "ours, CTX + GEN"
PD = "ours in front of vLLM P/D"
SETUPS = (VLLM, AGGREGATED, DISAGGREGATED, PD)

# Issue 14's figures: each proxy alone against mock workers, chat streaming 8 tokens, CPU of the proxy process per
# request. Quoted, not measured in this run.
QUOTED = {"vLLM toy P/D proxy (httpx, text only)": {1_024: "5.0-5.2", 40_000: "6.8-7.5", 131_072: "11.2-12.2"},
          "SGLang mini_lb": {1_024: "2.8-3.2", 40_000: "4.1-4.8", 131_072: "8.7-10.0"},
          "ours (bench.orchestrator_cost, vs pass-through)": {1_024: "~3.0", 131_072: "~4.9"}}


@dataclass(frozen=True)
class Settings:
    # One under 512 and 2,048: with ExampleConnector a CTX prompt of a multiple of 128 tokens kills GEN's engine
    # core (GEN's prompt is CTX's plus one token; the connector finds KV by the prompt less its last token cut to
    # whole blocks, then loads it under the whole prompt cut to whole blocks: another folder, FileNotFoundError).
    prompts: tuple[int, ...] = (511, 2_047)
    runs: int = 3
    max_tokens: int = 32
    cost_prompt: int = 1_024  # the orchestrator's CPU: issue 14's smallest prompt
    cost_requests: int = 20
    cost_max_tokens: int = 8
    gen_cpu_rounds: int = 3  # list and array batches taken in turn
    gen_cpu_batch: int = 8
    inprocess_runs: int = 9
    inprocess_ops: int = 50
    setups: tuple[str, ...] = SETUPS


FULL = Settings()
QUICK = Settings(prompts=(511,), runs=1, max_tokens=16, cost_requests=8, gen_cpu_rounds=1, gen_cpu_batch=4,
                 inprocess_runs=3, inprocess_ops=10)


# -- prompts and requests -----------------------------------------------------------------------------------------
def prompt_words(count: int, seed: int) -> str:
    """``count`` common words, one token each in SmolLM2's vocabulary; a different text for every seed."""
    picks = np.random.default_rng(seed).integers(0, len(_WORDS), count)
    return " ".join(_WORDS[int(i)] for i in picks)


def model_of(url: str) -> str:
    return str(orjson.loads(http_get(url, "/v1/models", timeout_s=30)[1])["data"][0]["id"])


def latency(url: str, settings: Settings) -> list[dict[str, Any]]:
    """TTFT and decode rate at each prompt size: one warm-up, then ``runs`` requests, every prompt distinct."""
    model = model_of(url)
    points = []
    with httpx.Client(timeout=httpx.Timeout(600.0, connect=10.0)) as client:
        for size in settings.prompts:
            stream_once(client, url, model, prompt_words(size, seed=size * 1_000 + 999), settings.max_tokens)
            runs = [stream_once(client, url, model, prompt_words(size, seed=size * 1_000 + i), settings.max_tokens)
                    for i in range(settings.runs)]
            points.append({
                "prompt_words": size,
                "prompt_tokens": runs[0]["prompt_tokens"],
                "completion_tokens": runs[0]["completion_tokens"],
                "ttft_ms": statistics.median(r["ttft_ms"] for r in runs),
                "decode_tokens_per_s": _median(runs, "decode_tokens_per_s"),
                "first_gap_ms": _median(runs, "first_gap_ms"),
                "steady_decode_tokens_per_s": _median(runs, "steady_decode_tokens_per_s"),
                "runs": [{k: v for k, v in r.items() if k != "text"} for r in runs],
            })
            print(f"[vllm_serving]   prompt {points[-1]['prompt_tokens']:>5} tokens: TTFT p50 "
                  f"{points[-1]['ttft_ms']:.0f} ms, decode {fmt(points[-1]['decode_tokens_per_s'], 1)} tok/s",
                  file=sys.stderr, flush=True)
    return points


def _median(runs: list[dict[str, Any]], key: str) -> float | None:
    values = [r[key] for r in runs if r.get(key) is not None]
    return statistics.median(values) if values else None


def orchestrator_cpu(orchestrator: Server, settings: Settings) -> dict[str, Any]:
    """CPU of the orchestrator process per request: chat, streamed, ``cost_max_tokens`` tokens, one prompt."""
    url = orchestrator.url
    body = orjson.dumps({"model": model_of(url), "max_tokens": settings.cost_max_tokens, "temperature": 0,
                         "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True},
                         "messages": [{"role": "user", "content": prompt_words(settings.cost_prompt, seed=7)}]})
    headers = {"Content-Type": "application/json"}
    usage: dict[str, Any] = {}
    with httpx.Client(timeout=httpx.Timeout(600.0, connect=10.0)) as client:

        def ask() -> None:
            with client.stream("POST", url + "/v1/chat/completions", content=body, headers=headers) as reply:
                content = reply.read()
            if reply.status_code != 200 or b"data: [DONE]" not in content:
                raise RuntimeError(f"the orchestrator answered {reply.status_code}: {content[-300:]!r}")
            for frame in content.split(b"\n\n"):
                if frame.startswith(b"data: {") and b'"usage":{' in frame:
                    usage.update(orjson.loads(frame[6:]).get("usage") or {})

        for _ in range(2):  # first-call costs (connections, caches) are not the figure
            ask()
        idle0, idle_t0 = cpu_seconds(orchestrator.pid), time.perf_counter()
        time.sleep(5.0)  # 10 ms ticks: 2 ms/s resolution
        idle_ms_per_s = (cpu_seconds(orchestrator.pid) - idle0) * 1e3 / (time.perf_counter() - idle_t0)
        cpu0, wall0 = cpu_seconds(orchestrator.pid), time.perf_counter()
        for _ in range(settings.cost_requests):
            ask()
        cpu1, wall1 = cpu_seconds(orchestrator.pid), time.perf_counter()
    n = settings.cost_requests
    cell = {"requests": n, "prompt_tokens": usage.get("prompt_tokens"), "completion_tokens":
            usage.get("completion_tokens"), "cpu_ms_per_request": (cpu1 - cpu0) * 1e3 / n,
            "wall_ms_per_request": (wall1 - wall0) * 1e3 / n, "idle_cpu_ms_per_s": idle_ms_per_s}
    print(f"[vllm_serving]   orchestrator CPU {cell['cpu_ms_per_request']:.2f} ms/req over {n} requests "
          f"({cell['prompt_tokens']} prompt tokens), idle {idle_ms_per_s:.2f} ms/s", file=sys.stderr, flush=True)
    return cell


# -- GEN's CPU per request: array path vs list path ------------------------------------------------------------------
def gen_bodies(ctx_url: str, size: int, model: str) -> dict[str, bytes]:
    """CTX's real context-only answer for one prompt, as the two generation-only bodies GEN accepts."""
    ctx_body = {"model": model, "prompt": prompt_words(size, seed=size * 1_000 + 500), "max_tokens": 2,
                "temperature": 0, "ignore_eos": True, "stream": False,
                "disaggregated_params": {"request_type": "context_only", "return_prompt_token_ids_b64": True,
                                         "native_extensions": True}}
    reply = httpx.post(ctx_url + "/v1/completions", content=orjson.dumps(ctx_body), timeout=600,
                       headers={"Content-Type": "application/json"})
    if reply.status_code != 200:
        raise RuntimeError(f"CTX answered {reply.status_code}: {reply.text[:300]}")
    answer = orjson.loads(reply.content)
    params = dict(answer["choices"][0]["disaggregated_params"])
    params["request_type"] = "generation_only"
    encoded = answer["prompt_token_ids_b64"]
    base = {"model": model, "max_tokens": 2, "temperature": 0, "ignore_eos": True, "disaggregated_params": params}
    tokens = np.frombuffer(pybase64.b64decode(encoded, validate=True), dtype="<i4")
    return {"array": orjson.dumps({**base, "prompt_token_ids_b64": encoded}),
            "list": orjson.dumps({**base, "prompt_token_ids": tokens.tolist()})}


def gen_worker_cpu(gen: Server, bodies: dict[str, bytes], settings: Settings) -> dict[str, Any]:
    """The GEN worker process's own CPU per request for each body, batches of the kinds taken in turn."""
    cpu = dict.fromkeys(bodies, 0.0)
    wall = dict.fromkeys(bodies, 0.0)
    count = dict.fromkeys(bodies, 0)
    headers = {"Content-Type": "application/json"}
    with httpx.Client(timeout=httpx.Timeout(600.0, connect=10.0)) as client:

        def post(body: bytes) -> None:
            reply = client.post(gen.url + "/v1/completions", content=body, headers=headers)
            if reply.status_code != 200 or orjson.loads(reply.content)["usage"]["completion_tokens"] < 1:
                raise RuntimeError(f"GEN answered {reply.status_code}: {reply.text[:300]}")

        for body in bodies.values():
            for _ in range(2):
                post(body)
        for _ in range(settings.gen_cpu_rounds):
            for kind, body in bodies.items():
                c0, w0 = cpu_seconds(gen.pid), time.perf_counter()
                for _ in range(settings.gen_cpu_batch):
                    post(body)
                cpu[kind] += cpu_seconds(gen.pid) - c0
                wall[kind] += time.perf_counter() - w0
                count[kind] += settings.gen_cpu_batch
    return {kind: {"requests": count[kind], "cpu_ms": cpu[kind] * 1e3 / count[kind],
                   "wall_ms": wall[kind] * 1e3 / count[kind], "body_bytes": len(bodies[kind])} for kind in bodies}


def gen_prompt_path_in_process(bodies: dict[str, bytes], settings: Settings) -> dict[str, Any]:
    """The same bodies through GEN's own parse path and the vLLM adapter's prompt conversion, in this process.

    A synthetic engine stands in for vLLM (``WorkerService.prepare`` reads only its vocabulary and context size,
    and the bodies are re-encoded with its model name); ``_vllm_prompt`` is the adapter's own function, given a
    ``TokensPrompt`` that is a plain dict (vLLM's is a TypedDict: a dict too).
    """
    from bench.prompt_path import run_to_completion, time_interleaved
    from frontend.http import parse_json_object
    from frontend.metrics import Metrics
    from frontend.openai_models import CompletionRequest
    from workers.engines.synthetic import SyntheticEngine
    from workers.engines.vllm.engine import _vllm_prompt
    from workers.serving import WorkerService, WorkerSettings

    engine = SyntheticEngine()
    service = WorkerService(engine, WorkerSettings(role="generation"), Metrics())
    vllm = types.SimpleNamespace(TokensPrompt=dict)
    local = {kind: orjson.dumps({**orjson.loads(body), "model": engine.info.model}) for kind, body in bodies.items()}

    def to_vllm(body: bytes) -> Any:
        request = run_to_completion(service.prepare(parse_json_object(body), CompletionRequest)).request
        assert request.handoff is not None
        first = np.asarray(request.handoff.first_gen_tokens, dtype=np.int32)
        return _vllm_prompt(vllm, np.concatenate([request.prompt_token_ids_i32, first]))

    whole = to_vllm(local["array"])["prompt_token_ids"]
    if to_vllm(local["list"])["prompt_token_ids"] != whole:
        raise RuntimeError("the list and array bodies do not give vLLM the same prompt")
    prompt = np.asarray(whole, dtype=np.int32)
    timing = time_interleaved({"list": lambda: to_vllm(local["list"]), "array": lambda: to_vllm(local["array"]),
                               "tolist": lambda: _vllm_prompt(vllm, prompt)},
                              warmups=5, runs=settings.inprocess_runs, ops=settings.inprocess_ops)
    return {kind: {"us": t["ms"] * 1e3, "cpu_us": t["cpu_ms"] * 1e3} for kind, t in timing.items()}


# -- the phases ------------------------------------------------------------------------------------------------------
@contextlib.contextmanager
def orchestrator_in_front(processes: Processes, ctx: Server, gen: Server, protocol: str | None) -> Iterator[Server]:
    import yaml

    port = free_port()
    groups: dict[str, Any] = {"context_servers": {"urls": [ctx.url]}, "generation_servers": {"urls": [gen.url]}}
    if protocol is not None:
        for group in groups.values():
            group["protocol"] = protocol
    config = processes.log_dir / f"orchestrator-{port}.yaml"
    config.write_text(yaml.safe_dump({"hostname": "127.0.0.1", "port": port, "request_timeout_s": 600, **groups}))
    orchestrator = processes.disagg_serve(f"orchestrator-{port}", ["orchestrator", "--config", str(config)], port)
    try:
        wait_healthy([orchestrator], 120)
        yield orchestrator
    finally:
        processes.stop([orchestrator])


def run_phase(setup: str, processes: Processes, checkpoint: Path, model: str, settings: Settings,
              kv_root: Path) -> dict[str, Any]:
    ports = {name: free_port() for name in ("one", "p", "d")}
    log_dir = processes.log_dir
    phase: dict[str, Any] = {"setup": setup, "loadavg_before": loadavg()}
    started = time.perf_counter()
    print(f"[vllm_serving] {setup}: starting (load average {phase['loadavg_before']}) ...", file=sys.stderr,
          flush=True)
    if setup in (VLLM, AGGREGATED):
        argv = (vllm_api_server(checkpoint, model, ports["one"], None) if setup == VLLM
                else our_worker("both", ports["one"], None))
        with vllm_instances({"one": argv}, ports, log_dir) as servers:
            phase["startup_s"] = time.perf_counter() - started
            phase["points"] = latency(servers["one"].url, settings)
    else:
        connector = example_connector(Path(tempfile.mkdtemp(prefix="kv-", dir=kv_root)))
        specs = ({"p": our_worker("context", ports["p"], connector), "d": our_worker("generation", ports["d"],
                                                                                    connector)}
                 if setup == DISAGGREGATED else
                 {"p": vllm_api_server(checkpoint, model, ports["p"], connector),
                  "d": vllm_api_server(checkpoint, model, ports["d"], connector)})
        with vllm_instances(specs, ports, log_dir) as servers, \
                orchestrator_in_front(processes, servers["p"], servers["d"],
                                      None if setup == DISAGGREGATED else "vllm") as orchestrator:
            phase["startup_s"] = time.perf_counter() - started
            phase["points"] = latency(orchestrator.url, settings)
            phase["orchestrator_cpu"] = orchestrator_cpu(orchestrator, settings)
            if setup == DISAGGREGATED:
                phase["gen_cpu"] = []
                for size in settings.prompts:
                    bodies = gen_bodies(servers["p"].url, size, model)
                    process = gen_worker_cpu(servers["d"], bodies, settings)
                    tokens = len(orjson.loads(bodies["list"])["prompt_token_ids"])
                    phase["gen_cpu"].append({"prompt_tokens": tokens, "process": process,
                                             "in_process": gen_prompt_path_in_process(bodies, settings)})
                    print(f"[vllm_serving]   GEN CPU at {tokens} tokens: list {process['list']['cpu_ms']:.2f} / "
                          f"array {process['array']['cpu_ms']:.2f} ms/req", file=sys.stderr, flush=True)
    phase["loadavg_after"] = loadavg()
    phase["duration_s"] = time.perf_counter() - started
    return phase


def run(settings: Settings = FULL, partial: Path | None = None) -> dict[str, Any]:
    """Every phase in turn; with ``partial``, the result so far is written there after each phase."""
    from workers.engines.vllm.engine import resolve_model

    served = resolve_model(None, None)  # the packaged SmolLM2, converted once into a checkpoint folder
    checkpoint, model = served.folder, served.name
    result: dict[str, Any] = {"benchmark": "vllm_serving", "method": asdict(settings), "machine": machine_info(),
                              "phases": {}}
    started = time.perf_counter()
    with Processes() as processes, tempfile.TemporaryDirectory(prefix="vllm-bench-kv-") as kv_root:
        for setup in settings.setups:
            result["phases"][setup] = run_phase(setup, processes, checkpoint, model, settings, Path(kv_root))
            if partial is not None:
                write_json(partial, result)
    result["duration_s"] = time.perf_counter() - started
    result["loadavg_at_end"] = loadavg()
    return result


# -- reporting -------------------------------------------------------------------------------------------------------
def point(result: dict[str, Any], setup: str, words: int) -> dict[str, Any] | None:
    phase = result["phases"].get(setup)
    return next((p for p in phase["points"] if p["prompt_words"] == words), None) if phase else None


def latency_table(result: dict[str, Any]) -> str:
    rows = []
    sizes = result["method"]["prompts"]
    for words in sizes:
        base = point(result, VLLM, words)
        for setup in result["phases"]:
            found = point(result, setup, words)
            if found is None:
                continue
            rows.append([found["prompt_tokens"], setup, fmt(found["ttft_ms"], 0),
                         "–" if setup == VLLM or base is None else f"{fmt(ratio(found['ttft_ms'], base['ttft_ms']))}x",
                         fmt(found["first_gap_ms"], 0), fmt(found["decode_tokens_per_s"], 1),
                         fmt(found["steady_decode_tokens_per_s"], 1), len(found["runs"])])
    return markdown_table(["prompt tokens", "set-up", "TTFT p50 ms", "TTFT / vLLM server", "token 1→2 gap ms",
                           "decode tok/s (after token 1)", "steady decode tok/s (after token 2)", "runs"], rows)


def gen_cpu_table(result: dict[str, Any]) -> str:
    phase = result["phases"].get(DISAGGREGATED) or {}
    rows = []
    for cell in phase.get("gen_cpu", []):
        process, inproc = cell["process"], cell["in_process"]
        rows.append([cell["prompt_tokens"], fmt(process["list"]["cpu_ms"]), fmt(process["array"]["cpu_ms"]),
                     fmt(process["list"]["cpu_ms"] - process["array"]["cpu_ms"]), process["array"]["requests"],
                     fmt(process["list"]["wall_ms"], 0), fmt(process["array"]["wall_ms"], 0),
                     f"{process['list']['body_bytes'] / 1e3:.1f} / {process['array']['body_bytes'] / 1e3:.1f}",
                     fmt(inproc["list"]["us"], 0), fmt(inproc["array"]["us"], 0), fmt(inproc["tolist"]["us"], 1)])
    return markdown_table(["prompt tokens", "GEN process CPU ms/req, list", "array", "list − array",
                           "requests each", "wall ms/req list", "array", "body KB list / array",
                           "in-process µs, list path", "array path", "the adapter's tolist() alone"], rows)


def orchestrator_table(result: dict[str, Any]) -> str:
    rows = []
    for setup in (DISAGGREGATED, PD):
        cell = (result["phases"].get(setup) or {}).get("orchestrator_cpu")
        if cell:
            # A request here lasts ~a second (mock workers: milliseconds), so the background loops' idle CPU
            # (health checks, the loop-lag monitor) lands in the per-request figure; also shown net of it.
            net = cell["cpu_ms_per_request"] - cell["idle_cpu_ms_per_s"] * cell["wall_ms_per_request"] / 1e3
            rows.append([f"our orchestrator → {'our CTX + GEN on vLLM' if setup == DISAGGREGATED else 'vLLM P + D'}"
                         " (this run)", cell["prompt_tokens"], fmt(cell["cpu_ms_per_request"]), fmt(net),
                         fmt(cell["wall_ms_per_request"], 0), fmt(cell["idle_cpu_ms_per_s"]), cell["requests"]])
    for name, figures in QUOTED.items():
        rows.append([f"{name}: quoted from issue 14, mock workers, not this run",
                     ", ".join(f"{k:,}: {v}" for k, v in figures.items()), "–", "–", "–", "–", "–"])
    return markdown_table(["proxy", "prompt tokens", "CPU ms/req", "net of idle CPU ms/req", "wall ms/req",
                           "idle CPU ms/s", "requests"], rows)


def tables(result: dict[str, Any]) -> str:
    phases = result["phases"]
    loads = markdown_table(["phase", "load average before", "after", "start-up s", "phase s"],
                           [[s, p.get("loadavg_before"), p.get("loadavg_after"), fmt(p.get("startup_s"), 0),
                             fmt(p.get("duration_s"), 0)] for s, p in phases.items()])
    return "\n\n".join([latency_table(result), gen_cpu_table(result), orchestrator_table(result), loads])


def generated_block(result: dict[str, Any], plot: str) -> str:
    machine = result.get("machine", {})
    method = result["method"]
    note = (f"{machine.get('cpu_model')}, {machine.get('nproc')} cores, load average at start "
            f"{machine.get('loadavg_at_start')}, at end {result.get('loadavg_at_end')}; {result.get('mode', 'full')} "
            f"run, {fmt(result.get('duration_s', 0) / 60, 1)} min; {method['runs']} runs per point, "
            f"max_tokens {method['max_tokens']}, concurrency 1")
    return "\n".join([BEGIN, "", f"Measured on {note}.", "", tables(result), "", f"![vLLM serving]({plot})", "",
                      END])


def plot(result: dict[str, Any], path: Path) -> Path:
    from bench import plots

    return plots.vllm_serving_plot(result, path)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--quick", action="store_true", help="511 tokens only, one run each (a check, ~6 min)")
    parser.add_argument("--docs", action="store_true",
                        help="write docs/benchmarks/vllm_serving.{json,png} and the section of docs/benchmarks.md")
    parser.add_argument("--runs", type=int, default=None, help="requests per set-up and size (default 3)")
    parser.add_argument("--json", type=Path, default=None, help="also write the result here (and after each phase)")
    parser.add_argument("--from-json", type=Path, default=None,
                        help="run nothing: print (and with --docs, write) the tables and plot of an earlier result")
    args = parser.parse_args(argv)
    if args.from_json is not None:
        result = orjson.loads(args.from_json.read_bytes())
    else:
        from bench.vllm_processes import vllm_missing_reason

        missing = vllm_missing_reason()
        if missing:
            print(f"[vllm_serving] {missing}", file=sys.stderr)
            return 2
        settings = QUICK if args.quick else FULL
        if args.runs is not None:
            settings = replace(settings, runs=args.runs)
        result = run(settings, args.json)
        result["mode"] = "quick" if args.quick else "full"
    print(tables(result))
    if args.json:
        write_json(args.json, result)
    if args.docs:
        report.publish("vllm_serving", result, generated_block, plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
