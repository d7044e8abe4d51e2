"""The driver every benchmark shares: servers started as real ``disagg-serve`` (or mock, or any other)
subprocesses on loopback, waited on until healthy and always stopped (SIGTERM, then SIGKILL), and the requests
that check on them. The machine they run on is bench.driver.machine; what they report is bench.driver.report."""

from __future__ import annotations

import argparse
import contextlib
import http.client
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson

# A server's process tree (its engine cores, its extra front ends) is the machine's to read; tests outside bench/
# take it from here beside the servers themselves.
from bench.driver.machine import descendants as descendants

REPO_ROOT = Path(__file__).resolve().parents[2]
PYTHON = sys.executable
LOOPBACK = "127.0.0.1"
_GRACE_S = 10.0


# -- servers as subprocesses ---------------------------------------------------------------------------------
def free_port() -> int:
    from entrypoints.launcher import free_port as project_free_port

    return project_free_port(LOOPBACK)


def child_env(**extra: str) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(REPO_ROOT) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env.setdefault("PYTHONHASHSEED", "0")
    env.update(extra)
    return env


def _die_with_parent() -> None:
    from frontend.process_lifetime import die_with_parent

    die_with_parent()


@dataclass
class Server:
    name: str
    url: str
    process: subprocess.Popen[bytes]
    log_path: Path

    @property
    def pid(self) -> int:
        return self.process.pid

    def log_tail(self, lines: int = 20) -> str:
        with contextlib.suppress(OSError):
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        return ""


@dataclass
class Processes:
    """Every process a benchmark starts. ``stop()`` (run by the context manager, whatever happens) sends SIGTERM,
    waits a grace period, then SIGKILLs; children also die with this process (PR_SET_PDEATHSIG)."""

    log_dir: Path = field(default_factory=lambda: Path(tempfile.mkdtemp(prefix="disagg-bench-")))
    started: list[Server] = field(default_factory=list)

    def spawn(self, name: str, argv: list[str], url: str = "", env: dict[str, str] | None = None) -> Server:
        log_path = self.log_dir / f"{name}.log"
        log = open(log_path, "wb")  # noqa: SIM115 - the child owns the descriptor; ours is closed right after
        try:
            process = subprocess.Popen(
                argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, cwd=REPO_ROOT,
                env=env or child_env(), preexec_fn=_die_with_parent,
            )
        finally:
            log.close()
        server = Server(name, url, process, log_path)
        self.started.append(server)
        return server

    def disagg_serve(self, name: str, args: list[str], port: int, env: dict[str, str] | None = None) -> Server:
        argv = [PYTHON, "-m", "entrypoints.cli", "--log-level", "warning", *args]
        return self.spawn(name, argv, f"http://{LOOPBACK}:{port}", env)

    def stop(self, servers: Sequence[Server] | None = None) -> None:
        targets = list(servers) if servers is not None else list(reversed(self.started))
        for server in targets:
            if server.process.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    server.process.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + _GRACE_S
        for server in targets:
            try:
                server.process.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    server.process.kill()
                server.process.wait(timeout=_GRACE_S)
        for server in targets:
            if server in self.started:
                self.started.remove(server)

    def __enter__(self) -> Processes:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, *_: object) -> None:
        self.stop()
        if exc_type is None:
            shutil.rmtree(self.log_dir, ignore_errors=True)
        else:  # keep the servers' logs for whoever reads the traceback
            print(f"[bench] logs kept in {self.log_dir}", file=sys.stderr, flush=True)


class StartupError(RuntimeError):
    pass


def http_get(url: str, path: str, timeout_s: float = 2.0) -> tuple[int, bytes]:
    host, _, port = url.removeprefix("http://").partition(":")
    connection = http.client.HTTPConnection(host, int(port), timeout=timeout_s)
    try:
        connection.request("GET", path)
        response = connection.getresponse()
        return response.status, response.read()
    finally:
        connection.close()


