"""Several HTTP front-end processes on one port (``--api-workers N``), sharing one engine core per worker.

One event loop caps a Python front end, so with N > 1 the command's process supervises N copies of itself, bound
with SO_REUSEPORT, sharing one Prometheus multiprocess directory and, for the reference engine, one engine core.
Shutdown is ordered: the front ends drain, then the engine core goes."""

from __future__ import annotations

import contextlib
import os
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from frontend.process_lifetime import die_with_parent

MULTIPROC_ENV = "PROMETHEUS_MULTIPROC_DIR"
_DRAIN_S = 35.0  # a little over uvicorn's graceful shutdown, so streams in flight can finish
_AFTER_DRAIN_S = 5.0  # a worker front end's stop past its own drain (--drain-timeout-s): the cut and the exit
_WATCH_S = 5.0  # the watch loop's longest sleep: it is woken at once by any signal, a child's exit included


class FrontEndSupervisor:
    def __init__(
        self,
        argv: Sequence[str],
        count: int,
        core_command_for: Callable[[str], list[str]] | None = None,
        core_env: dict[str, str] | None = None,
        drain_timeout_s: float | None = None,
    ) -> None:
        self.argv = list(argv)
        self.count = count
        self.core_command_for = core_command_for  # given the socket path, the engine core's command line
        self.core_env = core_env
        # How long the front ends may take to stop: a worker's drain and then some, else uvicorn's graceful stop.
        self.drain_s = _DRAIN_S if drain_timeout_s is None else drain_timeout_s + _AFTER_DRAIN_S
        self.workdir = Path(tempfile.mkdtemp(prefix="disagg-front-ends-"))
        self.children: list[subprocess.Popen[bytes]] = []
        self.core: subprocess.Popen[bytes] | None = None
        self._stop = 0

    @property
    def core_socket(self) -> str:
        return str(self.workdir / "core.sock")

    def _on_signal(self, signum: int, _frame: object) -> None:
        self._stop = signum

    @staticmethod
    def _on_child(_signum: int, _frame: object) -> None:
        """SIGCHLD: nothing to do here; the signal's byte on the wake-up pipe wakes the watch loop."""

    def run(self) -> int:
        signal.signal(signal.SIGTERM, self._on_signal)
        signal.signal(signal.SIGINT, self._on_signal)
        env = dict(os.environ)
        metrics_dir = self.workdir / "metrics"
        metrics_dir.mkdir()
        env[MULTIPROC_ENV] = str(metrics_dir)
        extra = ["--api-workers", "1", "--reuse-port", "--front-ends", str(self.count)]
        try:
            if self.core_command_for is not None:
                command = self.core_command_for(self.core_socket)
                self.core = subprocess.Popen(command, env=self.core_env, preexec_fn=die_with_parent)
                extra += ["--engine-core-socket", self.core_socket]
            for _ in range(self.count):
                command = [sys.executable, "-m", "entrypoints.cli", *self.argv, *extra]
                self.children.append(subprocess.Popen(command, env=env, preexec_fn=die_with_parent))
            return self._watch()
        finally:
            self._shutdown()
            shutil.rmtree(self.workdir, ignore_errors=True)

    def _watch(self) -> int:
        """Until a signal says stop (0) or a child exits (1). Idle, it sleeps: every signal, SIGCHLD included, writes
        a byte to a pipe (``signal.set_wakeup_fd``) that wakes it, so it reacts at once without polling five times a
        second as it did."""
        wake_read, wake_write = os.pipe()
        os.set_blocking(wake_read, False)
        os.set_blocking(wake_write, False)
        previous_fd = signal.set_wakeup_fd(wake_write)
        previous_child = signal.signal(signal.SIGCHLD, self._on_child)
        try:
            while not self._stop:
                for process in [*self.children, *([self.core] if self.core else [])]:
                    if process.poll() is not None:
                        print(f"disagg-serve: process {process.pid} exited with status {process.returncode}; "
                              "stopping", file=sys.stderr, flush=True)
                        return 1
                select.select([wake_read], [], [], _WATCH_S)
                with contextlib.suppress(BlockingIOError):
                    os.read(wake_read, 4096)
            return 0
        finally:
            signal.signal(signal.SIGCHLD, previous_child)
            signal.set_wakeup_fd(previous_fd)
            os.close(wake_read)
            os.close(wake_write)

    def _shutdown(self) -> None:
        for process in self.children:
            if process.poll() is None:
                process.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + self.drain_s
        for process in self.children:
            with contextlib.suppress(subprocess.TimeoutExpired):
                process.wait(timeout=max(0.1, deadline - time.monotonic()))
            if process.poll() is None:
                process.kill()
                process.wait()
        if self.core is not None and self.core.poll() is None:
            self.core.send_signal(signal.SIGTERM)
            try:
                self.core.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.core.kill()
                self.core.wait()
