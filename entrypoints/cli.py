"""``disagg-serve``: the one command line for laptops, containers and Kubernetes alike.

    disagg-serve worker --role context|generation|both --engine reference|synthetic --host H --port P
    disagg-serve orchestrator --config FILE.yaml [--host H] [--port P]
    disagg-serve up [--engine ...] [--host 127.0.0.1] [--port 8000] [--metadata-only]
    disagg-serve bench --url URL [--prompt-tokens N | --prompts FILE.jsonl] [--concurrency C | --request-rate R]
"""

from __future__ import annotations

import argparse
import logging
import os
import socket
import sys
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path
from typing import Any

from entrypoints.arguments import build_parser
from entrypoints.http import STARTUP_FAILED, serve
from entrypoints.http.limits import (
    DEFAULT_MAX_BODY_READS_PER_CLIENT,
    DEFAULT_WORKER_MAX_BODY_READS_PER_CLIENT,
    ClientLimits,
)
from entrypoints.http.listener import address, bound_socket, inherited_socket
from frontend import tracing
from frontend.internal_secret import (
    InternalSecret,
    InternalSecretError,
    internal_secret_from_env,
    load_token_file,
    warn_if_exposed,
    write_token_file,
)
from frontend.logging_setup import configure_logging
from frontend.trtllm.auth import trtllm_auth_key_from_env

logger = logging.getLogger("disagg_serve")



def _listener(args: argparse.Namespace, host: str, port: int) -> socket.socket | None:
    """The socket to serve on, bound now, before the engine or the app starts (entrypoints/http/listener.py):
    the one ``--listen-fd`` names, else ``host:port``. None, with the reason printed, where it cannot be had."""
    try:
        listener = inherited_socket(args.listen_fd) if args.listen_fd is not None else \
            bound_socket(host, port, reuse_port=args.reuse_port)
    except ValueError as exc:
        print(f"disagg-serve: {exc}", file=sys.stderr)
        return None
    except OSError as exc:
        print(f"disagg-serve: cannot listen on {host}:{port}: {exc.strerror}", file=sys.stderr)
        return None
    # vLLM forks its engine core (no exec, so close-on-exec cannot help): a forked child must not keep the port
    # bound, or a worker that dies leaves a port that accepts connections no one answers.
    os.register_at_fork(after_in_child=listener.close)
    return listener


def _serve(app: Any, args: argparse.Namespace, listener: socket.socket,
           before_stop: Callable[[], Awaitable[object]] | None = None) -> int:
    """Serve ``app`` on ``listener`` (``entrypoints.http.serve``) with the limits the command line sets against
    slow and hostile clients (docs/http.md): ``--max-head-bytes``, ``--header-timeout-s``, ``--body-timeout-s``,
    ``--body-min-rate``, ``--max-body-reads-per-client`` (by default higher on a worker, whose clients are its
    orchestrators) and ``--client-send-timeout-s``."""
    per_client = args.max_body_reads_per_client
    if per_client is None:
        per_client = DEFAULT_WORKER_MAX_BODY_READS_PER_CLIENT if args.command == "worker" else \
            DEFAULT_MAX_BODY_READS_PER_CLIENT
    limits = ClientLimits(args.header_timeout_s, args.body_timeout_s, args.max_head_bytes, args.body_min_rate,
                          per_client)
    return serve(app, listener, limits, send_timeout_s=args.client_send_timeout_s, log_level=args.log_level,
                 before_stop=before_stop)


def _internal_secret(command: str) -> tuple[bool, InternalSecret | None]:
    """The deployment secret from ``DISAGG_INTERNAL_TOKEN``, read once at start-up: (False, None), with the reason
    printed, for one too short to use."""
    try:
        load_token_file()
        return True, internal_secret_from_env()
    except InternalSecretError as exc:
        print(f"disagg-serve {command}: {exc}", file=sys.stderr)
        return False, None


def _supervise(args: argparse.Namespace, argv: Sequence[str], engine_options: Any = None) -> int:
    """``--api-workers N`` with N > 1: this process supervises N front ends (and the shared engine core)."""
    from entrypoints.supervisor import FrontEndSupervisor

    if args.port == 0:
        print("disagg-serve: --api-workers needs a fixed --port (the front ends share it)", file=sys.stderr)
        return 2
    if args.listen_fd is not None:
        print("disagg-serve: --listen-fd serves one front end (--api-workers 1)", file=sys.stderr)
        return 2
    core_command_for, core_env = None, None
    if engine_options is not None:
        from workers.engines.factory import reference_options
        from workers.engines.reference.options import core_command
        from workers.engines.reference.options import core_env as make_core_env

        options = reference_options(engine_options)
        core_command_for = lambda path: core_command(options, path)  # noqa: E731 - a one-line closure
        core_env = make_core_env(options)
    return FrontEndSupervisor(argv, args.api_workers, core_command_for, core_env,
                              drain_timeout_s=getattr(args, "drain_timeout_s", None)).run()