def open_raw_post(url: str, path: str, body: dict[str, Any]) -> socket.socket:
    """Send one JSON POST over a plain TCP socket and leave it open: closing the socket is the client going away
    (what a cancelled request looks like to the server, with no client library deciding when)."""
    host, port = url.removeprefix("http://").split(":")
    sock = socket.create_connection((host, int(port)), timeout=30)
    payload = orjson.dumps(body)
    sock.sendall(f"POST {path} HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
                 f"Content-Length: {len(payload)}\r\n\r\n".encode() + payload)
    return sock


def wait_healthy(servers: Sequence[Server], timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    pending = list(servers)
    while pending:
        for server in list(pending):
            if server.process.poll() is not None:
                raise StartupError(f"{server.name} exited with status {server.process.returncode}:\n"
                                   f"{server.log_tail()}")
            with contextlib.suppress(OSError, http.client.HTTPException):
                if http_get(server.url, "/health")[0] == 200:
                    pending.remove(server)
        if pending and time.monotonic() > deadline:
            raise StartupError(f"{', '.join(s.name for s in pending)} not healthy after {timeout_s:.0f} s:\n"
                               + "\n".join(s.log_tail() for s in pending))
        if pending:
            time.sleep(0.1)


def worker_args(role: str, engine: str, port: int, *extra: str) -> list[str]:
    return ["worker", "--role", role, "--engine", engine, "--host", LOOPBACK, "--port", str(port), *extra]


def orchestrator_config(path: Path, port: int, ctx_urls: list[str], gen_urls: list[str], **options: Any) -> Path:
    import yaml

    path.write_text(yaml.safe_dump({
        "hostname": LOOPBACK,
        "port": port,
        "context_servers": {"urls": ctx_urls},
        "generation_servers": {"urls": gen_urls},
        **options,
    }))
    return path


def orchestrator_help() -> str:
    """The orchestrator's --help text, to find options added after these benchmarks were written."""
    try:
        done = subprocess.run([PYTHON, "-m", "entrypoints.cli", "orchestrator", "--help"], capture_output=True,
                              text=True, timeout=60, cwd=REPO_ROOT, env=child_env())
    except subprocess.TimeoutExpired:
        return ""
    return done.stdout


# -- prompts sized in tokens, and how the workers tokenize them ---------------------------------------------------
# --tokenize-compare (bench.fleet, bench.system_load): the workers' tokenization set-ups, each run on the same work;
# the first is the baseline.
TOKENIZE_SETUPS: dict[str, tuple[str, ...]] = {
    # today's cost, and what vLLM's and trtllm-serve's servers pay: one full `tokenizers` encode every turn
    "full encode": ("--tokenize-cache-mb", "0", "--tokenizer-backend", "tokenizers"),
    "defaults": (),  # the conversation cache and the default encoder
}


def chars_per_token(sample: str, tokenizer: str) -> float:
    """Characters of ``sample`` per token of the workers' ``--tokenizer``: 1 for ``byte`` (a character is a token of
    the ASCII text benchmarks write), else measured once with the reference model's tokenizer (~2 s to load), so
    that text of ``tokens * chars_per_token`` characters of the same kind is close to ``tokens`` tokens."""
    if tokenizer == "byte":
        return 1.0
    from workers.engines.synthetic import reference_tokens

    return len(sample) / max(1, int(reference_tokens().tokenizer.encode(sample).size))


# -- the command line every benchmark has ----------------------------------------------------------------------
def arguments(doc: str | None) -> argparse.ArgumentParser:
    """A benchmark's (or a helper process's) parser, described by the first paragraph of its module docstring; a
    folder's command (its ``__main__.py``) is named as it is run, ``python -m bench.<folder>``."""
    spec = getattr(sys.modules.get("__main__"), "__spec__", None)
    name: str = spec.name if spec is not None else ""
    folder = name.removesuffix(".__main__") if name.startswith("bench.") else name
    prog = f"python -m {folder}" if folder != name else None
    return argparse.ArgumentParser(prog=prog, description=doc.split("\n\n")[0] if doc else None)


def add_docs_flag(parser: argparse.ArgumentParser, name: str) -> None:
    """``--docs``: write docs/benchmarks/<name>.{json,png} and its section of docs/benchmarks.md
    (``bench.driver.report.publish``)."""
    parser.add_argument("--docs", action="store_true",
                        help=f"write docs/benchmarks/{name}.{{json,png}} and the section of docs/benchmarks.md")
