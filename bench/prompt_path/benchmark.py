"""GEN's prompt path in-process: the list path against the array path and the physical floor.

``python -m bench.prompt_path``: for each prompt size the same generation_only body goes through GEN's own code as
a worker runs it (parse, ``WorkerService.prepare``, the reference adapter's submit encoding), once with a
``prompt_token_ids`` list and once with ``prompt_token_ids_b64``; the floor is what no implementation avoids for
the array body. Method: docs/benchmarks.md, "The prompt path".
"""

from __future__ import annotations

import functools
import gc
import pickle
import statistics
import time
import tracemalloc
from collections.abc import Callable, Coroutine
from typing import Any

import numpy as np
import orjson
import pybase64

from bench.driver.bodies import gen_body, random_tokens
from bench.driver.common import arguments
from bench.driver.report import print_and_save
from bench.prompt_path.report import tables
from entrypoints.bench.statistics import ratio
from frontend.http import parse_json_object, validate_wire
from frontend.metrics import Metrics
from frontend.openai_models import CompletionRequest, refuse_unsupported_parameters
from workers.engines.reference.frames import submit_frame
from workers.engines.reference.ipc import encode_frame
from workers.engines.request import GenerationRequest
from workers.engines.synthetic import SyntheticEngine
from workers.request_builder import handoff_from, phase_of, prepare_prompt, resolve_max_tokens, sampling_params_from
from workers.service import WorkerService
from workers.settings import WorkerSettings

SIZES = (40_000, 131_072, 290_000)
PATHS = ("list", "array", "floor")


def run_to_completion(coroutine: Coroutine[Any, Any, Any]) -> Any:
    """Drive a coroutine that never really suspends (the list and array paths await nothing) without a loop."""
    try:
        coroutine.send(None)
    except StopIteration as done:
        return done.value
    coroutine.close()
    raise RuntimeError("the coroutine suspended: this path is not synchronous")


class GenPath:
    """The GEN worker's own code from HTTP body bytes to the engine-core frame."""

    def __init__(self) -> None:
        self.engine = SyntheticEngine()
        self.service = WorkerService(self.engine, WorkerSettings(role="generation"), Metrics())

    def __call__(self, body: bytes) -> tuple[GenerationRequest, list[bytes | memoryview]]:
        return self.from_parsed(parse_json_object(body))

    def from_parsed(self, payload: dict[str, Any]) -> tuple[GenerationRequest, list[bytes | memoryview]]:
        prepared = run_to_completion(self.service.prepare(payload, CompletionRequest))
        header, data = submit_frame(prepared.request)
        return prepared.request, encode_frame(header, data)


def floor(body: bytes) -> np.ndarray:
    return floor_from_parsed(orjson.loads(body))


def floor_from_parsed(payload: dict[str, Any]) -> np.ndarray:
    return np.frombuffer(pybase64.b64decode(payload["prompt_token_ids_b64"], validate=True), dtype="<i4")


def time_per_op(operation: Callable[[], Any], warmups: int, runs: int, ops: int) -> dict[str, Any]:
    """Median over ``runs`` runs of ``ops`` operations, per operation; wall (perf_counter) and CPU (thread)."""
    return time_interleaved({"op": operation}, warmups, runs, ops)["op"]


def time_interleaved(operations: dict[str, Callable[[], Any]], warmups: int, runs: int,
                     ops: int) -> dict[str, dict[str, Any]]:
    """``time_per_op`` for several operations at once, their runs taken in turn (list, array, floor, list, ...),
    so that drift of the machine or of the allocator's state over the measurement lands on every path alike."""
    for operation in operations.values():
        for _ in range(warmups):
            operation()
    wall: dict[str, list[float]] = {name: [] for name in operations}
    cpu: dict[str, list[float]] = {name: [] for name in operations}
    for _ in range(runs):
        for name, operation in operations.items():
            w0, c0 = time.perf_counter(), time.thread_time()
            for _ in range(ops):
                operation()
            c1, w1 = time.thread_time(), time.perf_counter()
            wall[name].append((w1 - w0) / ops)
            cpu[name].append((c1 - c0) / ops)
    return {
        name: {
            "ms": statistics.median(wall[name]) * 1e3,
            "cpu_ms": statistics.median(cpu[name]) * 1e3,
            "runs_ms": [x * 1e3 for x in wall[name]],
            "min_ms": min(wall[name]) * 1e3,
        }
        for name in operations
    }


