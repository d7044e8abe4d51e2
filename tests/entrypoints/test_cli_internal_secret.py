"""The CLI and the deployment secret (``DISAGG_INTERNAL_TOKEN``): read once at start-up, refused when too short, and
one warning when a worker listens beyond loopback without it. Each run is its own process: ``main()`` sets
up the root logger."""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
from pathlib import Path

import httpx

from frontend.internal_secret import INTERNAL_TOKEN_ENV
from tests.waiting import eventually

REPO = Path(__file__).resolve().parents[2]
WARNING = f"without {INTERNAL_TOKEN_ENV}"


def _env(token: str | None) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("DISAGG_")}
    if token is not None:
        env[INTERNAL_TOKEN_ENV] = token
    return env


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("0.0.0.0", 0))
        return int(sock.getsockname()[1])


def _stderr_of_a_worker_on_all_interfaces(token: str | None) -> str:
    port = _free_port()
    process = subprocess.Popen([sys.executable, "-m", "entrypoints.cli", "--log-level", "warning", "worker",
                                "--engine", "synthetic", "--host", "0.0.0.0", "--port", str(port)],
                               cwd=REPO, env=_env(token), stderr=subprocess.PIPE)
    try:
        def healthy() -> bool:
            if process.poll() is not None:
                return True
            with contextlib.suppress(httpx.HTTPError):
                return httpx.get(f"http://127.0.0.1:{port}/health", timeout=5).status_code == 200
            return False

        assert eventually(healthy, timeout_s=120, every_s=0.1)
        assert process.poll() is None
    finally:
        process.terminate()
        try:
            _, err = process.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            process.kill()
            _, err = process.communicate()
    return err.decode()


def test_a_worker_on_all_interfaces_without_the_secret_says_so_once() -> None:
    assert _stderr_of_a_worker_on_all_interfaces(None).count(WARNING) == 1


def test_a_worker_with_the_secret_does_not_warn() -> None:
    assert WARNING not in _stderr_of_a_worker_on_all_interfaces("a-deployment-secret-of-32-chars!")


def test_a_secret_too_short_to_use_is_refused_at_start_up() -> None:
    done = subprocess.run([sys.executable, "-m", "entrypoints.cli", "worker", "--engine", "synthetic", "--port", "0"],
                          cwd=REPO, env=_env("short"), capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and INTERNAL_TOKEN_ENV in done.stderr
