"""Real vLLM processes for tests: our workers on ``--engine vllm`` and plain vLLM OpenAI servers.

Each instance gets one core's worth of threads (``OMP_NUM_THREADS=1``, no pinning: the machine is shared) and
2 GiB of KV cache; float32, eager mode, a 2,048-token context. A vLLM instance holds ~5 GB, so the modules that use
these start at most two at a time, side by side (``vllm_processes``: their start-ups overlap on two cores), and stop
them when the module ends (module fixtures, each started once per session). Every process is started in its own
process group and the whole group is killed on the way out, so vLLM's engine-core children never outlive the test
run.
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

# Starting vLLM: ~50 s of CPU in three processes (ours, vLLM's engine core, its worker), about a minute on an idle
# 2-core machine, several when other suites run beside a pair of starts. Only a bound.
START_TIMEOUT_S = 900.0
# vLLM's API process pushes a step's outputs to the requests before it records the step's stats, so a metric can
# trail the answer that moved it: checks wait for the value (``eventually``) rather than read it once.
METRIC_TIMEOUT_S = 120.0
EXTERNAL_HITS = "vllm:external_prefix_cache_hits_total"
MAX_MODEL_LEN = 2048
VLLM_ENV = {"VLLM_CPU_KVCACHE_SPACE": "2", "VLLM_CPU_OMP_THREADS_BIND": "nobind", "OMP_NUM_THREADS": "1",
            "VLLM_LOGGING_LEVEL": "WARNING", "TOKENIZERS_PARALLELISM": "false"}


def example_connector(folder: Path) -> str:
    """vLLM's ExampleConnector: KV saved to and loaded from ``folder``, found by the prompt's token ids."""
    return json.dumps({"kv_connector": "ExampleConnector", "kv_role": "kv_both",
                       "kv_connector_extra_config": {"shared_storage_path": str(folder)}})


def free_ports(count: int) -> list[int]:
    """``count`` distinct free ports: every socket is held until all are bound, so two processes started together
    never get the same one."""
    with contextlib.ExitStack() as stack:
        sockets = [stack.enter_context(socket.socket()) for _ in range(count)]
        for sock in sockets:
            sock.bind(("127.0.0.1", 0))
        return [int(sock.getsockname()[1]) for sock in sockets]


@dataclass
class VllmProcess:
    url: str
    process: subprocess.Popen[bytes]
    log: Path

    def metrics(self) -> str:
        return httpx.get(self.url + "/metrics", timeout=30).text

    def metric(self, name: str) -> float:
        return metric_value(self.metrics(), name)

    def loaded_external_kv(self, hits_before: float, tokens: int = 128) -> bool:
        """Whether this instance's external prefix-cache hits (KV loaded through its connector instead of computed)
        reach ``hits_before + tokens``: at least one 128-token block by default."""
        return eventually(lambda: self.metric(EXTERNAL_HITS) - hits_before >= tokens, timeout_s=METRIC_TIMEOUT_S,
                          every_s=0.2)


def metric_value(text: str, name: str) -> float:
    """The sum of the samples called ``name`` (any labels) in a Prometheus text page."""
    value = 0.0
    for line in text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            value += float(line.rsplit(" ", 1)[1])
    return value


@contextlib.contextmanager
def vllm_processes(*launches: tuple[list[str], Path], health_path: str = "/health") -> Iterator[list[VllmProcess]]:
    """Starts every ``(command, log)`` at once and waits until all answer ``health_path``: two vLLM instances load
    side by side on two cores in about the time of one (at most two per call; see the module's docstring)."""
    assert len(launches) <= 2, "at most two vLLM instances at once"
    env = {**os.environ, **VLLM_ENV}
    with contextlib.ExitStack() as stack:
        started = []
        for (command, log), port in zip(launches, free_ports(len(launches)), strict=True):
            with log.open("wb") as out:
                process = subprocess.Popen([*command, "--port", str(port)], stdout=out, stderr=subprocess.STDOUT,
                                           env=env, start_new_session=True)
            stack.callback(_stop_group, process)
            started.append((command, VllmProcess(f"http://127.0.0.1:{port}", process, log)))
        for command, instance in started:
            _wait_healthy(command, instance, health_path)
        yield [instance for _, instance in started]


@contextlib.contextmanager
def vllm_process(command: list[str], log: Path, health_path: str = "/health") -> Iterator[VllmProcess]:
    with vllm_processes((command, log), health_path=health_path) as (instance,):
        yield instance


def _wait_healthy(command: list[str], instance: VllmProcess, health_path: str) -> None:
    process = instance.process

    def healthy() -> bool:
        if process.poll() is not None:
            return True  # died: stop waiting, and fail below with its log
        try:
            return httpx.get(instance.url + health_path, timeout=5).status_code == 200
        except httpx.HTTPError:
            return False

    started = eventually(healthy, timeout_s=START_TIMEOUT_S, every_s=0.5)
    if process.poll() is not None or not started:
        raise RuntimeError(f"{command[:6]} did not start; its log ends:\n{instance.log.read_text()[-4000:]}")


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
