"""What bench.vllm_serving measures in each phase: TTFT and decode rate of one streaming client, the orchestrator's
CPU per request, and GEN's CPU per request on the array path against the list path (in its process and in
this one). The set-ups and the run's settings are named here."""

from __future__ import annotations

import statistics
import sys
import time
import types
from dataclasses import dataclass
from typing import Any

import httpx
import numpy as np
import orjson
import pybase64

from bench.driver.common import Server, http_get
from bench.driver.machine import cpu_seconds
from bench.driver.report import fmt
from bench.reference import _WORDS, stream_once

VLLM = "vLLM server"
AGGREGATED = "ours, aggregated"
DISAGGREGATED = "ours, CTX + GEN"
PD = "ours in front of vLLM P/D"
SETUPS = (VLLM, AGGREGATED, DISAGGREGATED, PD)


@dataclass(frozen=True)
class Settings:
    # One under 512 and 2,048: with ExampleConnector a CTX prompt of a multiple of 128 tokens kills GEN's engine
    # core (GEN's prompt is CTX's plus one token; the connector finds KV by the prompt less its last token cut to
    # whole blocks, then loads it under the whole prompt cut to whole blocks: another folder, FileNotFoundError).
    prompts: tuple[int, ...] = (511, 2_047)
    runs: int = 3
    max_tokens: int = 32
    cost_prompt: int = 1_024  # the orchestrator's CPU: orchestrator_cost's smallest prompt
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
    and the bodies are re-encoded with its model name); ``vllm_prompt`` is the adapter's own function, given a
    ``TokensPrompt`` that is a plain dict (vLLM's is a TypedDict: a dict too).
    """
    from bench.prompt_path.benchmark import run_to_completion, time_interleaved
    from frontend.http import parse_json_object
    from frontend.metrics import Metrics
    from frontend.openai_models import CompletionRequest
    from workers.engines.synthetic import SyntheticEngine
    from workers.engines.vllm.vllm_api import vllm_prompt
    from workers.service import WorkerService
    from workers.settings import WorkerSettings

    engine = SyntheticEngine()
    service = WorkerService(engine, WorkerSettings(role="generation"), Metrics())
    vllm = types.SimpleNamespace(TokensPrompt=dict)
    local = {kind: orjson.dumps({**orjson.loads(body), "model": engine.info.model}) for kind, body in bodies.items()}

    def to_vllm(body: bytes) -> Any:
        request = run_to_completion(service.prepare(parse_json_object(body), CompletionRequest)).request
        assert request.handoff is not None
        first = np.asarray(request.handoff.first_gen_tokens, dtype=np.int32)
        return vllm_prompt(vllm, np.concatenate([request.prompt_token_ids_i32, first]))

    whole = to_vllm(local["array"])["prompt_token_ids"]
    if to_vllm(local["list"])["prompt_token_ids"] != whole:
        raise RuntimeError("the list and array bodies do not give vLLM the same prompt")
    prompt = np.asarray(whole, dtype=np.int32)
    timing = time_interleaved({"list": lambda: to_vllm(local["list"]), "array": lambda: to_vllm(local["array"]),
                               "tolist": lambda: vllm_prompt(vllm, prompt)},
                              warmups=5, runs=settings.inprocess_runs, ops=settings.inprocess_ops)
    return {kind: {"us": t["ms"] * 1e3, "cpu_us": t["cpu_ms"] * 1e3} for kind, t in timing.items()}
