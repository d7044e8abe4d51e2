"""vLLM's router and SGLang's Model Gateway: the Rust gateways ``bench.orchestrator_cost`` measures beside ours.

Each comes from its pinned PyPI wheel, installed into a side virtual environment (``bench-results/gateways-venv``)
so that its dependencies never meet the project's; one that cannot be installed is skipped with the reason. Each
runs in its P/D mode in front of ``mock_workers``, at its cheapest routing policy (how each is driven:
docs/benchmarks.md, "Against the Rust gateways"). ``python -m bench.peers.rust_gateways [--check]`` installs (or
finds) them; ``--check`` also streams one request of each endpoint through each.
"""

from __future__ import annotations

import contextlib
import http.client
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson

from bench.driver.bodies import SYNTHETIC_MODEL
from bench.driver.common import (
    LOOPBACK,
    PYTHON,
    REPO_ROOT,
    Processes,
    Server,
    arguments,
    free_port,
    http_get,
    wait_healthy,
)
from bench.peers.mock_workers import MODEL as MOCK_MODEL

VENV_DIR = REPO_ROOT / "bench-results" / "gateways-venv"
INSTALL_TIMEOUT_S = 900.0
READY_TIMEOUT_S = 120.0


@dataclass(frozen=True)
class Gateway:
    name: str  # the set-up's name in bench.orchestrator_cost's tables
    package: str  # the PyPI distribution, pinned at ``version``
    version: str
    script: str  # its console script in the side venv
    flavour: str  # the P/D wire its prefill leg speaks (bench.peers.mock_workers --flavour)
    mode: tuple[str, ...]  # the arguments that put it in P/D mode before --prefill/--decode
    extra: tuple[str, ...]  # everything else after them
    log_level: str

    def argv(self, venv: Path, port: int, prefill_url: str, decode_url: str, metrics_port: int,
             policy: str = "round_robin") -> list[str]:
        """The command line that runs this gateway on loopback ``port`` in front of one prefill and one decode."""
        return [str(venv / "bin" / self.script), *self.mode, "--host", LOOPBACK, "--port", str(port),
                "--prefill", prefill_url, "--decode", decode_url, "--policy", policy, "--prometheus-host", LOOPBACK,
                "--prometheus-port", str(metrics_port), "--log-level", self.log_level, *self.extra]

    def argv_workers(self, venv: Path, port: int, worker_urls: list[str], metrics_port: int, policy: str,
                     extra: tuple[str, ...] = ()) -> list[str]:
        """The command line that runs this gateway on loopback ``port`` in front of ``worker_urls``, each of which
        serves whole requests (its regular mode, not P/D): how it routes prefill work, with nothing between."""
        command = [arg for arg in self.mode if "pd-disaggregation" not in arg]
        return [str(venv / "bin" / self.script), *command, "--host", LOOPBACK, "--port", str(port),
                "--worker-urls", *worker_urls, "--policy", policy, "--prometheus-host", LOOPBACK,
                "--prometheus-port", str(metrics_port), "--log-level", self.log_level, *extra]


VLLM_ROUTER = Gateway("vllm-router (Rust)", "vllm-router", "0.1.17", "vllm-router", "vllm",
                      ("--vllm-pd-disaggregation",), (), "warning")
SMG = Gateway("smg (Rust)", "smg", "1.13.0", "smg", "sglang", ("launch", "--pd-disaggregation"),
              ("--disable-tokenizer-autoload", "--model-alias", f"{SYNTHETIC_MODEL}={MOCK_MODEL}"), "warn")
GATEWAYS = (VLLM_ROUTER, SMG)


@dataclass(frozen=True)
class Availability:
    gateway: Gateway
    available: bool
    note: str  # the version found, or why the gateway is skipped

    def as_dict(self) -> dict[str, Any]:
        return {"package": f"{self.gateway.package}=={self.gateway.version}", "available": self.available,
                "note": self.note}


# -- the side venv ----------------------------------------------------------------------------------------------
def installed_versions(venv: Path, gateways: tuple[Gateway, ...] = GATEWAYS) -> dict[str, str | None]:
    """The version of each gateway's package installed in ``venv`` (None: not there, or no usable venv)."""
    python = venv / "bin" / "python"
    found: dict[str, str | None] = {g.package: None for g in gateways}
    if not python.exists():
        return found
    probe = ("import json, sys\nfrom importlib.metadata import version, PackageNotFoundError\nout = {}\n"
             "for name in sys.argv[1:]:\n    try:\n        out[name] = version(name)\n"
             "    except PackageNotFoundError:\n        out[name] = None\nprint(json.dumps(out))\n")
    try:
        done = subprocess.run([str(python), "-c", probe, *found], capture_output=True, text=True, timeout=60,
                              env=_gateway_env())
        versions = orjson.loads(done.stdout) if done.returncode == 0 else {}
    except (OSError, subprocess.TimeoutExpired, orjson.JSONDecodeError):
        return found
    for gateway in gateways:
        found[gateway.package] = versions.get(gateway.package)
        if found[gateway.package] is not None and not (venv / "bin" / gateway.script).exists():
            found[gateway.package] = None
    return found


