"""The shared driver: every process a benchmark starts is stopped."""

from __future__ import annotations

import os
import shutil

import pytest

from bench.driver.common import Processes
from bench.driver.machine import descendants


def test_processes_are_stopped_whatever_happens() -> None:
    with pytest.raises(RuntimeError), Processes() as processes:
        sleeper = processes.spawn("sleeper", ["sleep", "60"])
        raise RuntimeError("boom")
    assert sleeper.process.poll() is not None
    assert processes.log_dir.exists()  # kept after a failure, for whoever reads the traceback
    shutil.rmtree(processes.log_dir)
    assert os.getpid() in descendants(os.getpid())