def run_worker(args: argparse.Namespace, argv: Sequence[str]) -> int:
    from workers.engines.factory import EngineOptions, create_engine
    from workers.engines.options import SimulatedConfig, TokenizeConfig, VllmConfig
    from workers.engines.synthetic import SyntheticConfig
    from workers.registration import Registration
    from workers.server import create_worker_app
    from workers.settings import WorkerSettings
    from workers.trtllm.settings import lifecycle_settings_from_env

    options = EngineOptions(
        model_path=args.model,
        served_model_name=args.served_model_name,
        kv_block_reuse=args.kv_block_reuse,
        prompt_tokens_in_handoff=not args.no_prompt_tokens_in_handoff,
        kv_host=args.kv_host or args.host,
        kv_advertise_host=args.kv_advertise_host,
        kv_port=args.kv_port,
        kv_ttl_s=args.kv_ttl_s,
        kv_load_failure_policy=args.kv_load_failure_policy,
        blas_threads=args.blas_threads,
        core_socket=args.engine_core_socket,
        tokenizer=args.tokenizer,
        tokenize=TokenizeConfig(cache_bytes=int(args.tokenize_cache_mb * 2**20), backend=args.tokenizer_backend,
                                threads=args.tokenize_threads),
        synthetic=SyntheticConfig(
            time_to_first_token_s=args.synthetic_ttft_ms / 1000,
            inter_token_latency_s=args.synthetic_itl_ms / 1000,
            output_tokens=args.synthetic_output_tokens,
        ),
        simulated=SimulatedConfig(
            prefill_base_s=args.simulated_prefill_base_ms / 1000,
            prefill_tokens_per_s=args.simulated_prefill_tokens_per_s,
            prefix_cache_tokens=args.simulated_prefix_cache_tokens,
            inter_token_latency_s=args.simulated_itl_ms / 1000,
        ),
        vllm=VllmConfig(kv_transfer_config=args.kv_transfer_config, max_model_len=args.max_model_len,
                        max_num_seqs=args.max_num_seqs, dtype=args.dtype,
                        kv_cache_memory_bytes=args.kv_cache_memory_bytes,
                        gpu_memory_utilization=args.gpu_memory_utilization,
                        engines_on_host=args.engines_on_host or 1),
    )
    if args.api_workers > 1 and args.engine == "vllm":
        # Each front-end process would start its own AsyncLLM, i.e. a whole vLLM instance with its own KV cache.
        print("disagg-serve: --engine vllm serves one front end per vLLM instance (--api-workers 1)", file=sys.stderr)
        return 2
    try:
        lifecycle = lifecycle_settings_from_env(os.environ, args.lifecycle_protocol_version,
                                                grant_ttl_s=args.generation_grant_ttl_s,
                                                artifact_ttl_s=args.artifact_ttl_s,
                                                max_live_grants=args.max_concurrent_requests)
    except ValueError as exc:
        print(f"disagg-serve: {exc}", file=sys.stderr)
        return 2
    if args.api_workers > 1 and lifecycle.enabled:
        # Grants and artifacts live in one process's memory: a renew reaching another front end would find none.
        print("disagg-serve: lifecycle protocol v1 needs --api-workers 1", file=sys.stderr)
        return 2
    usable, secret = _internal_secret("worker")
    if not usable:
        return 2
    if args.api_workers > 1:
        return _supervise(args, argv, options if args.engine == "reference" else None)
    warn_if_exposed(secret, args.host, "this worker")
    listener = _listener(args, args.host, args.port)
    if listener is None:
        return STARTUP_FAILED
    args.port = address(listener)[1]  # the port it got, for --port 0 (what --register advertises)
    engine = create_engine(args.engine, options)
    events, replay = kv_events_endpoints(args)
    settings = WorkerSettings(role=args.role, max_body_bytes=args.max_body_bytes,
                              max_concurrent_requests=args.max_concurrent_requests,
                              admin_key=args.admin_key or None,
                              kv_events_endpoint=events, kv_events_replay_endpoint=replay, lifecycle=lifecycle,
                              internal_secret=secret, trtllm_auth_key=trtllm_auth_key_from_env(),
                              advertise_url=args.advertise_url or None, drain_timeout_s=args.drain_timeout_s,
                              tool_call_parser=args.tool_call_parser)
    registration = None
    if args.register:
        advertise = args.advertise_url or f"http://{args.host}:{args.port}"
        registration = Registration(args.register, advertise, args.role, args.admin_key)
    tracing.configure(f"disagg-serve-{args.role}", args.role)
    app = create_worker_app(engine, settings, registration=registration)
    return _serve(app, args, listener, before_stop=app.state.drain.run)  # SIGTERM drains first (workers/drain.py)


