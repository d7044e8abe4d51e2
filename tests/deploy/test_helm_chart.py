"""deploy/helm/disagg-serve: linted and rendered by Helm's own Go SDK (helm-python-sdk, offline), the manifests
valid against Kubernetes' schemas (kubernetes-validate, strict), shaped as documented, and describing a system
that serves: the rendered Deployments' arguments and environment, run as local processes, answer a chat completion
through the orchestrator's Service, for the default values and for a non-default set."""

from __future__ import annotations

import base64
import copy
import functools
import json
import re
import shutil
import socket
from pathlib import Path
from typing import Any

import helm_python as helm
import kubernetes_validate  # type: ignore[import-untyped]
import pytest
import yaml

from frontend.config import parse_config
from tests.deploy.dockerfile import Image
from tests.deploy.local_run import (
    REPO,
    LocalDeployment,
    ask_capital,
    assert_key_required,
    gen_prompt_paths,
    http_ok,
    local_deployment,
)

CHART = REPO / "deploy" / "helm" / "disagg-serve"
KUBERNETES_VERSION = "1.30.0"  # kubernetes-validate ships offline schemas for 1.25 ... 1.37
RELEASE, NAMESPACE = "llm", "serving"
PREFIX = f"{RELEASE}-disagg-serve"
EXISTING_SECRET = {"disagg-keys": {"api-key": "existing-secret-key"}}  # what an operator created beforehand

# Everything off the defaults that changes what is rendered or how it runs.
NON_DEFAULT: dict[str, Any] = {
    "logLevel": "debug",
    "engine": {"servedModelName": "smol-test", "blasThreads": 1},
    "auth": {"existingSecret": "disagg-keys"},
    "orchestrator": {
        "contextRouter": "least_loaded",
        "generationRouter": "prefix_affinity",
        "config": {"gen_tokids_metadata_only": True, "max_retries": 2},
        "autoscaling": {"enabled": True, "maxReplicas": 3},
        "podDisruptionBudget": {"enabled": True},
        "service": {"type": "LoadBalancer", "port": 80},
    },
    "ctx": {"autoscaling": {"enabled": True, "minReplicas": 2, "maxReplicas": 6},
            "podDisruptionBudget": {"enabled": True}},
    "gen": {"replicas": 3, "podDisruptionBudget": {"enabled": True, "minAvailable": "50%"},
            "extraEnv": [{"name": "DISAGG_MAX_CONCURRENT_REQUESTS", "value": "64"}]},
}
CREATED_SECRET: dict[str, Any] = {"auth": {"apiKey": "made-by-the-chart", "adminKey": "admin-made-by-the-chart"}}
VALUE_SETS = {"default": None, "non_default": NON_DEFAULT, "created_secret": CREATED_SECRET}


def render(values: dict[str, Any] | None) -> list[dict[str, Any]]:
    with helm.Chart.load(CHART) as chart:
        files = chart.render(values, name=RELEASE, namespace=NAMESPACE, is_install=True)
    return [doc for name, text in sorted(files.items()) if name.endswith(".yaml")
            for doc in yaml.safe_load_all(text) if doc]


def notes(values: dict[str, Any] | None) -> str:
    with helm.Chart.load(CHART) as chart:
        return chart.render(values, name=RELEASE, namespace=NAMESPACE)["disagg-serve/templates/NOTES.txt"]


def by_kind(manifests: list[dict[str, Any]]) -> dict[tuple[str, str], dict[str, Any]]:
    return {(m["kind"], m["metadata"]["name"]): m for m in manifests}


def container(deployment: dict[str, Any]) -> dict[str, Any]:
    [only] = deployment["spec"]["template"]["spec"]["containers"]
    return dict(only)


# -- Helm's own lint and Kubernetes' schemas ------------------------------------------------------------------
@pytest.mark.parametrize("values", VALUE_SETS.values(), ids=VALUE_SETS.keys())
def test_helm_lint_is_clean(values: dict[str, Any] | None) -> None:
    report = helm.lint(CHART, values, strict=True, namespace=NAMESPACE, kube_version=f"v{KUBERNETES_VERSION}")
    assert report["total_charts_linted"] == 1
    assert report["errors"] == []
    # Severity 1 is information ("icon is recommended"); 2 warnings and 3 errors would fail `helm lint --strict`.
    assert [m for m in report["messages"] if m["severity"] >= 2] == []


