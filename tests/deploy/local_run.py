"""Run what a deployment file describes as local processes on loopback, and use it with the official client.

A container runs the image's ENTRYPOINT (``disagg-serve``, i.e. ``entrypoints.cli:main`` as pyproject.toml installs
it) followed by the service's arguments; here that is ``[sys.executable, "-m", "entrypoints.cli", *args]``. The
environment is the file's own, with only the substitutions that one shared loopback interface forces, where each
container had a network namespace and a DNS name of its own (see ``loopback_environment``):

- DISAGG_HOST / DISAGG_KV_HOST ``0.0.0.0`` -> ``127.0.0.1`` (listen on loopback only);
- each service's container ports (DISAGG_PORT, DISAGG_KV_PORT) -> free local ports, one per (service, port);
- a service's host name (DISAGG_KV_ADVERTISE_HOST) -> ``127.0.0.1``.

Worker URLs in the orchestrator's YAML, and the Responses store's URL, are mapped the same way by the callers, which
know where they come from.

A Redis container (an official redis image: its entrypoint runs its arguments) runs as Debian's ``redis-server``
with the container's arguments, on a free loopback port, with a folder of its own for ``/data``
(``redis_arguments``).
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

import httpx
import openai
from prometheus_client.parser import text_string_to_metric_families

from entrypoints.launcher import free_port
from frontend.process_lifetime import die_with_parent

REPO = Path(__file__).resolve().parents[2]
ENTRYPOINT = ["disagg-serve"]  # the image's, checked against deploy/Dockerfile by test_dockerfile.py
_ENTRYPOINT_HERE = [sys.executable, "-m", "entrypoints.cli"]
_PORT_VARIABLES = ("DISAGG_PORT", "DISAGG_KV_PORT")
_BIND_VARIABLES = ("DISAGG_HOST", "DISAGG_KV_HOST")
_STOP_GRACE_S = 20.0
QUESTION = "What is the capital of France?"


def clean_environment() -> dict[str, str]:
    """This process's environment without any DISAGG_* setting of the developer's: only the file's count."""
    return {k: v for k, v in os.environ.items() if not k.startswith("DISAGG_")}


@dataclass
class Process:
    service: str
    popen: subprocess.Popen[bytes]
    log_path: Path

    def log_tail(self, chars: int = 3000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-chars:]
        except OSError:
            return ""


class LocalDeployment:
    """The processes of one deployment; ``stop`` ends every one of them (SIGTERM, then SIGKILL)."""

    def __init__(self, workdir: Path) -> None:
        self.workdir = workdir
        self.processes: dict[str, Process] = {}
        self._ports: dict[tuple[str, int], int] = {}

    def port(self, service: str, container_port: int) -> int:
        """The local port standing for ``service``'s container port (the same one every time it is asked)."""
        key = (service, int(container_port))
        if key not in self._ports:
            self._ports[key] = free_port()
        return self._ports[key]

    def loopback_environment(self, service: str, env: Mapping[str, str], hosts: set[str]) -> dict[str, str]:
        """``env`` as the container has it, mapped onto loopback (the module docstring lists every change)."""
        mapped = dict(env)
        for name in _BIND_VARIABLES:
            if mapped.get(name) == "0.0.0.0":
                mapped[name] = "127.0.0.1"
        for name in _PORT_VARIABLES:
            if name in mapped:
                mapped[name] = str(self.port(service, int(mapped[name])))
        if mapped.get("DISAGG_KV_ADVERTISE_HOST") in hosts:
            mapped["DISAGG_KV_ADVERTISE_HOST"] = "127.0.0.1"
        return mapped

    def start(self, service: str, entrypoint: list[str], args: list[str], env: Mapping[str, str]) -> Process:
        assert entrypoint == ENTRYPOINT, f"{service}: unexpected entrypoint {entrypoint}"
        assert service not in self.processes, f"{service} started twice"
        log_path = self.workdir / f"{service}.log"
        with log_path.open("wb") as log:
            popen = subprocess.Popen([*_ENTRYPOINT_HERE, *args], cwd=REPO, env={**clean_environment(), **env},
                                     stdout=log, stderr=subprocess.STDOUT, preexec_fn=die_with_parent)
        process = Process(service, popen, log_path)
        self.processes[service] = process
        return process

    def start_program(self, service: str, command: list[str], env: Mapping[str, str]) -> Process:
        """A process that is not the image's entrypoint (the Redis of a deployment), run in its own folder."""
        assert service not in self.processes, f"{service} started twice"
        log_path = self.workdir / f"{service}.log"
        with log_path.open("wb") as log:
            popen = subprocess.Popen(command, cwd=self.workdir, env={**clean_environment(), **env}, stdout=log,
                                     stderr=subprocess.STDOUT, preexec_fn=die_with_parent)
        process = Process(service, popen, log_path)
        self.processes[service] = process
        return process

    def redis_arguments(self, service: str, args: list[str], container_port: int) -> list[str]:
        """A Redis container's arguments as a local ``redis-server`` command: its port the local one standing for
        ``container_port``, bound to loopback, its ``/data`` a folder of the work directory."""
        assert args[0] == "redis-server", f"{service}: not a redis-server command: {args}"
        options, rest = [], list(args[1:])
        while rest:
            option = rest.pop(0)
            value = rest.pop(0) if rest and not rest[0].startswith("--") else None
            if option == "--port":
                assert value == str(container_port), f"{service}: --port {value}, but port {container_port}"
            elif option == "--dir":
                assert value == "/data", f"{service}: --dir {value}: the volume is mounted at /data"
            else:
                options += [option] if value is None else [option, value]
        data = self.workdir / f"{service}-data"
        data.mkdir(exist_ok=True)
        return ["redis-server", *options, "--port", str(self.port(service, container_port)), "--bind", "127.0.0.1",
                "--dir", str(data), "--daemonize", "no"]

    def volume(self, name: str) -> Path:
        """A named volume of the project: a folder of the work directory, the same for every service that mounts
        it (created as Docker creates a new one, empty)."""
        path = self.workdir / "volumes" / name
        path.mkdir(parents=True, exist_ok=True)
        return path

    def wait_until_done(self, service: str, timeout_s: float) -> None:
        """A one-shot service: wait for its process to exit, and fail unless it exited 0 (compose's
        ``service_completed_successfully``)."""
        process = self.processes[service]
        try:
            code = process.popen.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired as exc:
            raise AssertionError(f"{service}: still running after {timeout_s:.0f} s:\n{self.logs()}") from exc
        assert code == 0, f"{service} exited {code}:\n{process.log_tail()}"

    def wait_until(self, service: str, check: Callable[[], bool], timeout_s: float, what: str) -> None:
        """Poll ``check`` until it holds; fail at once if the process exits, or after ``timeout_s``."""
        process = self.processes[service]
        deadline = time.monotonic() + timeout_s
        while not check():
            if process.popen.poll() is not None:
                raise AssertionError(f"{service} exited ({process.popen.returncode}) before {what}:\n"
                                     f"{process.log_tail()}")
            if time.monotonic() > deadline:
                raise AssertionError(f"{service}: not {what} after {timeout_s:.0f} s:\n{self.logs()}")
            time.sleep(0.25)

    def logs(self) -> str:
        return "\n".join(f"--- {p.service} ---\n{p.log_tail()}" for p in self.processes.values())

    def stop(self) -> None:
        """SIGTERM to every process at once (each drains on its own), then SIGKILL to any still running after
        its grace period."""
        for process in self.processes.values():
            if process.popen.poll() is None:
                process.popen.send_signal(signal.SIGTERM)
        for process in self.processes.values():
            try:
                process.popen.wait(timeout=_STOP_GRACE_S)
            except subprocess.TimeoutExpired:
                process.popen.kill()
                process.popen.wait(timeout=_STOP_GRACE_S)


