"""``disagg-serve up --engine vllm`` on this CPU, without the environment docs/engines.md once asked for.

Each vLLM instance alone reserves 0.92 of the NUMA node's memory, so before ``up`` sized its two engines the second
never started. Here ``VLLM_CPU_KVCACHE_SPACE`` is left unset: ``up`` alone makes them fit, and the pair answers
through the orchestrator. (The OpenMP settings stay: they share the 2-core machine's cores, not its memory.)
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
from pathlib import Path

import httpx

from tests.vllm.answers import sdk_client
from tests.vllm.availability import needs_vllm
from tests.vllm.processes import MAX_MODEL_LEN, START_TIMEOUT_S, VLLM_ENV, example_connector, free_ports
from tests.vllm.prompts import FRANCE, MODEL
from tests.waiting import eventually

pytestmark = needs_vllm


def test_up_starts_two_vllm_engines_that_share_the_hosts_memory(tmp_path: Path, hf_checkpoint: Path) -> None:
    (port,) = free_ports(1)
    env = {k: v for k, v in {**os.environ, **VLLM_ENV}.items()
           if k != "VLLM_CPU_KVCACHE_SPACE" and not k.startswith("DISAGG_")}
    log = tmp_path / "up.log"
    command = [sys.executable, "-m", "entrypoints.cli", "--log-level", "warning", "up", "--engine", "vllm",
               "--dtype", "float32", "--max-model-len", str(MAX_MODEL_LEN), "--max-num-seqs", "4",
               "--kv-transfer-config", example_connector(tmp_path / "kv"), "--port", str(port),
               "--startup-timeout", str(START_TIMEOUT_S)]
    with log.open("wb") as out:
        process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    url = f"http://127.0.0.1:{port}"

    def serving() -> bool:
        if process.poll() is not None:
            return True  # exited: stop waiting, and fail below with its log
        try:
            return httpx.get(url + "/health", timeout=5).status_code == 200
        except httpx.HTTPError:
            return False

    try:
        assert eventually(serving, timeout_s=START_TIMEOUT_S, every_s=1.0)
        assert process.poll() is None, log.read_text()[-6000:]
        with sdk_client(url) as client:
            reply = client.chat.completions.create(model=MODEL, messages=FRANCE, max_tokens=16, temperature=0)
        assert reply.choices[0].message.content == "The capital of France is Paris."
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=120) == 0, log.read_text()[-6000:]
    finally:
        with contextlib.suppress(ProcessLookupError):  # up, its workers and their vLLM engine cores
            os.killpg(process.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            process.wait(timeout=30)