def test_helm_lint_fails_a_broken_copy(tmp_path: Path) -> None:
    """The same lint is not vacuous: a template that does not parse fails it."""
    broken = Path(shutil.copytree(CHART, tmp_path / "disagg-serve"))
    (broken / "templates" / "pdb.yaml").write_text("{{- if .Values.ctx }\n")
    report = helm.lint(broken, strict=True)
    assert report["errors"] or any(m["severity"] == 3 for m in report["messages"]), report


@pytest.mark.parametrize("values", VALUE_SETS.values(), ids=VALUE_SETS.keys())
def test_manifests_are_valid_kubernetes(values: dict[str, Any] | None) -> None:
    for manifest in render(values):
        kubernetes_validate.validate(manifest, KUBERNETES_VERSION, strict=True)


def test_kubernetes_validate_rejects_an_unknown_field() -> None:
    """The same validation is not vacuous: strict schemas refuse a misspelt field."""
    deployment = copy.deepcopy(by_kind(render(None))[("Deployment", f"{PREFIX}-ctx")])
    deployment["spec"]["replica"] = deployment["spec"].pop("replicas")
    with pytest.raises(kubernetes_validate.ValidationError, match="replica"):
        kubernetes_validate.validate(deployment, KUBERNETES_VERSION, strict=True)


# Blocks handed to Kubernetes verbatim: their comment documents them, their fields are Kubernetes' own.
_VERBATIM_BLOCKS = {"podSecurityContext", "securityContext", "resources", "startupProbe", "livenessProbe",
                    "readinessProbe"}


def test_every_value_is_documented() -> None:
    """Each key of values.yaml has a comment of its own on the line above (inside verbatim Kubernetes blocks,
    the block's comment serves)."""
    undocumented, verbatim_indent = [], -1
    lines = (CHART / "values.yaml").read_text().splitlines()
    for number, line in enumerate(lines, start=1):
        key = re.match(r"^( *)([A-Za-z_][\w]*):", line)
        if not key:
            continue
        indent = len(key.group(1))
        if 0 <= verbatim_indent < indent:
            continue
        verbatim_indent = indent if key.group(2) in _VERBATIM_BLOCKS else -1
        if not lines[number - 2].strip().startswith("#"):
            undocumented.append(f"{number}: {line.strip()}")
    assert undocumented == []


# -- what the chart renders -----------------------------------------------------------------------------------
def test_default_resources() -> None:
    resources = by_kind(render(None))
    assert sorted(resources) == sorted([
        ("ConfigMap", f"{PREFIX}-orchestrator"), ("ServiceAccount", PREFIX),
        *[(kind, f"{PREFIX}-{c}") for kind in ("Deployment", "Service") for c in ("orchestrator", "ctx", "gen")],
    ])  # HPA, PDB and Secret are all opt-in
    assert resources[("Service", f"{PREFIX}-orchestrator")]["spec"].get("clusterIP") != "None"
    for component in ("orchestrator", "ctx", "gen"):
        deployment = resources[("Deployment", f"{PREFIX}-{component}")]
        spec = deployment["spec"]["template"]["spec"]
        c = container(deployment)
        assert c["image"] == "disagg-serve:0.1.0" and "command" not in c  # the image's entrypoint: disagg-serve
        assert c["args"] == ["orchestrator" if component == "orchestrator" else "worker"]
        assert spec["securityContext"]["runAsNonRoot"] is True and spec["automountServiceAccountToken"] is False
        assert c["securityContext"]["readOnlyRootFilesystem"] is True
        assert c["securityContext"]["allowPrivilegeEscalation"] is False
        assert {"name": "tmp", "mountPath": "/tmp"} in c["volumeMounts"]
        assert {"name": "tmp", "emptyDir": {"sizeLimit": "64Mi"}} in spec["volumes"]
        assert c["readinessProbe"]["httpGet"] == {"path": "/health", "port": "http"}
        assert deployment["spec"]["replicas"] == 1
    for component, role in (("ctx", "context"), ("gen", "generation")):
        deployment = resources[("Deployment", f"{PREFIX}-{component}")]
        c = container(deployment)
        env = {e["name"]: e for e in c["env"]}
        assert env["DISAGG_ROLE"]["value"] == role and env["DISAGG_ENGINE"]["value"] == "reference"
        assert env["DISAGG_KV_ADVERTISE_HOST"]["valueFrom"] == {"fieldRef": {"fieldPath": "status.podIP"}}
        assert c["livenessProbe"]["httpGet"]["path"] == "/health"
        assert c["startupProbe"]["httpGet"]["path"] == "/health"
        service = resources[("Service", f"{PREFIX}-{component}")]["spec"]
        assert service["clusterIP"] == "None" and service["publishNotReadyAddresses"] is False
        assert service["selector"].items() <= deployment["spec"]["template"]["metadata"]["labels"].items()
    orchestrator = container(resources[("Deployment", f"{PREFIX}-orchestrator")])
    assert orchestrator["livenessProbe"] == {"tcpSocket": {"port": "http"}, "periodSeconds": 10,
                                             "timeoutSeconds": 5, "failureThreshold": 3}
    assert not any(e["name"] in ("DISAGG_API_KEY", "DISAGG_ADMIN_KEY") for e in orchestrator["env"])
    assert "WARNING: no API key is set" in notes(None)


