"""A soak's run: its ``disagg-serve`` processes, each GEN stop and start (``GenEvent``), and every request's outcome:
what the command drives and the report reads."""

from __future__ import annotations

import contextlib
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from bench.driver.common import REPO_ROOT
from bench.soak.load import Outcome, Settings
from frontend.process_lifetime import die_with_parent

STOP_GRACE_S = 40.0


@dataclass
class Proc:
    role: str
    port: int
    argv: list[str]
    log: Path
    process: subprocess.Popen[bytes] | None = None
    fds_at_start: int | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def pid(self) -> int:
        assert self.process is not None
        return self.process.pid

    def start(self) -> None:
        with open(self.log, "ab") as log:
            self.process = subprocess.Popen(
                [sys.executable, "-m", "entrypoints.cli", "--log-level", "warning", *self.argv],
                stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, cwd=REPO_ROOT,
                preexec_fn=die_with_parent,
            )

    def stop(self) -> int | None:
        if self.process is None:
            return None
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
        try:
            return self.process.wait(timeout=STOP_GRACE_S)
        except subprocess.TimeoutExpired:
            self.process.kill()
            return self.process.wait(timeout=10)

    def wait_healthy(self, timeout_s: float = 60.0) -> None:
        deadline = time.monotonic() + timeout_s
        while True:
            assert self.process is not None
            if self.process.poll() is not None:
                raise RuntimeError(f"{self.role} exited with {self.process.returncode}:\n{self.log_tail()}")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return
            if time.monotonic() > deadline:
                raise RuntimeError(f"{self.role} not healthy after {timeout_s:.0f} s:\n{self.log_tail()}")
            time.sleep(0.1)

    def log_tail(self) -> str:
        with contextlib.suppress(OSError):
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-20:])
        return ""


@dataclass
class GenEvent:
    """One GEN worker stopped and started again: ``kind`` is the signal (``SIGTERM``: drained first; ``SIGKILL``:
    gone at once, its streams cut), and the times are the load's clock."""

    kind: str
    role: str
    signal_at: float
    exited_at: float | None = None
    healthy_at: float | None = None
    old_pid: int | None = None
    new_pid: int | None = None
    exit_status: int | None = None

    def covers(self, started: float, ended: float, slack_s: float) -> bool:
        """Whether a request that ran from ``started`` to ``ended`` overlaps this event (until the worker was healthy
        again, plus ``slack_s``)."""
        end = (self.healthy_at if self.healthy_at is not None else float("inf")) + slack_s
        return started <= end and ended >= self.signal_at

    def in_flight(self, started: float, ended: float) -> bool:
        """Whether a request was running when the signal was sent (the one a kill cuts, or a drain lets finish)."""
        return started <= self.signal_at <= ended


@dataclass
class Run:
    settings: Settings
    processes: dict[str, Proc]
    outcomes: list[Outcome] = field(default_factory=list)
    samples: list[dict[str, Any]] = field(default_factory=list)
    events: list[GenEvent] = field(default_factory=list)
    load_started: float = 0.0
    load_ended: float = 0.0

    @property
    def gens(self) -> list[Proc]:
        return [proc for role, proc in self.processes.items() if role.startswith("gen")]
