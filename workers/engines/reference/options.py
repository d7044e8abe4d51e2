"""The reference engine's options and its engine core's command line (light: no model code is imported).

The CLI uses ``core_command``/``core_env`` to run one shared core for several front-end processes.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass, field

from workers.engines.options import EngineOptions, TokenizeConfig


@dataclass(frozen=True, slots=True)
class ReferenceOptions:
    model_path: str | None = None
    served_model_name: str | None = None
    kv_block_reuse: bool = False
    kv_block_reuse_bytes: int = 512 * 1024**2
    prompt_tokens_in_handoff: bool = True
    kv_host: str = "127.0.0.1"
    kv_advertise_host: str | None = None
    kv_port: int = 0
    kv_store_bytes: int = 4 * 1024**3
    kv_ttl_s: float = 120.0
    prefill_chunk: int = 512
    blas_threads: int | None = None  # pin for bitwise-reproducible prefill across workers
    startup_timeout_s: float = 300.0
    core_socket: str | None = None  # connect to a running core (shared by several front ends); None: spawn one
    tokenize: TokenizeConfig = field(default_factory=TokenizeConfig)  # the front end's prompt encoder
    kv_load_failure_policy: str = "fail"  # KV_LOAD_FAILURE_POLICIES: what GEN does when a KV fetch fails
    restart_dead_core: bool = True  # off: a core that dies leaves the worker unhealthy (503) until it is restarted


def reference_options(options: EngineOptions) -> ReferenceOptions:
    return ReferenceOptions(
        model_path=options.model_path,
        served_model_name=options.served_model_name,
        kv_block_reuse=options.kv_block_reuse,
        prompt_tokens_in_handoff=options.prompt_tokens_in_handoff,
        kv_host=options.kv_host,
        kv_advertise_host=options.kv_advertise_host,
        kv_port=options.kv_port,
        kv_ttl_s=options.kv_ttl_s,
        blas_threads=options.blas_threads,
        core_socket=options.core_socket,
        tokenize=options.tokenize,
        kv_load_failure_policy=options.kv_load_failure_policy,
    )


def core_command(options: ReferenceOptions, socket_path: str) -> list[str]:
    """The engine core's command line (used by the adapter, and by a worker running several front ends)."""
    o = options
    command = [sys.executable, "-m", "workers.engines.reference.core", "--listen", socket_path,
               "--kv-host", o.kv_host, "--kv-port", str(o.kv_port), "--kv-store-bytes", str(o.kv_store_bytes),
               "--kv-ttl-s", str(o.kv_ttl_s), "--prefill-chunk", str(o.prefill_chunk)]
    if o.model_path:
        command += ["--model", o.model_path]
    if o.kv_advertise_host:
        command += ["--kv-advertise-host", o.kv_advertise_host]
    if not o.prompt_tokens_in_handoff:
        command.append("--no-prompt-tokens-in-handoff")
    if o.kv_block_reuse:
        command += ["--prefix-cache-bytes", str(o.kv_block_reuse_bytes)]
    if o.kv_load_failure_policy != "fail":
        command += ["--kv-load-failure-policy", o.kv_load_failure_policy]
    return command


def core_env(options: ReferenceOptions) -> dict[str, str]:
    env = dict(os.environ)
    if options.blas_threads is not None:
        for name in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS"):
            env[name] = str(options.blas_threads)
    return env