def _tail(text: str, lines: int = 3) -> str:
    kept = [line.strip() for line in text.strip().splitlines() if line.strip() and "is ignored" not in line]
    return " / ".join(kept[-lines:])[-600:] or "no output"


def _run_step(argv: list[str], timeout_s: float) -> str | None:
    """Run one install step; None when it worked, else why it did not."""
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=timeout_s, env=_gateway_env(),
                              stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired:
        return f"timed out after {timeout_s:.0f} s"
    except OSError as exc:
        return f"{type(exc).__name__}: {exc}"
    return None if done.returncode == 0 else f"exit {done.returncode}: {_tail(done.stderr or done.stdout)}"


def prepare(venv: Path = VENV_DIR, install: bool = True, gateways: tuple[Gateway, ...] = GATEWAYS,
            timeout_s: float = INSTALL_TIMEOUT_S, log: bool = True) -> dict[str, Availability]:
    """Find each gateway at its pinned version in ``venv``, installing it there (from PyPI) when it is missing and
    ``install`` is true. Never raises: a gateway that cannot be had is returned unavailable, with the reason."""
    found = installed_versions(venv, gateways)
    missing = [g for g in gateways if found[g.package] != g.version]
    reasons: dict[str, str] = {}
    if missing and not install:
        for gateway in missing:
            have = found[gateway.package]
            reasons[gateway.name] = (f"{gateway.package}=={gateway.version} is not installed in {venv}"
                                     + (f" (found {have})" if have else "")
                                     + "; run `python -m bench.peers.rust_gateways` to install it")
    elif missing:
        problem = None
        if not (venv / "bin" / "python").exists():
            if log:
                print(f"[rust_gateways] creating {venv}", file=sys.stderr, flush=True)
            problem = _run_step([PYTHON, "-m", "venv", str(venv)], 300.0)
            if problem is not None:
                problem = f"could not create the side venv {venv}: {problem}"
        for gateway in missing:
            if problem is not None:
                reasons[gateway.name] = problem
                continue
            spec = f"{gateway.package}=={gateway.version}"
            if log:
                print(f"[rust_gateways] pip install {spec} into {venv}", file=sys.stderr, flush=True)
            failed = _run_step([str(venv / "bin" / "python"), "-m", "pip", "install", "--quiet",
                                "--disable-pip-version-check", spec], timeout_s)
            if failed is not None:
                reasons[gateway.name] = f"pip install {spec} failed: {failed}"
        found = installed_versions(venv, gateways)
    out: dict[str, Availability] = {}
    for gateway in gateways:
        have = found[gateway.package]
        if have == gateway.version:
            out[gateway.name] = Availability(gateway, True, f"{gateway.package} {have}")
        else:
            reason = reasons.get(gateway.name) or (f"{gateway.package} {have or 'absent'} in {venv} after the "
                                                   f"install, not {gateway.version}")
            out[gateway.name] = Availability(gateway, False, reason)
            if log:
                print(f"[rust_gateways] skipping {gateway.name}: {reason}", file=sys.stderr, flush=True)
    return out