def test_orchestrator_discovers_the_workers_headless_services() -> None:
    resources = by_kind(render(None))
    config = parse_config(yaml.safe_load(resources[("ConfigMap", f"{PREFIX}-orchestrator")]["data"]
                                         ["orchestrator.yaml"]))
    for pool, component in ((config.context_servers, "ctx"), (config.generation_servers, "gen")):
        assert pool.urls == [] and pool.discovery is not None
        assert pool.discovery.dns_name == f"{PREFIX}-{component}.{NAMESPACE}.svc.cluster.local"
        http = [p for p in resources[("Service", f"{PREFIX}-{component}")]["spec"]["ports"] if p["name"] == "http"]
        assert [p["port"] for p in http] == [pool.discovery.port]
    assert (config.hostname, config.port, config.gen_tokids_metadata_only) == ("0.0.0.0", 8000, False)


def test_non_default_values() -> None:
    resources = by_kind(render(NON_DEFAULT))
    hpas = {name: m["spec"] for (kind, name), m in resources.items() if kind == "HorizontalPodAutoscaler"}
    assert sorted(hpas) == [f"{PREFIX}-ctx", f"{PREFIX}-orchestrator"]
    assert (hpas[f"{PREFIX}-ctx"]["minReplicas"], hpas[f"{PREFIX}-ctx"]["maxReplicas"]) == (2, 6)
    assert hpas[f"{PREFIX}-ctx"]["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": "Deployment",
                                                       "name": f"{PREFIX}-ctx"}
    for name in hpas:  # the autoscaler owns the replica count
        assert "replicas" not in resources[("Deployment", name)]["spec"]
    assert resources[("Deployment", f"{PREFIX}-gen")]["spec"]["replicas"] == 3
    pdbs = {name: m["spec"] for (kind, name), m in resources.items() if kind == "PodDisruptionBudget"}
    assert sorted(pdbs) == [f"{PREFIX}-{c}" for c in ("ctx", "gen", "orchestrator")]
    assert pdbs[f"{PREFIX}-gen"]["minAvailable"] == "50%"
    assert not [k for k in resources if k[0] == "Secret"]  # an existing Secret is used, not made
    env = {e["name"]: e for e in container(resources[("Deployment", f"{PREFIX}-orchestrator")])["env"]}
    assert env["DISAGG_API_KEY"]["valueFrom"]["secretKeyRef"] == {"name": "disagg-keys", "key": "api-key",
                                                                  "optional": False}
    assert env["DISAGG_ADMIN_KEY"]["valueFrom"]["secretKeyRef"]["optional"] is True
    config = parse_config(yaml.safe_load(resources[("ConfigMap", f"{PREFIX}-orchestrator")]["data"]
                                         ["orchestrator.yaml"]))
    assert (config.gen_tokids_metadata_only, config.max_retries) == (True, 2)
    assert (config.context_servers.router.type, config.generation_servers.router.type) == \
        ("least_loaded", "prefix_affinity")
    assert resources[("Service", f"{PREFIX}-orchestrator")]["spec"]["type"] == "LoadBalancer"
    assert "WARNING" not in notes(NON_DEFAULT)