def kv_events_endpoints(args: argparse.Namespace) -> tuple[str | None, str | None]:
    """The worker's KV-event endpoints (``--kv-events-endpoint``, ``--kv-events-replay-endpoint``): each
    ``tcp://HOST:0`` unless given, None for ``off``. One of several front ends (``--api-workers``) publishes
    none: each would see only its own share of the requests, and its card would name one front end's stream."""
    if args.reuse_port:
        if args.kv_events_endpoint not in (None, "off"):
            logger.warning("--kv-events-endpoint is ignored with --api-workers > 1: no KV events are published")
        return None, None
    host = f"[{args.host}]" if ":" in args.host else args.host
    default = f"tcp://{host}:0"

    def chosen(value: str | None) -> str | None:
        return None if value == "off" else value or default

    events = chosen(args.kv_events_endpoint)
    return events, chosen(args.kv_events_replay_endpoint) if events is not None else None


def run_orchestrator(args: argparse.Namespace, argv: Sequence[str]) -> int:
    from frontend.config import ConfigError, for_one_of_several_front_ends, load_config
    from frontend.memory import keep_request_buffers_on_the_heap
    from orchestrator.server import create_orchestrator_app

    try:
        config = load_config(args.config, hostname=args.host, port=args.port,
                             response_store_url=args.response_store_url or None, migration_limit=args.migration_limit)
    except ConfigError as exc:
        print(f"disagg-serve orchestrator: {exc}", file=sys.stderr)
        return 2
    if args.api_workers > 1:
        if config.context_servers.registration or config.generation_servers.registration:
            # Each front-end process has its own pools and SO_REUSEPORT hands a registration to one of them.
            print("disagg-serve orchestrator: 'registration: true' needs --api-workers 1; with several front-end "
                  "processes use static urls or DNS discovery", file=sys.stderr)
            return 2
        if config.response_store.enabled and not config.response_store.shared:
            print("disagg-serve orchestrator: with --api-workers > 1 no Responses API answers are stored (each "
                  "process would hold its own); previous_response_id and store: true are refused. A Redis store "
                  "(--response-store-url) is shared by every process", file=sys.stderr)
        args.port = config.port
        return _supervise(args, argv)
    usable, secret = _internal_secret("orchestrator")
    if not usable:
        return 2
    if args.reuse_port:
        config = for_one_of_several_front_ends(config, args.front_ends)
    warn_if_exposed(secret, config.hostname, "this orchestrator")
    # An empty key (DISAGG_API_KEY="") means no key, not "the empty string is the key".
    tracing.configure("disagg-serve-orchestrator", "orchestrator")
    keep_request_buffers_on_the_heap()  # frontend.memory: no page faults per request for a long prompt's body
    listener = _listener(args, config.hostname, config.port)
    if listener is None:
        return STARTUP_FAILED
    try:
        app = create_orchestrator_app(config, api_key=args.api_key or None, admin_key=args.admin_key or None,
                                      internal_secret=secret, trtllm_auth_key=trtllm_auth_key_from_env())
    except ConfigError as exc:  # e.g. a tenant whose key's environment variable is not set
        print(f"disagg-serve orchestrator: {exc}", file=sys.stderr)
        listener.close()
        return 2
    return _serve(app, args, listener)


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    configure_logging(args.log_level, args.log_format)
    if args.otlp_endpoint:
        # As the standard variable, so that every process this one starts (engine core, `up`'s children, the
        # --api-workers front ends) traces to the same collector.
        os.environ[tracing.ENDPOINT_ENV] = args.otlp_endpoint
    if args.command == "worker":
        return run_worker(args, argv)
    if args.command == "orchestrator":
        return run_orchestrator(args, argv)
    if args.command == "internal-token":
        try:
            wrote = write_token_file(Path(args.path))
        except InternalSecretError as exc:
            print(f"disagg-serve internal-token: {exc}", file=sys.stderr)
            return 2
        print(f"disagg-serve internal-token: {'wrote a new secret to' if wrote else 'kept the secret in'} {args.path}")
        return 0
    if args.command == "bench":
        from entrypoints.bench.command import run_bench

        return run_bench(args)
    from entrypoints.launcher import run_up

    return run_up(args)


if __name__ == "__main__":
    sys.exit(main())