def _gateway_env() -> dict[str, str]:
    """The environment without the project's PYTHONPATH or virtual environment: the side venv is on its own."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV", "PYTHONHOME")}
    env.setdefault("RUST_LOG_STYLE", "never")
    env["NO_COLOR"] = "1"
    return env


# -- running one ------------------------------------------------------------------------------------------------
def start(processes: Processes, gateway: Gateway, prefill_url: str, decode_url: str, venv: Path = VENV_DIR,
          policy: str = "round_robin") -> Server:
    """Start ``gateway`` in front of the two legs; returns once it answers its health check (see ``wait_ready``
    for a request streamed through)."""
    port, metrics_port = free_port(), free_port()
    argv = gateway.argv(venv, port, prefill_url, decode_url, metrics_port, policy)
    server = processes.spawn(f"{gateway.script}-{port}", argv, f"http://{LOOPBACK}:{port}", env=_gateway_env())
    wait_healthy([server], READY_TIMEOUT_S)
    return server


def start_in_front_of(processes: Processes, gateway: Gateway, worker_urls: list[str], policy: str,
                      extra: tuple[str, ...] = (), venv: Path = VENV_DIR) -> Server:
    """Start ``gateway`` in its regular mode in front of ``worker_urls``; returns once it answers its health check
    (``wait_ready`` for a request streamed through)."""
    port, metrics_port = free_port(), free_port()
    argv = gateway.argv_workers(venv, port, worker_urls, metrics_port, policy, extra)
    server = processes.spawn(f"{gateway.script}-{port}", argv, f"http://{LOOPBACK}:{port}", env=_gateway_env())
    wait_healthy([server], READY_TIMEOUT_S)
    return server


def chat_body(prompt: str = "hello there", max_tokens: int = 8) -> dict[str, Any]:
    return {"model": SYNTHETIC_MODEL, "messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens,
            "temperature": 0, "stream": True}


def completions_body(prompt: str = "hello there", max_tokens: int = 8) -> dict[str, Any]:
    return {"model": SYNTHETIC_MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True}


ROUTES = {"chat": ("/v1/chat/completions", chat_body), "completions": ("/v1/completions", completions_body)}


def stream_once(url: str, endpoint: str = "chat", timeout_s: float = 30.0,
                body: dict[str, Any] | None = None) -> tuple[int, bytes]:
    """One streamed request through ``url`` (``body``, else the endpoint's default one): its status and its whole
    body."""
    path, default = ROUTES[endpoint]
    host, _, port = url.removeprefix("http://").partition(":")
    connection = http.client.HTTPConnection(host, int(port), timeout=timeout_s)
    try:
        connection.request("POST", path, orjson.dumps(body if body is not None else default()),
                           {"Content-Type": "application/json"})
        response = connection.getresponse()
        return response.status, response.read()
    finally:
        connection.close()


def mock_posts(server: Server) -> int:
    """How many POSTs a ``bench.peers.mock_workers`` process answered so far."""
    status, body = http_get(server.url, "/mock_stats")
    return int(orjson.loads(body)["posts"]) if status == 200 else -1


def wait_ready(gateway: Server, timeout_s: float = READY_TIMEOUT_S, body: dict[str, Any] | None = None) -> None:
    """Until a chat request (``body``, else a default one) streams through to ``[DONE]``: a gateway may answer its
    health check before it has registered its workers."""
    deadline = time.monotonic() + timeout_s
    last = ""
    while True:
        if gateway.process.poll() is not None:
            raise RuntimeError(f"{gateway.name} exited with status {gateway.process.returncode}:\n"
                               f"{gateway.log_tail()}")
        with contextlib.suppress(OSError, http.client.HTTPException):
            status, answer = stream_once(gateway.url, "chat", timeout_s=10.0, body=body)
            if status == 200 and b"[DONE]" in answer:
                return
            last = f"status {status}: {answer[:300]!r}"
        if time.monotonic() > deadline:
            raise RuntimeError(f"{gateway.name} streamed no answer within {timeout_s:.0f} s ({last}):\n"
                               f"{gateway.log_tail()}")
        time.sleep(0.2)


def check(venv: Path = VENV_DIR, install: bool = True) -> dict[str, Any]:
    """Each available gateway in front of the mocks: one chat and one completions request, what came back and how
    many POSTs each leg answered."""
    available = prepare(venv, install)
    report: dict[str, Any] = {}
    with Processes() as processes:
        gen_port = free_port()
        gen = processes.spawn("mock-gen", [PYTHON, "-m", "bench.peers.mock_workers", "--role", "gen", "--port",
                                           str(gen_port), "--frame-gap-ms", "1"], f"http://{LOOPBACK}:{gen_port}")
        for name, found in available.items():
            if not found.available:
                report[name] = {"skipped": found.note}
                continue
            ctx_port = free_port()
            ctx = processes.spawn(f"mock-ctx-{found.gateway.flavour}", [
                PYTHON, "-m", "bench.peers.mock_workers", "--role", "ctx", "--port", str(ctx_port), "--flavour",
                found.gateway.flavour], f"http://{LOOPBACK}:{ctx_port}")
            wait_healthy([ctx, gen], 60)
            server = start(processes, found.gateway, ctx.url, gen.url, venv)
            wait_ready(server)
            before = {"ctx": mock_posts(ctx), "gen": mock_posts(gen)}
            answers = {endpoint: stream_once(server.url, endpoint) for endpoint in ROUTES}
            report[name] = {
                "version": found.note,
                "answers": {e: {"status": s, "frames": body.count(b"data: "), "done": b"[DONE]" in body}
                            for e, (s, body) in answers.items()},
                "posts": {"ctx": mock_posts(ctx) - before["ctx"], "gen": mock_posts(gen) - before["gen"]},
            }
            processes.stop([server, ctx])
    return report


def main(argv: list[str] | None = None) -> int:
    parser = arguments(__doc__)
    parser.add_argument("--venv", type=Path, default=VENV_DIR, help="the side virtual environment")
    parser.add_argument("--no-install", action="store_true", help="only look for the gateways, install nothing")
    parser.add_argument("--check", action="store_true",
                        help="also stream requests through each gateway in front of the mock workers")
    args = parser.parse_args(argv)
    if args.check:
        print(orjson.dumps(check(args.venv, not args.no_install), option=orjson.OPT_INDENT_2).decode())
    else:
        for name, found in prepare(args.venv, not args.no_install).items():
            print(f"{name}: {'available' if found.available else 'skipped'} ({found.note})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
