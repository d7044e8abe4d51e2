"""A real Redis server for tests and benchmarks: Debian's ``redis-server`` binary, started and always stopped.

It listens on loopback TCP (as deployments do) in a folder of its own; a test can kill it, pause it (SIGSTOP: it
accepts connections but answers nothing, as a Redis stuck on a slow disk does), and bring it back on the same port,
with its append-only file when it was started with one (what survives a crash). scripts/test installs the binary;
without it the tests fail with a message that says so, never skip (tests/conftest.py).
"""

from __future__ import annotations

import contextlib
import shutil
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import redis

from bench.driver.common import free_port

BINARY = "redis-server"
_START_ATTEMPTS = 5  # a port chosen free can be taken before the server binds it: then another port
_START_TIMEOUT_S = 60.0  # a bound on a busy machine, not an expectation: it starts in milliseconds


class RedisMissingError(RuntimeError):
    pass


class RedisServer:
    def __init__(self, directory: Path, *, appendonly: bool = False) -> None:
        if shutil.which(BINARY) is None:
            raise RedisMissingError(f"{BINARY} is not installed: `bash scripts/test` installs Debian's redis-server "
                                    "package (apt-get install redis-server)")
        self.directory = directory
        self.directory.mkdir(parents=True, exist_ok=True)
        self.appendonly = appendonly
        self.port = 0
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> str:
        """Start it (on the port it had before, when it had one) and wait until it answers PING."""
        for _ in range(_START_ATTEMPTS if self.port == 0 else 1):
            port = self.port or free_port()
            if self._started_on(port):
                self.port = port
                return self.url
        raise RuntimeError(f"redis-server did not start: {self.log_tail()}")

    def _started_on(self, port: int) -> bool:
        process = self.process = subprocess.Popen(
            [BINARY, "--port", str(port), "--bind", "127.0.0.1", "--dir", str(self.directory),
             "--save", "", "--appendonly", "yes" if self.appendonly else "no", "--appendfsync", "always",
             "--daemonize", "no", "--protected-mode", "no", "--loglevel", "warning",
             "--logfile", str(self.directory / "redis.log")],
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + _START_TIMEOUT_S
        while process.poll() is None and not self._answers(port) and time.monotonic() < deadline:
            time.sleep(0.01)
        return process.poll() is None and self._answers(port)

    def _answers(self, port: int) -> bool:
        with contextlib.suppress(redis.RedisError, OSError), redis.Redis(port=port, socket_timeout=1) as client:
            return bool(client.ping())
        return False

    def log_tail(self) -> str:
        with contextlib.suppress(OSError):
            return (self.directory / "redis.log").read_text(errors="replace")[-2000:]
        return ""

    def client(self) -> redis.Redis:
        return redis.Redis(port=self.port, socket_timeout=10)

    def kill(self) -> None:
        """SIGKILL: gone at once, as in a crash; what it had not written to its append-only file is lost."""
        self._signal(signal.SIGKILL)
        self._reap()

    def pause(self) -> None:
        self._signal(signal.SIGSTOP)

    def resume(self) -> None:
        self._signal(signal.SIGCONT)

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self._signal(signal.SIGCONT)
            self.process.terminate()
            self._reap()

    def _signal(self, signum: int) -> None:
        assert self.process is not None
        self.process.send_signal(signum)

    def _reap(self) -> None:
        assert self.process is not None
        try:
            self.process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait(timeout=30)


@contextlib.contextmanager
def redis_running(directory: Path, *, appendonly: bool = False) -> Iterator[RedisServer]:
    server = RedisServer(directory, appendonly=appendonly)
    server.start()
    try:
        yield server
    finally:
        server.stop()
