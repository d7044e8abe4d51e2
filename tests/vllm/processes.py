"""Real vLLM processes for tests: our workers on ``--engine vllm`` and plain vLLM OpenAI servers.

Each instance gets one core's worth of threads (``OMP_NUM_THREADS=1``, no pinning: the machine is shared) and
2 GiB of KV cache; float32, eager mode, a 2,048-token context. A vLLM instance holds ~5 GB, so the modules that use
these start at most two at a time and stop them when the module ends (module fixtures, each started once per
session). Every process is started in its own process group and the whole group is killed on the way out, so
vLLM's engine-core children never outlive the test run.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx

from tests.waiting import eventually

# Starting vLLM on a busy 2-core machine: ~30 s alone, minutes when other suites run beside it. Only a bound.
START_TIMEOUT_S = 600.0
MAX_MODEL_LEN = 2048
VLLM_ENV = {"VLLM_CPU_KVCACHE_SPACE": "2", "VLLM_CPU_OMP_THREADS_BIND": "nobind", "OMP_NUM_THREADS": "1",
            "VLLM_LOGGING_LEVEL": "WARNING", "TOKENIZERS_PARALLELISM": "false"}


def example_connector(folder: Path) -> str:
    """vLLM's ExampleConnector: KV saved to and loaded from ``folder``, found by the prompt's token ids."""
    return json.dumps({"kv_connector": "ExampleConnector", "kv_role": "kv_both",
                       "kv_connector_extra_config": {"shared_storage_path": str(folder)}})


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@dataclass
class VllmProcess:
    url: str
    process: subprocess.Popen[bytes]
    log: Path

    def metrics(self) -> str:
        return httpx.get(self.url + "/metrics", timeout=30).text


def metric_value(text: str, name: str) -> float:
    """The sum of the samples called ``name`` (any labels) in a Prometheus text page."""
    value = 0.0
    for line in text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            value += float(line.rsplit(" ", 1)[1])
    return value


@contextlib.contextmanager
def vllm_process(command: list[str], log: Path, health_path: str = "/health") -> Iterator[VllmProcess]:
    port = free_port()
    env = {**os.environ, **VLLM_ENV}
    with log.open("wb") as out:
        process = subprocess.Popen([*command, "--port", str(port)], stdout=out, stderr=subprocess.STDOUT, env=env,
                                   start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        def healthy() -> bool:
            if process.poll() is not None:
                return True  # died: stop waiting, and fail below with its log
            try:
                return httpx.get(url + health_path, timeout=5).status_code == 200
            except httpx.HTTPError:
                return False

        started = eventually(healthy, timeout_s=START_TIMEOUT_S, every_s=0.5)
        if process.poll() is not None or not started:
            raise RuntimeError(f"{command[:6]} did not start; its log ends:\n{log.read_text()[-4000:]}")
        yield VllmProcess(url, process, log)
    finally:
        _stop_group(process)


def _stop_group(process: subprocess.Popen[bytes]) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGTERM)
    with contextlib.suppress(subprocess.TimeoutExpired):
        process.wait(timeout=60)
    with contextlib.suppress(ProcessLookupError):  # the engine core and anything else left in the group
        os.killpg(process.pid, signal.SIGKILL)
    with contextlib.suppress(subprocess.TimeoutExpired):
        process.wait(timeout=30)


def our_worker(role: str, log: Path, kv_transfer_config: str | None) -> list[str]:
    command = [sys.executable, "-m", "entrypoints.cli", "--log-level", "warning", "worker", "--engine", "vllm",
               "--role", role, "--dtype", "float32", "--max-model-len", str(MAX_MODEL_LEN), "--max-num-seqs", "4"]
    if kv_transfer_config is not None:
        command += ["--kv-transfer-config", kv_transfer_config]
    return command


def vllm_api_server(model: Path, served_name: str, kv_transfer_config: str) -> list[str]:
    """vLLM's own OpenAI server (its ``vllm`` console script does not run from vllm-cpu: the module does)."""
    return [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model),
            "--served-model-name", served_name, "--dtype", "float32", "--enforce-eager",
            "--max-model-len", str(MAX_MODEL_LEN), "--max-num-seqs", "4", "--kv-transfer-config", kv_transfer_config,
            "--host", "127.0.0.1"]