@contextlib.contextmanager
def local_deployment(workdir: Path) -> Iterator[LocalDeployment]:
    deployment = LocalDeployment(workdir)
    try:
        yield deployment
    finally:
        deployment.stop()


def with_address(url: str, host: str, port: int) -> str:
    """``url`` with another host and port; scheme, user, password and path as they were."""
    parts = urlsplit(url)
    userinfo = parts.netloc.rpartition("@")[0]
    return urlunsplit(parts._replace(netloc=f"{userinfo}@{host}:{port}" if userinfo else f"{host}:{port}"))


def http_ok(url: str) -> bool:
    try:
        return httpx.get(url, timeout=2.0).status_code == 200
    except httpx.HTTPError:
        return False


def command_ok(command: list[str], env: Mapping[str, str]) -> bool:
    """Run a health-check command (as a container runtime would) and say whether it exited 0."""
    try:
        return subprocess.run(command, env={**clean_environment(), **env}, cwd=REPO, capture_output=True,
                              timeout=15).returncode == 0
    except subprocess.TimeoutExpired:
        return False


def ask_capital(base_url: str, api_key: str | None) -> tuple[str, str]:
    """One greedy chat completion through the orchestrator with the official client: (model id, reply text)."""
    with openai.OpenAI(base_url=base_url + "/v1", api_key=api_key or "unused", max_retries=0,
                       timeout=120) as client:
        model = client.models.list().data[0].id
        reply = client.chat.completions.create(model=model, messages=[{"role": "user", "content": QUESTION}],
                                               max_tokens=16, temperature=0)
    content = reply.choices[0].message.content
    assert content, f"empty reply: {reply}"
    return model, content


def assert_key_required(base_url: str) -> None:
    """With an API key configured, a client with another key is refused with 401 before any work is done."""
    with openai.OpenAI(base_url=base_url + "/v1", api_key="not-the-key", max_retries=0, timeout=30) as client:
        try:
            client.chat.completions.create(model="any", messages=[{"role": "user", "content": QUESTION}],
                                           max_tokens=4)
        except openai.AuthenticationError:
            return
    raise AssertionError("the orchestrator served a client holding the wrong API key")


def gen_prompt_paths(gen_url: str) -> dict[str, float]:
    """How the GEN worker received its prompts (``disagg_gen_prompt_path_total{path}``): array, list, metadata_only;
    the paths taken only (every path is exported, at 0 until taken)."""
    text = httpx.get(gen_url + "/metrics", timeout=5.0).text
    return {sample.labels["path"]: sample.value
            for family in text_string_to_metric_families(text) if family.name == "disagg_gen_prompt_path"
            for sample in family.samples if sample.name == "disagg_gen_prompt_path_total" and sample.value}