def test_api_key_from_a_value_makes_a_secret() -> None:
    resources = by_kind(render(CREATED_SECRET))
    secret = resources[("Secret", PREFIX)]
    assert {k: base64.b64decode(v).decode() for k, v in secret["data"].items()} == \
        {"api-key": "made-by-the-chart", "admin-key": "admin-made-by-the-chart"}
    env = {e["name"]: e for e in container(resources[("Deployment", f"{PREFIX}-orchestrator")])["env"]}
    assert env["DISAGG_API_KEY"]["valueFrom"]["secretKeyRef"] == {"name": PREFIX, "key": "api-key",
                                                                  "optional": False}
    assert "auth.apiKey is stored in this release's history" in notes(CREATED_SECRET)


# -- the rendered system, run ---------------------------------------------------------------------------------
def selected_deployment(resources: dict[tuple[str, str], dict[str, Any]], service: dict[str, Any]) -> str:
    """The Deployment whose pods a Service selects (exactly one, in this chart)."""
    selector = service["spec"]["selector"].items()
    [name] = [n for (kind, n), m in resources.items()
              if kind == "Deployment" and selector <= m["spec"]["template"]["metadata"]["labels"].items()]
    return name


def container_port(deployment: dict[str, Any], port: int | str) -> int:
    """A container port, by number or by name."""
    if isinstance(port, int):
        return port
    [number] = [p["containerPort"] for p in container(deployment)["ports"] if p["name"] == port]
    return int(number)


def service_target(resources: dict[tuple[str, str], dict[str, Any]], deployment: LocalDeployment,
                   service_name: str, port: int) -> str:
    """http://127.0.0.1:<local port> standing for <service>:<port>, as kube-proxy or cluster DNS would route it."""
    service = resources[("Service", service_name)]
    [entry] = [p for p in service["spec"]["ports"] if p["port"] == port]
    name = selected_deployment(resources, service)
    number = container_port(resources[("Deployment", name)], entry["targetPort"])
    return f"http://127.0.0.1:{deployment.port(name, number)}"


def local_environment(resources: dict[tuple[str, str], dict[str, Any]], name: str, deployment: LocalDeployment,
                      secrets: dict[str, dict[str, str]]) -> dict[str, str]:
    """A container's environment as the kubelet would give it, then mapped onto loopback."""
    env: dict[str, str] = {}
    for item in container(resources[("Deployment", name)])["env"]:
        source = item.get("valueFrom")
        if source is None:
            env[item["name"]] = str(item["value"])
        elif source.get("fieldRef") == {"fieldPath": "status.podIP"}:
            env[item["name"]] = "127.0.0.1"  # every "pod" here lives on loopback
        elif "secretKeyRef" in source:
            ref = source["secretKeyRef"]
            value = secrets.get(ref["name"], {}).get(ref["key"])
            assert value is not None or ref.get("optional"), f"{name}: Secret {ref} missing; the pod would not start"
            if value is not None:
                env[item["name"]] = value
        else:
            raise AssertionError(f"{name}: no local equivalent for {item}")
    return deployment.loopback_environment(name, {**Image.read().disagg_environment, **env}, hosts=set())


def mount_config(resources: dict[tuple[str, str], dict[str, Any]], name: str, env: dict[str, str],
                 deployment: LocalDeployment) -> None:
    """Materialise the orchestrator's ConfigMap volume and point DISAGG_CONFIG into it. The one change to the
    file: DNS discovery becomes the static URLs it would resolve to, since there is no cluster DNS here."""
    spec = resources[("Deployment", name)]["spec"]["template"]["spec"]
    [mount] = [m for m in container(resources[("Deployment", name)])["volumeMounts"]
               if env["DISAGG_CONFIG"].startswith(m["mountPath"] + "/")]
    [volume] = [v for v in spec["volumes"] if v["name"] == mount["name"]]
    data = resources[("ConfigMap", volume["configMap"]["name"])]["data"]
    raw = yaml.safe_load(data[env["DISAGG_CONFIG"][len(mount["mountPath"]) + 1:]])
    parse_config(raw)  # the file as rendered (with discovery) is valid as it stands
    domain = f".{NAMESPACE}.svc.cluster.local"
    for pool in ("context_servers", "generation_servers"):
        discovery = raw[pool].pop("discovery")
        assert discovery["dns_name"].endswith(domain) and discovery["scheme"] == "http", discovery
        raw[pool]["urls"] = [service_target(resources, deployment, discovery["dns_name"].removesuffix(domain),
                                            discovery["port"])]
    path = deployment.workdir / "orchestrator.yaml"
    path.write_text(yaml.safe_dump(raw))
    env["DISAGG_CONFIG"] = str(path)


