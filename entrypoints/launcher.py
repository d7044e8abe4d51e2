"""``disagg-serve up``: one CTX, one GEN and the orchestrator as child processes on loopback.

``up`` binds every port before a child starts and hands each child its socket (``--listen-fd``), so a port in use is
reported at once, not after the engines load. Every child gets one deployment secret (the user's, or one generated
for this run). Shutdown is ordered, orchestrator first, and ``PR_SET_PDEATHSIG`` leaves no orphans (docs/cli.md)."""

from __future__ import annotations

import argparse
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import yaml

from entrypoints.arguments import engine_arguments
from entrypoints.http.listener import address, bound_socket
from frontend.internal_secret import INTERNAL_TOKEN_ENV, INTERNAL_TOKEN_FILE_ENV
from frontend.process_lifetime import die_with_parent

_GRACE_S = 15.0


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


@dataclass
class Child:
    name: str
    url: str
    process: subprocess.Popen[bytes]


class StartupFailed(Exception):
    pass


def children_environment(environ: dict[str, str] | None = None) -> dict[str, str]:
    """What every child runs with: this environment, and one deployment secret for all of them (the user's
    ``DISAGG_INTERNAL_TOKEN`` if set, else a fresh one from ``secrets``, never written to disk or printed)."""
    env = dict(os.environ if environ is None else environ)
    if not env.get(INTERNAL_TOKEN_ENV) and not env.get(INTERNAL_TOKEN_FILE_ENV):  # a file's: each child reads it
        env[INTERNAL_TOKEN_ENV] = secrets.token_hex(32)
    return env


def _spawn(name: str, argv: list[str], listener: socket.socket, env: dict[str, str] | None = None) -> Child:
    """Starts ``disagg-serve ARGV`` serving on ``listener``, which from then on only the child holds: the port is
    free again once the child is gone."""
    host, port = address(listener)
    # One front end each, whatever DISAGG_API_WORKERS says: a socket handed over serves one process.
    command = [sys.executable, "-m", "entrypoints.cli", *argv, "--listen-fd", str(listener.fileno()),
               "--port", str(port), "--api-workers", "1"]
    try:
        process = subprocess.Popen(command, preexec_fn=die_with_parent, pass_fds=(listener.fileno(),), env=env)
    finally:
        listener.close()
    # A wildcard address is served on loopback too (IPv4's: "::" is dual-stack, and ::1 may be off in a container).
    reachable = "127.0.0.1" if host in ("0.0.0.0", "::") else host
    return Child(name, _url(reachable, port), process)


def _url(host: str, port: int) -> str:
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


def _wait_healthy(children: list[Child], timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    pending = list(children)
    with httpx.Client(timeout=2.0) as client:
        while pending:
            for child in list(pending):
                if child.process.poll() is not None:
                    raise StartupFailed(f"{child.name} exited with status {child.process.returncode} during start-up")
                try:
                    if client.get(child.url + "/health").status_code == 200:
                        print(f"  {child.name:<12} healthy at {child.url}", flush=True)
                        pending.remove(child)
                except httpx.HTTPError:
                    pass
            if time.monotonic() > deadline:
                names = ", ".join(c.name for c in pending)
                raise StartupFailed(f"{names} not healthy after {timeout_s:.0f} s")
            if pending:
                time.sleep(0.25)


def _stop(children: list[Child]) -> None:
    """SIGTERM to the orchestrator first (it stops taking requests before its workers go), then to the workers at
    once: each drains on its own (workers/drain.py), so their drains overlap. SIGKILL to one not gone in time."""
    first = [c for c in children if c.name == "orchestrator"]
    for group in (first, [c for c in children if c not in first]):
        running = [child for child in group if child.process.poll() is None]
        for child in running:
            child.process.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + _GRACE_S
        for child in running:
            try:
                child.process.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                child.process.kill()
                child.process.wait()


ENGINES_STARTED = 2  # CTX and GEN, on this host


def worker_engine_arguments(args: argparse.Namespace) -> list[str]:
    """The engine flags of each worker ``up`` starts. A vLLM engine sizes its memory as if it were alone (on a CPU
    0.92 of the node's memory, so the second could never start): each is told it shares the host with the other,
    and takes its share, unless the user said how many engines share it or set the sizes themselves."""
    argv = engine_arguments(args)
    if args.engine == "vllm" and args.engines_on_host is None:
        argv += ["--engines-on-host", str(ENGINES_STARTED)]
    return argv


def run_up(args: argparse.Namespace) -> int:
    workdir = Path(tempfile.mkdtemp(prefix="disagg-serve-"))
    try:
        return _run_up(args, workdir)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


def _run_up(args: argparse.Namespace, workdir: Path) -> int:
    stop_requested = {"signal": 0}

    def on_signal(signum: int, _frame: object) -> None:
        stop_requested["signal"] = signum

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)

    try:
        front = bound_socket(args.host, args.port)
    except OSError as exc:
        print(f"disagg-serve up: cannot listen on {args.host}:{args.port}: {exc.strerror}", file=sys.stderr)
        return 2
    with front, bound_socket("127.0.0.1", 0) as ctx_socket, bound_socket("127.0.0.1", 0) as gen_socket:
        return _serve_all(args, workdir, front, ctx_socket, gen_socket, stop_requested)