def traced_peak(operation: Callable[[], Any]) -> tuple[int, int]:
    """(peak, retained) bytes Python allocated during ``operation``, relative to before it."""
    gc.collect()
    tracemalloc.start()
    try:
        before, _ = tracemalloc.get_traced_memory()
        tracemalloc.reset_peak()
        result = operation()
        current, peak = tracemalloc.get_traced_memory()
        del result
    finally:
        tracemalloc.stop()
    return peak - before, current - before


def allocation(path: str, body: bytes, gen: GenPath, tokens: int) -> dict[str, Any]:
    whole: Callable[[], Any] = (lambda: floor(body)) if path == "floor" else (lambda: gen(body))
    step: Callable[[dict[str, Any]], Any] = floor_from_parsed if path == "floor" else gen.from_parsed
    whole()  # first-call caches (pydantic, numpy) are not the request's cost
    peak_total, _ = traced_peak(whole)
    parsed = orjson.loads(body)
    peak_beyond, retained_beyond = traced_peak(lambda: step(parsed))
    parse_peak, parsed_size = traced_peak(lambda: orjson.loads(body))
    return {
        "peak_total_bytes": peak_total,
        "peak_total_per_token": peak_total / tokens,
        "peak_beyond_body_bytes": peak_beyond,
        "peak_beyond_body_per_token": peak_beyond / tokens,
        "retained_beyond_body_per_token": retained_beyond / tokens,
        "parsed_body_per_token": parsed_size / tokens,
        "orjson_parse_peak_per_token": parse_peak / tokens,
    }


def stage_breakdown(body: bytes, gen: GenPath, warmups: int, runs: int, ops: int) -> dict[str, float]:
    """WorkerService.prepare's steps timed one by one (the project's functions, in its order)."""
    service = gen.service
    info = gen.engine.info
    payload = parse_json_object(body)
    refuse_unsupported_parameters(payload)
    wire = validate_wire(CompletionRequest, payload)
    sampling = sampling_params_from(wire, info)
    prompt = run_to_completion(prepare_prompt(wire, sampling, info, gen.engine.get_tokenizer()))
    request = run_to_completion(service.prepare(payload, CompletionRequest)).request

    def validate() -> Any:
        refuse_unsupported_parameters(payload)
        return validate_wire(CompletionRequest, payload)

    def build_request() -> Any:
        resolved = resolve_max_tokens(wire, sampling_params_from(wire, info), int(prompt.tokens.size), info)
        handoff = handoff_from(wire.disaggregated_params, info.vocab_size)
        if prompt.token_list is not None:
            return GenerationRequest.from_token_list("x", prompt.token_list, prompt.tokens, resolved,
                                                     phase=phase_of(wire.disaggregated_params), handoff=handoff)
        return GenerationRequest("x", prompt.tokens, resolved, phase=phase_of(wire.disaggregated_params),
                                 prompt_path=prompt.path, handoff=handoff)

    stages: dict[str, Callable[[], Any]] = {
        "orjson parse": lambda: parse_json_object(body),
        "wire validation": validate,
        "prepare_prompt": lambda: run_to_completion(prepare_prompt(wire, sampling, info, gen.engine.get_tokenizer())),
        "GenerationRequest": build_request,
        "submit encoding": lambda: encode_frame(*submit_frame(request)),
    }
    return {name: time_per_op(op, warmups, runs, ops)["ms"] for name, op in stages.items()}


