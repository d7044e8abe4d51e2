"""``disagg-serve up`` (entrypoints/launcher.py): the whole system on one machine is protected by default, every child
started with one deployment secret, so their internal routes are shut to every other process on the machine (and to
the network, with ``--host 0.0.0.0``)."""

from __future__ import annotations

import argparse
import socket
from pathlib import Path

import pytest

from entrypoints import launcher
from frontend.internal_secret import INTERNAL_TOKEN_ENV, InternalSecret


def test_children_get_a_fresh_secret_unless_the_user_set_one() -> None:
    first = launcher.children_environment({"PATH": "/bin"})
    second = launcher.children_environment({"PATH": "/bin"})
    assert first["PATH"] == "/bin"
    assert first[INTERNAL_TOKEN_ENV] != second[INTERNAL_TOKEN_ENV]  # one per run, never a constant
    InternalSecret(first[INTERNAL_TOKEN_ENV])  # long enough to be accepted by every child
    assert launcher.children_environment({INTERNAL_TOKEN_ENV: "the-users-own-secret-1"})[INTERNAL_TOKEN_ENV] == \
        "the-users-own-secret-1"
    assert launcher.children_environment({INTERNAL_TOKEN_ENV: ""})[INTERNAL_TOKEN_ENV] != ""


class _Exited:
    returncode = 0

    def poll(self) -> int:
        return 0


def test_up_starts_every_child_with_the_same_secret(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    started: list[tuple[str, dict[str, str] | None]] = []

    def spawn(name: str, argv: list[str], listener: socket.socket, env: dict[str, str] | None = None
              ) -> launcher.Child:
        listener.close()
        started.append((name, env))
        return launcher.Child(name, "http://127.0.0.1:1", _Exited())  # type: ignore[arg-type]

    monkeypatch.delenv(INTERNAL_TOKEN_ENV, raising=False)
    monkeypatch.setattr(launcher, "_spawn", spawn)
    monkeypatch.setattr(launcher, "_wait_healthy", lambda children, timeout_s: None)
    monkeypatch.setattr(launcher, "_served_model", lambda url: "m")
    args = argparse.Namespace(host="127.0.0.1", port=0, engine="synthetic", log_level="warning",
                              metadata_only=False, startup_timeout=1.0, engines_on_host=None)
    monkeypatch.setattr(launcher, "worker_engine_arguments", lambda a: ["--engine", "synthetic"])
    front, ctx, gen = (socket.socket() for _ in range(3))
    for sock in (front, ctx, gen):
        sock.bind(("127.0.0.1", 0))
    launcher._serve_all(args, tmp_path, front, ctx, gen, {"signal": 15})
    assert [name for name, _ in started] == ["ctx", "gen", "orchestrator"]
    tokens = {env[INTERNAL_TOKEN_ENV] for _, env in started if env is not None}
    assert len(tokens) == 1 and all(env is not None for _, env in started)
    InternalSecret(tokens.pop())
