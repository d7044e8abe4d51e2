"""A worker whose vLLM cannot get the memory it asks for fails its start-up saying which setting fixes it.

vLLM's engine core refuses to start when the share of the NUMA node's memory it reserves (``gpu_memory_utilization``)
is more than is available, and says why only in its own log; the adapter adds what to set, with values that fit.
0.99 of the node is never available (the kernel and this test run hold more than 1 %), so the refusal is certain,
and it comes before vLLM loads the model: one short start.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
from pathlib import Path

from tests.vllm.availability import needs_vllm
from tests.vllm.processes import START_TIMEOUT_S, VLLM_ENV, free_ports, our_worker

pytestmark = needs_vllm


def test_a_worker_vllm_cannot_fit_says_which_setting_fixes_it(tmp_path: Path, hf_checkpoint: Path) -> None:
    log = tmp_path / "worker.log"
    # Without the tests' explicit KV cache size: vLLM then reserves --gpu-memory-utilization of the node.
    env = {k: v for k, v in {**os.environ, **VLLM_ENV}.items() if k != "VLLM_CPU_KVCACHE_SPACE"}
    command = [*our_worker("both", log, None), "--gpu-memory-utilization", "0.99", "--port", str(free_ports(1)[0])]
    with log.open("wb") as out:
        process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    try:
        status = process.wait(timeout=START_TIMEOUT_S)
    finally:
        with contextlib.suppress(ProcessLookupError):  # vLLM's engine-core children, if any outlived it
            os.killpg(process.pid, signal.SIGKILL)
    text = log.read_text()
    assert status == 3, text[-4000:]  # a failed start-up, not a clean stop
    failure = next((line for line in text.splitlines() if "EngineError: vLLM failed to start" in line), None)
    assert failure is not None, text[-4000:]
    assert "--gpu-memory-utilization (0.99)" in failure
    sized = re.search(r"--kv-cache-memory-bytes (\d+)([MG]) \(or VLLM_CPU_KVCACHE_SPACE=(\d+), in GiB\)", failure)
    assert sized is not None, failure
    assert re.search(r"--gpu-memory-utilization 0\.\d+", failure.split("instead,", 1)[1]), failure
