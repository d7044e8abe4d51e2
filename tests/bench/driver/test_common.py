"""The shared driver: every process a benchmark starts is stopped."""

from __future__ import annotations

import os
import shutil
import subprocess

import pytest

from bench.driver.common import PYTHON, REPO_ROOT, Processes
from bench.driver.machine import descendants


def test_processes_are_stopped_whatever_happens() -> None:
    with pytest.raises(RuntimeError), Processes() as processes:
        sleeper = processes.spawn("sleeper", ["sleep", "60"])
        raise RuntimeError("boom")
    assert sleeper.process.poll() is not None
    assert processes.log_dir.exists()  # kept after a failure, for whoever reads the traceback
    shutil.rmtree(processes.log_dir)
    assert os.getpid() in descendants(os.getpid())


@pytest.mark.parametrize("folder", ["fleet", "orchestrator_cost", "prompt_path", "soak", "system_load", "vllm_serving"])
def test_a_folder_benchmark_runs_as_python_m_bench_folder_and_says_so(folder: str) -> None:
    done = subprocess.run([PYTHON, "-m", f"bench.{folder}", "--help"], cwd=REPO_ROOT, capture_output=True, text=True,
                          timeout=120, check=False)
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith(f"usage: python -m bench.{folder} "), done.stdout