def _serve_all(args: argparse.Namespace, workdir: Path, front: socket.socket, ctx_socket: socket.socket,
               gen_socket: socket.socket, stop_requested: dict[str, int]) -> int:
    ctx_port, gen_port, port = address(ctx_socket)[1], address(gen_socket)[1], address(front)[1]
    engine_argv = worker_engine_arguments(args)
    log = ["--log-level", args.log_level]
    config_path = workdir / "orchestrator.yaml"
    config_path.write_text(yaml.safe_dump({
        "hostname": args.host,
        "port": port,
        "context_servers": {"urls": [f"http://127.0.0.1:{ctx_port}"]},
        "generation_servers": {"urls": [f"http://127.0.0.1:{gen_port}"]},
        "gen_tokids_metadata_only": bool(args.metadata_only),
    }))
    print(f"disagg-serve up: engine={args.engine}, starting CTX, GEN and the orchestrator ...", flush=True)
    env = children_environment()
    workers = [
        _spawn("ctx", [*log, "worker", "--role", "context", *engine_argv], ctx_socket, env),
        _spawn("gen", [*log, "worker", "--role", "generation", *engine_argv], gen_socket, env),
    ]
    children = list(workers)
    try:
        _wait_healthy(workers, args.startup_timeout)
        orchestrator = _spawn("orchestrator", [*log, "orchestrator", "--config", str(config_path)], front, env)
        children.insert(0, orchestrator)
        _wait_healthy([orchestrator], args.startup_timeout)
    except StartupFailed as exc:
        print(f"disagg-serve up: {exc}; stopping", file=sys.stderr, flush=True)
        _stop(children)
        return 1
    orchestrator_url = _url(args.host, port)
    model = _served_model(orchestrator.url)
    print(f"\nServing on {orchestrator_url}  (model '{model}')\nTry:\n"
          f"  curl {orchestrator_url}/v1/chat/completions -H 'Content-Type: application/json' \\\n"
          f"    -d '{{\"model\": \"{model}\", \"messages\": [{{\"role\": \"user\", \"content\": "
          f"\"What is the capital of France?\"}}], \"max_tokens\": 32}}'\n"
          "Press Ctrl-C to stop.", flush=True)
    exit_code = 0
    while not stop_requested["signal"]:
        dead = [c for c in children if c.process.poll() is not None]
        if dead:
            print(f"disagg-serve up: {dead[0].name} exited with status {dead[0].process.returncode}; stopping",
                  file=sys.stderr, flush=True)
            exit_code = 1
            break
        time.sleep(0.2)
    _stop(children)
    print("disagg-serve up: stopped", flush=True)
    return exit_code


def _served_model(url: str) -> str:
    try:
        return str(httpx.get(url + "/v1/models", timeout=5).json()["data"][0]["id"])
    except (httpx.HTTPError, KeyError, IndexError, ValueError):
        return "default"


