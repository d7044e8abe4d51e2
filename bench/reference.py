"""The reference engine (SmolLM2-135M on the CPU), disaggregated against aggregated.

``python -m bench.reference``: CTX + GEN behind the orchestrator against one ``--role both`` worker, all with
``--blas-threads 1`` (prefill bitwise equal, outputs checked identical), one client alternating the set-ups. The
KV hand-off shows as the gap between the first and second token, reported apart. Method: docs/benchmarks.md, "The
reference engine".
"""

from __future__ import annotations

import itertools
import statistics
import sys
import time
from dataclasses import dataclass
from typing import Any

import httpx
import orjson

from bench.driver.common import (
    Processes,
    Server,
    arguments,
    free_port,
    http_get,
    orchestrator_config,
    wait_healthy,
    worker_args,
)
from bench.driver.report import fmt, markdown_table, print_and_save

PROMPT_TOKENS = (128, 512, 2048)
MAX_TOKENS = 16
_WORDS = ("the", "of", "and", "to", "in", "is", "was", "for", "that", "with", "on", "as", "by", "at", "from",
          "this", "it", "an", "are", "be", "or", "which", "his", "not", "have", "one", "had", "but", "were", "all")


def prompt_of(words: int) -> str:
    """Common English words, one token each with their leading space in SmolLM2's vocabulary (checked by usage)."""
    return " ".join(_WORDS[(i * 7 + i // 30) % len(_WORDS)] for i in range(words))


def stream_once(client: httpx.Client, url: str, model: str, prompt: str, max_tokens: int) -> dict[str, Any]:
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}
    arrivals: list[float] = []
    text_parts: list[str] = []
    usage: dict[str, int] = {}
    buffer = b""
    started = time.perf_counter()
    with client.stream("POST", url + "/v1/completions", content=orjson.dumps(body),
                       headers={"Content-Type": "application/json"}) as response:
        if response.status_code != 200:
            raise RuntimeError(f"{url} answered {response.status_code}: {response.read()[:300]!r}")
        for chunk in response.iter_raw():
            now = time.perf_counter()
            buffer += chunk
            *frames, buffer = buffer.split(b"\n\n")
            for frame in frames:
                if not frame.startswith(b"data: ") or frame == b"data: [DONE]":
                    continue
                payload = orjson.loads(frame[6:])
                if payload.get("error"):
                    raise RuntimeError(f"stream error: {payload['error']}")
                if payload.get("usage"):
                    usage = payload["usage"]
                for choice in payload.get("choices") or ():
                    if choice.get("text"):
                        arrivals.append(now)
                        text_parts.append(choice["text"])
    if not arrivals:
        raise RuntimeError("the stream carried no text")
    completion_tokens = int(usage.get("completion_tokens", len(arrivals)))
    gaps = [(b - a) * 1e3 for a, b in itertools.pairwise(arrivals)]
    ttft = arrivals[0] - started
    decode_span = arrivals[-1] - arrivals[0]
    steady_span = arrivals[-1] - arrivals[1] if len(arrivals) > 2 else 0.0
    return {
        "prompt_tokens": int(usage.get("prompt_tokens", 0)),
        "completion_tokens": completion_tokens,
        "text_frames": len(arrivals),
        "ttft_ms": ttft * 1e3,
        "itl_ms_median": statistics.median(gaps) if gaps else None,
        "itl_ms_mean": statistics.fmean(gaps) if gaps else None,
        "decode_tokens_per_s": (completion_tokens - 1) / decode_span if decode_span > 0 else None,
        "first_gap_ms": gaps[0] if gaps else None,
        "steady_itl_ms": statistics.median(gaps[1:]) if len(gaps) > 1 else None,
        "steady_decode_tokens_per_s": (len(arrivals) - 2) / steady_span if steady_span > 0 else None,
        "prefill_tokens_per_s": int(usage.get("prompt_tokens", 0)) / ttft if ttft > 0 else None,
        "total_ms": (time.perf_counter() - started) * 1e3,
        "text": "".join(text_parts),
    }


def kv_bytes_per_token(model_path: str | None = None) -> int | None:
    """Bytes of float32 K and V per prompt token in the reference hand-off, from the GGUF file's header."""
    try:
        from gguf import GGUFReader

        from workers.engines.reference.model_file import default_model_path

        reader = GGUFReader(model_path or default_model_path())

        def field(key: str) -> int:
            found = reader.get_field(key)
            if found is None:
                raise KeyError(key)
            return int(found.contents())

        heads = field("llama.attention.head_count")
        kv_heads = reader.get_field("llama.attention.head_count_kv")
        n_kv = int(kv_heads.contents()) if kv_heads is not None else heads
        return field("llama.block_count") * n_kv * (field("llama.embedding_length") // heads) * 4 * 2
    except Exception:  # only a label for the table: never fail the benchmark over it
        return None


def _median_of(runs: list[dict[str, Any]], key: str) -> float | None:
    values = [r[key] for r in runs if r.get(key) is not None]
    return statistics.median(values) if values else None


@dataclass(frozen=True)
class ReferenceSystem:
    """The reference engine served both ways on one machine: one aggregated worker, and CTX + GEN workers behind
    an orchestrator."""

    both: Server
    ctx: Server
    gen: Server
    orchestrator: Server
    model: str


def start_reference_system(processes: Processes, worker_extra: list[str], startup_timeout_s: float
                           ) -> ReferenceSystem:
    ports = {name: free_port() for name in ("ctx", "gen", "both", "orchestrator")}
    ctx = processes.disagg_serve("ctx", worker_args("context", "reference", ports["ctx"], *worker_extra),
                                 ports["ctx"])
    gen = processes.disagg_serve("gen", worker_args("generation", "reference", ports["gen"], *worker_extra),
                                 ports["gen"])
    both = processes.disagg_serve("both", worker_args("both", "reference", ports["both"], *worker_extra),
                                  ports["both"])
    wait_healthy([ctx, gen, both], startup_timeout_s)
    config = orchestrator_config(processes.log_dir / "orchestrator.yaml", ports["orchestrator"], [ctx.url],
                                 [gen.url])
    orchestrator = processes.disagg_serve("orchestrator", ["orchestrator", "--config", str(config)],
                                          ports["orchestrator"])
    wait_healthy([orchestrator], startup_timeout_s)
    model = str(orjson.loads(http_get(both.url, "/v1/models")[1])["data"][0]["id"])
    return ReferenceSystem(both, ctx, gen, orchestrator, model)


def run(prompt_tokens: tuple[int, ...] = PROMPT_TOKENS, runs: int = 2, max_tokens: int = MAX_TOKENS,
        startup_timeout_s: float = 300.0, model_path: str | None = None) -> dict[str, Any]:
    """``model_path`` None serves SmolLM2 (the figures); the smoke test passes a tiny random GGUF, which exercises
    the same processes, streams and bookkeeping without three real-model loads."""
    points: list[dict[str, Any]] = []
    with Processes() as processes:
        started = time.perf_counter()
        extra = ["--blas-threads", "1", *(["--model", model_path] if model_path else [])]
        system = start_reference_system(processes, extra, startup_timeout_s)
        load_s = time.perf_counter() - started
        model = system.model
        targets = {"disaggregated": system.orchestrator.url, "aggregated": system.both.url}
        with httpx.Client(timeout=httpx.Timeout(300.0, connect=10.0)) as client:
            for url in targets.values():  # warm-up: first-call costs (allocations, BLAS) are not the figure
                stream_once(client, url, model, prompt_of(16), 4)
            for words in prompt_tokens:
                prompt = prompt_of(words)  # one token per word (no BOS on completions); usage reports the count
                samples: dict[str, list[dict[str, Any]]] = {mode: [] for mode in targets}
                for _ in range(runs):
                    for mode, url in targets.items():
                        samples[mode].append(stream_once(client, url, model, prompt, max_tokens))
                point: dict[str, Any] = {"prompt_words": words}
                for mode, mode_runs in samples.items():
                    point[mode] = {
                        "prompt_tokens": mode_runs[0]["prompt_tokens"],
                        "completion_tokens": mode_runs[0]["completion_tokens"],
                        "ttft_ms": _median_of(mode_runs, "ttft_ms"),
                        "itl_ms": _median_of(mode_runs, "itl_ms_median"),
                        "decode_tokens_per_s": _median_of(mode_runs, "decode_tokens_per_s"),
                        "prefill_tokens_per_s": _median_of(mode_runs, "prefill_tokens_per_s"),
                        "first_gap_ms": _median_of(mode_runs, "first_gap_ms"),
                        "steady_itl_ms": _median_of(mode_runs, "steady_itl_ms"),
                        "steady_decode_tokens_per_s": _median_of(mode_runs, "steady_decode_tokens_per_s"),
                        "runs": [{k: v for k, v in r.items() if k != "text"} for r in mode_runs],
                    }
                texts = {r["text"] for mode_runs in samples.values() for r in mode_runs}
                point["identical_output"] = len(texts) == 1
                kv_per_token = kv_bytes_per_token(model_path)
                if kv_per_token is not None:
                    point["kv_handoff_mb"] = kv_per_token * point["aggregated"]["prompt_tokens"] / 1e6
                points.append(point)
                print(f"[reference] prompt {point['aggregated']['prompt_tokens']:>5} tokens: TTFT agg "
                      f"{point['aggregated']['ttft_ms']:.0f} ms / disagg {point['disaggregated']['ttft_ms']:.0f} ms, "
                      f"decode agg {fmt(point['aggregated']['decode_tokens_per_s'], 1)} / disagg "
                      f"{fmt(point['disaggregated']['decode_tokens_per_s'], 1)} tok/s, identical output "
                      f"{point['identical_output']}", file=sys.stderr, flush=True)
    return {
        "benchmark": "reference",
        "method": {"runs": runs, "max_tokens": max_tokens, "blas_threads": 1, "statistic": "median of runs",
                   "temperature": 0, "ignore_eos": True, "model": model, "startup_s": load_s},
        "points": points,
    }


def tables(result: dict[str, Any]) -> str:
    rows = []
    for p in result["points"]:
        a, d = p["aggregated"], p["disaggregated"]
        rows.append([
            a["prompt_tokens"], a["completion_tokens"],
            fmt(a["ttft_ms"], 0), fmt(d["ttft_ms"], 0),
            fmt(a["prefill_tokens_per_s"], 0), fmt(d["prefill_tokens_per_s"], 0),
            fmt(a.get("first_gap_ms"), 0), fmt(d.get("first_gap_ms"), 0), fmt(p.get("kv_handoff_mb"), 1),
            fmt(a.get("steady_itl_ms"), 1), fmt(d.get("steady_itl_ms"), 1),
            fmt(a.get("steady_decode_tokens_per_s"), 1), fmt(d.get("steady_decode_tokens_per_s"), 1),
            fmt(a["decode_tokens_per_s"], 1), fmt(d["decode_tokens_per_s"], 1),
            str(p["identical_output"]),
        ])
    return markdown_table(
        ["prompt tokens", "output tokens", "TTFT agg ms", "TTFT disagg ms", "prompt tok/s agg (prompt/TTFT)",
         "prompt tok/s disagg", "token 1→2 gap agg ms", "token 1→2 gap disagg ms (KV hand-off)", "KV MB",
         "steady ITL agg ms", "steady ITL disagg ms", "steady decode tok/s agg", "steady decode tok/s disagg",
         "decode tok/s agg (all gaps)", "decode tok/s disagg (all gaps)", "identical output"], rows)


def main(argv: list[str] | None = None) -> int:
    parser = arguments(__doc__)
    parser.add_argument("--prompt-tokens", type=int, nargs="+", default=list(PROMPT_TOKENS))
    parser.add_argument("--runs", type=int, default=2)
    parser.add_argument("--max-tokens", type=int, default=MAX_TOKENS)
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    result = run(tuple(args.prompt_tokens), args.runs, args.max_tokens)
    return print_and_save(result, tables, args.json)


if __name__ == "__main__":
    sys.exit(main())