def probe_passes(resources: dict[tuple[str, str], dict[str, Any]], name: str, deployment: LocalDeployment,
                 kind: str) -> bool:
    """One of the container's probes (httpGet or tcpSocket), as the kubelet runs it, against the local port."""
    manifest = resources[("Deployment", name)]
    probe = container(manifest)[kind]
    if "httpGet" in probe:
        port = deployment.port(name, container_port(manifest, probe["httpGet"]["port"]))
        return http_ok(f"http://127.0.0.1:{port}{probe['httpGet']['path']}")
    port = deployment.port(name, container_port(manifest, probe["tcpSocket"]["port"]))
    try:
        socket.create_connection(("127.0.0.1", port), timeout=2).close()
    except OSError:
        return False
    return True


def run_chart(values: dict[str, Any] | None, tmp_path: Path, engine: str | None) -> None:
    """Start every Deployment at once (as Kubernetes would), wait for every readiness probe, then ask the
    orchestrator's Service. ``engine`` overrides DISAGG_ENGINE in the workers' environment, for speed."""
    resources = by_kind(render(values))
    secrets = {n: {k: base64.b64decode(v).decode() for k, v in m.get("data", {}).items()}
               for (kind, n), m in resources.items() if kind == "Secret"} | EXISTING_SECRET
    api_key = secrets.get((values or {}).get("auth", {}).get("existingSecret") or PREFIX, {}).get("api-key")
    deployments = [n for kind, n in resources if kind == "Deployment"]
    with local_deployment(tmp_path) as deployment:
        for name in deployments:
            env = local_environment(resources, name, deployment, secrets)
            if engine and "DISAGG_ENGINE" in env:
                env["DISAGG_ENGINE"] = engine
            if "DISAGG_CONFIG" in env:
                mount_config(resources, name, env, deployment)
            deployment.start(name, Image.read().entrypoint, container(resources[("Deployment", name)])["args"],
                             env)
        for name in deployments:
            deployment.wait_until(name, functools.partial(probe_passes, resources, name, deployment, "readinessProbe"),
                                  90, "ready")
        for name in deployments:
            for kind in ("startupProbe", "livenessProbe"):
                if kind in container(resources[("Deployment", name)]):
                    assert probe_passes(resources, name, deployment, kind), f"{name}: {kind} fails when ready"
        orchestrator = resources[("Service", f"{PREFIX}-orchestrator")]
        url = service_target(resources, deployment, orchestrator["metadata"]["name"],
                             orchestrator["spec"]["ports"][0]["port"])
        model, _ = ask_capital(url, api_key)
        expected = (values or {}).get("engine", {}).get("servedModelName") or engine
        assert model == expected
        if api_key:
            assert_key_required(url)
        metadata_only = (values or {}).get("orchestrator", {}).get("config", {}).get("gen_tokids_metadata_only")
        gen = service_target(resources, deployment, f"{PREFIX}-gen", 8002)
        paths = gen_prompt_paths(gen)  # one request, which reached GEN the way the config says
        assert paths == {"metadata_only" if metadata_only else "array": 1.0}, paths


def test_default_values_serve(tmp_path: Path) -> None:
    run_chart(None, tmp_path, engine="synthetic")


def test_non_default_values_serve(tmp_path: Path) -> None:
    """Metadata-only, an existing Secret's API key, other routers, a served model name, extra env."""
    run_chart(NON_DEFAULT, tmp_path, engine="synthetic")


def test_the_grafana_dashboard_is_an_opt_in_configmap_for_grafanas_sidecar() -> None:
    assert not [m for m in render(None) if m["metadata"]["name"].endswith("grafana-dashboard")]
    resources = by_kind(render({"grafanaDashboard": {"enabled": True}}))
    configmap = resources[("ConfigMap", f"{PREFIX}-grafana-dashboard")]
    assert configmap["metadata"]["labels"]["grafana_dashboard"] == "1"
    shipped = json.loads((REPO / "deploy" / "grafana" / "disagg-serve.json").read_text())
    assert json.loads(configmap["data"]["disagg-serve.json"]) == shipped  # the chart links to the one file
