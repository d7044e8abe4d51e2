"""What every benchmark shares: the machine's description, statistics, CPU accounting from /proc, and servers
started as real ``disagg-serve`` subprocesses on loopback that are always stopped (SIGTERM, then SIGKILL)."""

from __future__ import annotations

import contextlib
import http.client
import json
import math
import os
import platform
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson

# The statistics live with the packaged load generator (`disagg-serve bench`); re-exported for bench/'s modules.
from entrypoints.bench.statistics import finite as finite
from entrypoints.bench.statistics import percentile as percentile
from entrypoints.bench.statistics import summarize as summarize

REPO_ROOT = Path(__file__).resolve().parent.parent
PYTHON = sys.executable
LOOPBACK = "127.0.0.1"
_CLK_TCK = os.sysconf("SC_CLK_TCK")
_GRACE_S = 10.0


# -- the machine ---------------------------------------------------------------------------------------------
def machine_info() -> dict[str, Any]:
    """What the figures were measured on: CPU model, cores, memory, and the versions that matter here."""
    cpu_model, flags = "unknown", ""
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "model name" and cpu_model == "unknown":
                cpu_model = value.strip()
            if key.strip() == "flags" and not flags:
                flags = value.strip()
    mem_gib = None
    with contextlib.suppress(OSError, ValueError, IndexError):
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                mem_gib = round(int(line.split()[1]) / 1024**2, 1)
    versions = {}
    for name in ("numpy", "orjson", "pybase64", "pydantic", "fastapi", "uvicorn", "uvloop", "httptools", "httpx"):
        with contextlib.suppress(Exception):
            from importlib.metadata import version

            versions[name] = version(name)
    return {
        "cpu_model": cpu_model,
        "nproc": os.cpu_count(),
        "sched_affinity": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
        "avx2": "avx2" in flags.split(),
        "avx512f": "avx512f" in flags.split(),
        "mem_gib": mem_gib,
        "kernel": platform.release(),
        "python": platform.python_version(),
        "python_impl": platform.python_implementation(),
        "versions": versions,
        "loadavg_at_start": loadavg(),
    }


def loadavg() -> list[float] | None:
    try:
        return [float(x) for x in Path("/proc/loadavg").read_text().split()[:3]]
    except (OSError, ValueError):
        return None


# -- statistics ----------------------------------------------------------------------------------------------
def ratio(numerator: float, denominator: float) -> float:
    """numerator / denominator, NaN when the denominator is not positive (e.g. under one 10 ms CPU tick)."""
    return numerator / denominator if denominator > 0 else math.nan


def median(values: Sequence[float]) -> float:
    return percentile(values, 50)


def write_json(path: Path, payload: Any) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(finite(payload), indent=2, sort_keys=False) + "\n")


# -- CPU accounting ------------------------------------------------------------------------------------------
def cpu_seconds(pid: int) -> float:
    """utime + stime of one process (all its threads), from /proc/<pid>/stat."""
    with open(f"/proc/{pid}/stat", "rb") as f:
        raw = f.read()
    fields = raw[raw.rindex(b")") + 2 :].split()  # after "(comm) ": fields[0] is state (field 3)
    return (int(fields[11]) + int(fields[12])) / _CLK_TCK  # fields 14 and 15 of proc(5)


def machine_busy_seconds() -> float:
    """CPU seconds all cores spent busy since boot (/proc/stat: everything but idle and iowait)."""
    with open("/proc/stat", "rb") as f:
        fields = [int(x) for x in f.readline().split()[1:]]
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)
    busy = sum(fields[:8]) - idle  # user nice system idle iowait irq softirq steal; guest is inside user
    return busy / _CLK_TCK


def busy_cores(interval_s: float = 0.5) -> float:
    """How many cores were busy (anything at all) over the next ``interval_s`` seconds."""
    b0, t0 = machine_busy_seconds(), time.monotonic()
    time.sleep(interval_s)
    return (machine_busy_seconds() - b0) / max(time.monotonic() - t0, 1e-9)


def wait_for_quiet(max_wait_s: float, threshold_cores: float = 0.35) -> dict[str, float]:
    """Wait (at most ``max_wait_s``) until the machine is nearly idle, so that another user's test run does not
    land in a measurement; returns how long it waited and how busy the machine was when it stopped waiting."""
    started = time.monotonic()
    busy = busy_cores(0.3) if max_wait_s > 0 else math.nan
    while max_wait_s > 0 and busy > threshold_cores and time.monotonic() - started < max_wait_s:
        busy = busy_cores(0.5)
    return {"waited_s": time.monotonic() - started, "busy_cores": busy}


def descendants(pid: int) -> list[int]:
    """``pid`` and every live process below it (engine cores, extra API worker processes)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as f:
                raw = f.read()
            parent = int(raw[raw.rindex(b")") + 2 :].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        children.setdefault(parent, []).append(int(entry))
    found, stack = [], [pid]
    while stack:
        current = stack.pop()
        found.append(current)
        stack.extend(children.get(current, ()))
    return found


def tree_cpu_seconds(pid: int) -> float:
    total = 0.0
    for member in descendants(pid):
        with contextlib.suppress(OSError, ValueError, IndexError):
            total += cpu_seconds(member)
    return total


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


# -- report helpers ------------------------------------------------------------------------------------------
def markdown_table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    def cell(value: Any) -> str:
        if value is None or (isinstance(value, float) and not math.isfinite(value)):
            return "–"
        return str(value)

    lines = ["| " + " | ".join(headers) + " |", "| " + " | ".join("---" for _ in headers) + " |"]
    lines += ["| " + " | ".join(cell(v) for v in row) + " |" for row in rows]
    return "\n".join(lines)


def fmt(value: float | None, digits: int = 2) -> str:
    if value is None or (isinstance(value, float) and not math.isfinite(value)):
        return "–"
    return f"{value:.{digits}f}"


@contextlib.contextmanager
def timed(label: str, log: list[str] | None = None) -> Iterator[None]:
    started = time.perf_counter()
    try:
        yield
    finally:
        message = f"[bench] {label}: {time.perf_counter() - started:.1f} s"
        print(message, file=sys.stderr, flush=True)
        if log is not None:
            log.append(message)


def print_and_save(result: dict[str, Any], tables: Callable[[dict[str, Any]], str], json_path: str | None) -> int:
    """The end of every benchmark's ``main``: add the machine, print the tables, write the JSON if asked."""
    result["machine"] = machine_info()
    print(tables(result))
    if json_path:
        write_json(Path(json_path), result)
    return 0