def pickle_check(gen: GenPath, bodies: dict[str, bytes], tokens: np.ndarray) -> dict[str, Any]:
    """GenerationRequest pickles as int32 bytes; round trips give the very same token list."""
    expected = tokens.tolist()
    report: dict[str, Any] = {}
    for path in ("list", "array"):
        request, _ = gen(bodies[path])
        blob = pickle.dumps(request, protocol=pickle.HIGHEST_PROTOCOL)
        list_built_by_pickling = request.prompt_list_built if path == "array" else None
        clone = pickle.loads(blob)
        twice = pickle.loads(pickle.dumps(clone, protocol=pickle.HIGHEST_PROTOCOL))
        timing = time_per_op(functools.partial(_pickle_round_trip, request), 2, 5, 5)
        report[path] = {
            "identical_tokens": clone.prompt_token_ids == expected and twice.prompt_token_ids == expected,
            "pickled_bytes": len(blob),
            "pickled_bytes_per_token": len(blob) / tokens.size,
            "array_path_built_list_when_pickled": list_built_by_pickling,
            "round_trip_ms": timing["ms"],
        }
    plain = time_per_op(lambda: pickle.loads(pickle.dumps(expected, protocol=pickle.HIGHEST_PROTOCOL)), 2, 5, 5)
    report["plain_list_round_trip_ms"] = plain["ms"]
    report["plain_list_pickled_bytes"] = len(pickle.dumps(expected, protocol=pickle.HIGHEST_PROTOCOL))
    return report


def bench_size(tokens_count: int, warmups: int, runs: int, ops: int, stages: bool = True) -> dict[str, Any]:
    tokens = random_tokens(tokens_count, seed=tokens_count)
    bodies = {"list": gen_body(tokens, "list"), "array": gen_body(tokens, "array")}
    bodies["floor"] = bodies["array"]
    gen = GenPath()
    # Both paths must give the engine the very same prompt before any figure means anything.
    for path in ("list", "array"):
        request, frame = gen(bodies[path])
        assert np.array_equal(request.prompt_token_ids_i32, tokens), path
        assert bytes(frame[2]) == tokens.tobytes(), path
    assert np.array_equal(floor(bodies["floor"]), tokens)

    ops_by_path: dict[str, Callable[[], Any]] = {
        "list": lambda: gen(bodies["list"]),
        "array": lambda: gen(bodies["array"]),
        "floor": lambda: floor(bodies["floor"]),
    }
    timing = time_interleaved(ops_by_path, warmups, runs, ops)
    alloc = {path: allocation(path, bodies[path], gen, tokens_count) for path in PATHS}
    result: dict[str, Any] = {
        "tokens": tokens_count,
        "body_bytes": {"list": len(bodies["list"]), "array": len(bodies["array"])},
        "timing": timing,
        "speedup_list_over_array": ratio(timing["list"]["ms"], timing["array"]["ms"]),
        "array_over_floor": ratio(timing["array"]["ms"], timing["floor"]["ms"]),
        "cpu_speedup_list_over_array": ratio(timing["list"]["cpu_ms"], timing["array"]["cpu_ms"]),
        "cpu_array_over_floor": ratio(timing["array"]["cpu_ms"], timing["floor"]["cpu_ms"]),
        "allocation": alloc,
        "pickle": pickle_check(gen, bodies, tokens),
    }
    if stages:
        stage_warmups, stage_runs = min(warmups, 3), min(runs, 5)
        result["stages_ms"] = {path: stage_breakdown(bodies[path], gen, stage_warmups, stage_runs, ops)
                               for path in ("list", "array")}
    return result


def run(sizes: tuple[int, ...] = SIZES, warmups: int = 5, runs: int = 9, ops: int = 10,
        stages: bool = True) -> dict[str, Any]:
    return {
        "benchmark": "prompt_path",
        "method": {"warmups": warmups, "runs": runs, "ops_per_run": ops, "statistic": "median run / ops"},
        "sizes": [bench_size(n, warmups, runs, ops, stages) for n in sizes],
    }


def _pickle_round_trip(request: GenerationRequest) -> object:
    return pickle.loads(pickle.dumps(request, protocol=pickle.HIGHEST_PROTOCOL))


def main(argv: list[str] | None = None) -> int:
    parser = arguments(__doc__)
    parser.add_argument("--sizes", type=int, nargs="+", default=list(SIZES))
    parser.add_argument("--runs", type=int, default=9)
    parser.add_argument("--json", default=None, help="write the result here")
    args = parser.parse_args(argv)
    result = run(tuple(args.sizes), runs=args.runs)
    return print_and_save(result, tables, args.json)
