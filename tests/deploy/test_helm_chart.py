"""deploy/helm/disagg-serve: linted and rendered by Helm's own Go SDK (helm-python-sdk, offline), the manifests
valid against Kubernetes' schemas (kubernetes-validate, strict), shaped as documented, and describing a system
that serves: the rendered Deployments' (and the chart's Redis StatefulSet's) arguments and environment, run as local
processes, answer a chat completion through the orchestrator's Service, and carry a Responses API conversation from
one orchestrator pod to another through the shared store, for the default values and for non-default sets."""

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
from urllib.parse import urlsplit

import helm_python as helm
import kubernetes_validate  # type: ignore[import-untyped]
import openai
import pytest
import redis
import yaml

from frontend.config import parse_config
from frontend.internal_secret import InternalSecret
from tests.deploy.dockerfile import Image
from tests.deploy.local_run import (
    REPO,
    LocalDeployment,
    ask_capital,
    assert_key_required,
    command_ok,
    gen_prompt_paths,
    http_ok,
    local_deployment,
    with_address,
)

CHART = REPO / "deploy" / "helm" / "disagg-serve"
KUBERNETES_VERSION = "1.30.0"  # kubernetes-validate ships offline schemas for 1.25 ... 1.37
RELEASE, NAMESPACE = "llm", "serving"
PREFIX = f"{RELEASE}-disagg-serve"
# A Redis the operator runs outside the chart, and the Secrets an operator created beforehand.
EXTERNAL_REDIS = "redis://:operators-password@redis.example.internal:6379/0"
EXISTING_SECRET = {"disagg-keys": {"api-key": "existing-secret-key"}, "disagg-store": {"redis-url": EXTERNAL_REDIS},
                   "disagg-internal": {"shared-token": "the-operators-own-internal-token"}}
SERVICE_DOMAIN = f".{NAMESPACE}.svc.cluster.local"

# Everything off the defaults that changes what is rendered or how it runs.
NON_DEFAULT: dict[str, Any] = {
    "logLevel": "debug",
    "engine": {"servedModelName": "smol-test", "blasThreads": 1},
    "auth": {"existingSecret": "disagg-keys"},
    "internalSecret": {"existingSecret": "disagg-internal", "existingSecretKey": "shared-token"},
    "networkPolicy": {"extraIngress": [{"from": [{"namespaceSelector": {"matchLabels": {"name": "monitoring"}}}],
                                        "ports": [{"port": "http", "protocol": "TCP"}]}]},
    "orchestrator": {
        "contextRouter": "least_loaded",
        "generationRouter": "prefix_affinity",
        "maxRunningPrefills": 2,
        "config": {"gen_tokids_metadata_only": True, "max_retries": 2},
        "autoscaling": {"enabled": True, "maxReplicas": 3},
        "podDisruptionBudget": {"enabled": True},
        "service": {"type": "LoadBalancer", "port": 80},
        "responseStore": {"existingSecret": "disagg-store", "existingSecretKey": "redis-url"},
    },
    "ctx": {"autoscaling": {"enabled": True, "minReplicas": 2, "maxReplicas": 6},
            "podDisruptionBudget": {"enabled": True}},
    "gen": {"replicas": 3, "podDisruptionBudget": {"enabled": True, "minAvailable": "50%"},
            "extraEnv": [{"name": "DISAGG_MAX_CONCURRENT_REQUESTS", "value": "64"}]},
}
CREATED_SECRET: dict[str, Any] = {
    "auth": {"apiKey": "made-by-the-chart", "adminKey": "admin-made-by-the-chart"},
    "orchestrator": {"responseStore": {"url": "rediss://:made%2Bby-the-chart@redis.example.internal:6380/2"}},
}
# The chart runs the Redis that two orchestrator pods share.
CHART_REDIS: dict[str, Any] = {"redis": {"enabled": True}, "orchestrator": {"replicas": 2}}
VALUE_SETS = {"default": None, "non_default": NON_DEFAULT, "created_secret": CREATED_SECRET,
              "chart_redis": CHART_REDIS}


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


def container(workload: dict[str, Any]) -> dict[str, Any]:
    """The one container of a Deployment's or StatefulSet's pods."""
    [only] = workload["spec"]["template"]["spec"]["containers"]
    return dict(only)


def env_of(workload: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {e["name"]: e for e in container(workload)["env"]}


def decoded(secret: dict[str, Any]) -> dict[str, str]:
    return {k: base64.b64decode(v).decode() for k, v in secret.get("data", {}).items()}


def redis_client_settings(url: str) -> dict[str, Any]:
    """What redis-py, the orchestrator's client, makes of a store URL."""
    settings: dict[str, Any] = redis.ConnectionPool.from_url(url).connection_kwargs
    return settings


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
        ("Secret", f"{PREFIX}-internal"), *[("NetworkPolicy", f"{PREFIX}-{c}") for c in ("ctx", "gen")],
    ])  # HPA, PDB and the keys' Secret are opt-in; the deployment secret and the workers' policies are not
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
    assert not any(e["name"] == "DISAGG_RESPONSE_STORE_URL" for e in orchestrator["env"])  # the memory store
    assert "WARNING: no API key is set" in notes(None)
    assert "Responses" not in notes(None)  # one orchestrator pod: its memory store is enough


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


@pytest.mark.parametrize(("drain", "pre_stop"), [(None, None), (120, 0)], ids=["default", "long_drain_no_pre_stop"])
def test_a_workers_grace_period_follows_its_drain_and_its_pre_stop_sleep(drain: int | None,
                                                                         pre_stop: int | None) -> None:
    given = {} if drain is None else {c: {"drainTimeoutSeconds": drain, "preStopSleepSeconds": pre_stop}
                                      for c in ("ctx", "gen")}
    resources = by_kind(render(given or None))
    drain, pre_stop = drain or 30, 5 if pre_stop is None else pre_stop
    for component in ("ctx", "gen"):
        deployment = resources[("Deployment", f"{PREFIX}-{component}")]
        assert env_of(deployment)["DISAGG_DRAIN_TIMEOUT_S"]["value"] == str(drain)  # the worker's --drain-timeout-s
        assert deployment["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] == pre_stop + drain + 10
        lifecycle = container(deployment).get("lifecycle")
        if pre_stop:
            assert lifecycle == {"preStop": {"exec": {"command": ["sleep", str(pre_stop)]}}}
        else:
            assert lifecycle is None


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
    assert env["DISAGG_RESPONSE_STORE_URL"]["valueFrom"] == {"secretKeyRef": {"name": "disagg-store",
                                                                             "key": "redis-url"}}
    assert not [k for k in resources if k[0] == "StatefulSet"]  # the operator's Redis, not the chart's
    config = parse_config(yaml.safe_load(resources[("ConfigMap", f"{PREFIX}-orchestrator")]["data"]
                                         ["orchestrator.yaml"]))
    assert (config.gen_tokids_metadata_only, config.max_retries) == (True, 2)
    assert (config.context_servers.router.type, config.generation_servers.router.type) == \
        ("least_loaded", "prefix_affinity")
    assert config.context_servers.max_running_prefills == 2
    assert resources[("Service", f"{PREFIX}-orchestrator")]["spec"]["type"] == "LoadBalancer"
    assert "WARNING" not in notes(NON_DEFAULT)  # autoscaled orchestrators, and a store they share
    assert "the Redis named in Secret disagg-store (key redis-url)" in notes(NON_DEFAULT)


def test_api_key_from_a_value_makes_a_secret() -> None:
    resources = by_kind(render(CREATED_SECRET))
    secret = resources[("Secret", PREFIX)]
    assert {k: base64.b64decode(v).decode() for k, v in secret["data"].items()} == \
        {"api-key": "made-by-the-chart", "admin-key": "admin-made-by-the-chart"}
    env = {e["name"]: e for e in container(resources[("Deployment", f"{PREFIX}-orchestrator")])["env"]}
    assert env["DISAGG_API_KEY"]["valueFrom"]["secretKeyRef"] == {"name": PREFIX, "key": "api-key",
                                                                  "optional": False}
    assert "auth.apiKey is stored in this release's history" in notes(CREATED_SECRET)


def test_store_url_from_a_value_makes_a_secret() -> None:
    resources = by_kind(render(CREATED_SECRET))
    url = CREATED_SECRET["orchestrator"]["responseStore"]["url"]
    assert decoded(resources[("Secret", f"{PREFIX}-response-store")]) == {"url": url}  # as given, nothing else
    env = env_of(resources[("Deployment", f"{PREFIX}-orchestrator")])
    assert env["DISAGG_RESPONSE_STORE_URL"]["valueFrom"] == {"secretKeyRef": {"name": f"{PREFIX}-response-store",
                                                                             "key": "url"}}
    assert not [k for k in resources if k[0] == "StatefulSet"]
    assert "url" not in (parse_config(yaml.safe_load(resources[("ConfigMap", f"{PREFIX}-orchestrator")]["data"]
                                                     ["orchestrator.yaml"])).response_store.model_fields_set)
    assert "orchestrator.responseStore.url is stored in this release's history" in notes(CREATED_SECRET)


# -- the chart's own Redis -------------------------------------------------------------------------------------
def test_no_redis_unless_enabled() -> None:
    for values in (None, NON_DEFAULT, CREATED_SECRET):
        assert not [name for kind, name in by_kind(render(values)) if name.endswith("-redis")]


def test_the_charts_redis_is_a_persistent_statefulset_the_orchestrator_reaches_through_a_secret() -> None:
    resources = by_kind(render(CHART_REDIS))
    name = f"{PREFIX}-redis"
    statefulset = resources[("StatefulSet", name)]
    spec, pod = statefulset["spec"], statefulset["spec"]["template"]["spec"]
    assert spec["replicas"] == 1 and spec["serviceName"] == name
    c = container(statefulset)
    assert c["image"] == "redis:7.2.7-alpine"  # pinned, not latest
    args = c["args"]
    assert args[0] == "redis-server"
    options = dict(zip(args[1::2], args[2::2], strict=True))
    assert options["--appendonly"] == "yes" and options["--dir"] == "/data"
    assert options["--maxmemory-policy"] == "noeviction" and options["--maxmemory"] == "384mb"
    assert options["--requirepass"] == "$(REDIS_PASSWORD)"  # expanded by the kubelet from the env below
    env = env_of(statefulset)
    secret_name = f"{PREFIX}-response-store"
    for variable in ("REDIS_PASSWORD", "REDISCLI_AUTH"):
        assert env[variable]["valueFrom"] == {"secretKeyRef": {"name": secret_name, "key": "redis-password"}}
    for probe in ("livenessProbe", "readinessProbe"):
        assert "redis-cli" in " ".join(c[probe]["exec"]["command"]) and "ping" in " ".join(c[probe]["exec"]["command"])
    assert set(c["resources"]) == {"requests", "limits"} and c["resources"]["limits"]["memory"] == "1Gi"
    assert pod["securityContext"]["runAsNonRoot"] is True and pod["automountServiceAccountToken"] is False
    assert c["securityContext"]["readOnlyRootFilesystem"] is True
    assert c["securityContext"]["allowPrivilegeEscalation"] is False
    [claim] = spec["volumeClaimTemplates"]
    assert claim["metadata"]["name"] == "data" and claim["spec"]["accessModes"] == ["ReadWriteOnce"]
    assert claim["spec"]["resources"]["requests"]["storage"] == "2Gi"
    assert {"name": "data", "mountPath": "/data"} in c["volumeMounts"]
    assert not [v for v in pod["volumes"] if v["name"] == "data"]  # the claim, not an emptyDir
    service = resources[("Service", name)]["spec"]
    assert service["type"] == "ClusterIP"
    assert selected_workload(resources, resources[("Service", name)]) == ("StatefulSet", name)
    [port] = service["ports"]
    assert (port["port"], port["targetPort"]) == (6379, "redis")
    # The orchestrator's URL points at that Service, with the password the Secret holds.
    secret = decoded(resources[("Secret", secret_name)])
    assert set(secret) == {"url", "redis-password"} and re.fullmatch(r"[A-Za-z0-9]{32}", secret["redis-password"])
    settings = redis_client_settings(secret["url"])
    assert (settings["host"], settings["port"], settings["db"]) == (f"{name}{SERVICE_DOMAIN}", 6379, 0)
    assert settings["password"] == secret["redis-password"]
    orchestrator = resources[("Deployment", f"{PREFIX}-orchestrator")]
    assert env_of(orchestrator)["DISAGG_RESPONSE_STORE_URL"]["valueFrom"] == \
        {"secretKeyRef": {"name": secret_name, "key": "url"}}
    for workload in (orchestrator, statefulset):  # a changed store setting rolls both
        assert "checksum/response-store" in workload["spec"]["template"]["metadata"]["annotations"]
    text = notes(CHART_REDIS)
    assert f"the chart's Redis, {name}{SERVICE_DOMAIN}:6379" in text and "WARNING: 2 orchestrator" not in text


def test_a_given_redis_password_reaches_the_client_intact() -> None:
    password = "p@ss word+/:%x"
    resources = by_kind(render({"redis": {"enabled": True, "auth": {"password": password}}}))
    secret = decoded(resources[("Secret", f"{PREFIX}-response-store")])
    assert secret["redis-password"] == password
    assert redis_client_settings(secret["url"])["password"] == password
    assert "redis.auth.password is stored in this release's history" in notes({"redis": {"enabled": True,
                                                                                       "auth": {"password": password}}})


def test_redis_without_a_password_or_a_volume() -> None:
    values = {"redis": {"enabled": True, "auth": {"enabled": False}, "persistence": {"enabled": False}}}
    resources = by_kind(render(values))
    statefulset = resources[("StatefulSet", f"{PREFIX}-redis")]
    for manifest in resources.values():
        kubernetes_validate.validate(manifest, KUBERNETES_VERSION, strict=True)
    args = container(statefulset)["args"]
    assert "--requirepass" not in args and args[args.index("--protected-mode") + 1] == "no"
    assert not {"REDIS_PASSWORD", "REDISCLI_AUTH"} & set(env_of(statefulset))
    assert "volumeClaimTemplates" not in statefulset["spec"]
    assert {"name": "data", "emptyDir": {}} in statefulset["spec"]["template"]["spec"]["volumes"]
    secret = decoded(resources[("Secret", f"{PREFIX}-response-store")])
    assert secret == {"url": f"redis://{PREFIX}-redis{SERVICE_DOMAIN}:6379/0"}


@pytest.mark.parametrize(("values", "warned"), [
    ({"orchestrator": {"replicas": 2}}, True),
    ({"orchestrator": {"autoscaling": {"enabled": True}}}, True),
    ({"orchestrator": {"replicas": 2, "config": {"response_store": {"max_entries": 0}}}}, False),  # off by design
    ({"orchestrator": {"autoscaling": {"enabled": True, "maxReplicas": 1}}}, False),
    (None, False),
    (CHART_REDIS, False),
    ({"orchestrator": {"replicas": 3, "responseStore": {"existingSecret": "disagg-store"}}}, False),
], ids=["replicas", "autoscaling", "store_off", "autoscaling_to_one", "default", "chart_redis", "existing_secret"])
def test_notes_warn_of_several_orchestrators_without_a_shared_store(values: dict[str, Any] | None,
                                                                     warned: bool) -> None:
    """A warning, not a failed render: several orchestrators on the memory store serve everything but follow-ups
    that land on another pod, and a deployment may not use stored responses at all."""
    text = notes(values)
    assert ("no shared Responses store" in text) is warned, text


@pytest.mark.parametrize(("values", "message"), [
    ({"redis": {"enabled": True}, "orchestrator": {"responseStore": {"url": "redis://elsewhere:6379/0"}}},
     "set one of the two"),
    ({"redis": {"enabled": True}, "orchestrator": {"responseStore": {"existingSecret": "disagg-store"}}},
     "set one of the two"),
    ({"orchestrator": {"config": {"response_store": {"url": "redis://:pw@redis:6379/0"}}}}, "in a ConfigMap"),
    ({"orchestrator": {"config": {"response_store": {"backend": "redis"}}}}, "needs a URL"),
], ids=["chart_redis_and_url", "chart_redis_and_secret", "url_in_configmap", "redis_backend_without_url"])
def test_contradictory_store_settings_fail_the_render(values: dict[str, Any], message: str) -> None:
    with pytest.raises(helm.HelmRenderError, match=message):
        render(values)


# -- the rendered system, run ---------------------------------------------------------------------------------
def selected_workload(resources: dict[tuple[str, str], dict[str, Any]], service: dict[str, Any]) -> tuple[str, str]:
    """The (kind, name) of the Deployment or StatefulSet whose pods a Service selects (exactly one, in this chart)."""
    selector = service["spec"]["selector"].items()
    [workload] = [(kind, n) for (kind, n), m in resources.items() if kind in ("Deployment", "StatefulSet")
                  and selector <= m["spec"]["template"]["metadata"]["labels"].items()]
    return workload


def container_port(workload: dict[str, Any], port: int | str) -> int:
    """A container port, by number or by name."""
    if isinstance(port, int):
        return port
    [number] = [p["containerPort"] for p in container(workload)["ports"] if p["name"] == port]
    return int(number)


def service_target(resources: dict[tuple[str, str], dict[str, Any]], deployment: LocalDeployment,
                   service_name: str, port: int) -> str:
    """http://127.0.0.1:<local port> standing for <service>:<port>, as kube-proxy or cluster DNS would route it."""
    service = resources[("Service", service_name)]
    [entry] = [p for p in service["spec"]["ports"] if p["port"] == port]
    kind, name = selected_workload(resources, service)
    number = container_port(resources[(kind, name)], entry["targetPort"])
    return f"http://127.0.0.1:{deployment.port(name, number)}"


def kubelet_environment(workload: dict[str, Any], secrets: dict[str, dict[str, str]]) -> dict[str, str]:
    """A container's environment as the kubelet would give it (values, Secrets, the pod's IP on loopback)."""
    env: dict[str, str] = {}
    name = workload["metadata"]["name"]
    for item in container(workload)["env"]:
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
    return env


def local_environment(resources: dict[tuple[str, str], dict[str, Any]], name: str, deployment: LocalDeployment,
                      secrets: dict[str, dict[str, str]], pod: str | None = None) -> dict[str, str]:
    """A Deployment's container environment as the kubelet would give it to ``pod`` (default: its first pod, named
    as the Deployment), then mapped onto loopback."""
    env = kubelet_environment(resources[("Deployment", name)], secrets)
    return deployment.loopback_environment(pod or name, {**Image.read().disagg_environment, **env}, hosts=set())


def expand_kubelet_references(arg: str, env: dict[str, str]) -> str:
    """$(VAR) in a container's args, as the kubelet expands it from the container's environment."""
    return re.sub(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)", lambda m: env.get(m.group(1), m.group(0)), arg)


def start_chart_redis(resources: dict[tuple[str, str], dict[str, Any]], deployment: LocalDeployment,
                      secrets: dict[str, dict[str, str]]) -> None:
    """The chart's Redis StatefulSet's one pod: its arguments and environment as the kubelet gives them, run as a
    local redis-server; waited for by its own readiness probe (redis-cli ping), which must fail before it answers
    and with a wrong password."""
    [name] = [n for kind, n in resources if kind == "StatefulSet"]
    statefulset = resources[("StatefulSet", name)]
    c = container(statefulset)
    env = kubelet_environment(statefulset, secrets)
    number = container_port(statefulset, "redis")
    probe_env = {**env, "REDIS_PORT": str(deployment.port(name, number))}  # its port, mapped like DISAGG_PORT
    readiness = c["readinessProbe"]["exec"]["command"]
    assert not command_ok(readiness, probe_env), "the readiness probe passes with no Redis running"
    args = [expand_kubelet_references(a, env) for a in c["args"]]
    deployment.start_program(name, deployment.redis_arguments(name, args, number), {})
    deployment.wait_until(name, functools.partial(command_ok, readiness, probe_env), 30, "ready")
    assert command_ok(c["livenessProbe"]["exec"]["command"], probe_env), f"{name}: liveness fails when ready"
    if "REDISCLI_AUTH" in env:
        assert not command_ok(readiness, {**probe_env, "REDISCLI_AUTH": "not-the-password"}), \
            "the readiness probe passes with a wrong password"


def start_external_redis(url: str, deployment: LocalDeployment) -> None:
    """The operator's own Redis that an existing Secret's URL names, standing in as a local redis-server."""
    settings = redis_client_settings(url)
    service = f"external-redis-{settings['host']}"
    command = ["redis-server", "--save", "", "--port", str(settings["port"])]
    if settings.get("password"):
        command += ["--requirepass", settings["password"]]
    deployment.start_program(service, deployment.redis_arguments(service, command, settings["port"]), {})
    local = with_address(url, "127.0.0.1", deployment.port(service, settings["port"]))
    deployment.wait_until(service, functools.partial(redis_answers, local), 30, "answering")


def redis_answers(url: str) -> bool:
    try:
        with redis.Redis.from_url(url, socket_timeout=2) as client:
            return bool(client.ping())
    except (redis.RedisError, OSError):
        return False


def local_store_url(resources: dict[tuple[str, str], dict[str, Any]], deployment: LocalDeployment,
                    url: str) -> str:
    """The store URL the orchestrator got, mapped as cluster DNS and kube-proxy (the chart's Redis Service) or the
    network (the operator's Redis) would route it."""
    settings = redis_client_settings(url)
    host, port = settings["host"], settings["port"]
    if host.endswith(SERVICE_DOMAIN):
        local = urlsplit(service_target(resources, deployment, host.removesuffix(SERVICE_DOMAIN), port))
        assert local.port is not None
        return with_address(url, "127.0.0.1", local.port)
    return with_address(url, "127.0.0.1", deployment.port(f"external-redis-{host}", port))


def converse(urls: list[str], api_key: str | None, model: str) -> None:
    """A Responses API conversation whose every turn goes to the next orchestrator pod: each finds the turn before
    (previous_response_id) and reads back what another pod stored."""
    clients = [openai.OpenAI(base_url=url + "/v1", api_key=api_key or "unused", max_retries=0, timeout=60)
               for url in urls]
    try:
        turns = [clients[0].responses.create(model=model, input="Hello", max_output_tokens=2)]
        for n in range(1, 4):
            turns.append(clients[n % len(clients)].responses.create(
                model=model, input=f"And then {n}?", previous_response_id=turns[-1].id, max_output_tokens=2))
        inputs = [turn.usage.input_tokens for turn in turns if turn.usage is not None]
        assert len(inputs) == 4 and inputs == sorted(set(inputs)), inputs  # each turn carried the conversation
        for n, turn in enumerate(turns):
            assert clients[(n + 1) % len(clients)].responses.retrieve(turn.id).output_text == turn.output_text
    finally:
        for client in clients:
            client.close()


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
                 kind: str, pod: str | None = None) -> bool:
    """One of the container's probes (httpGet or tcpSocket), as the kubelet runs it, against the local port of
    ``pod`` (default: the Deployment's first pod)."""
    manifest = resources[("Deployment", name)]
    probe = container(manifest)[kind]
    pod = pod or name
    if "httpGet" in probe:
        port = deployment.port(pod, container_port(manifest, probe["httpGet"]["port"]))
        return http_ok(f"http://127.0.0.1:{port}{probe['httpGet']['path']}")
    port = deployment.port(pod, container_port(manifest, probe["tcpSocket"]["port"]))
    try:
        socket.create_connection(("127.0.0.1", port), timeout=2).close()
    except OSError:
        return False
    return True


def run_chart(values: dict[str, Any] | None, tmp_path: Path, engine: str | None) -> None:
    """Start every Deployment at once (as Kubernetes would), after the Redis its store names (the chart's
    StatefulSet, or the operator's own), wait for every readiness probe, then ask the orchestrator's Service.
    With a store URL the orchestrator runs as two pods, and a Responses conversation alternates between them.
    ``engine`` overrides DISAGG_ENGINE in the workers' environment, for speed."""
    resources = by_kind(render(values))
    secrets = {n: decoded(m) for (kind, n), m in resources.items() if kind == "Secret"} | EXISTING_SECRET
    api_key = secrets.get((values or {}).get("auth", {}).get("existingSecret") or PREFIX, {}).get("api-key")
    deployments = [n for kind, n in resources if kind == "Deployment"]
    orchestrator_name = f"{PREFIX}-orchestrator"
    store_url = kubelet_environment(resources[("Deployment", orchestrator_name)], secrets).get(
        "DISAGG_RESPONSE_STORE_URL")
    pods = {name: [name, f"{name}-2"] if name == orchestrator_name and store_url else [name] for name in deployments}
    with local_deployment(tmp_path) as deployment:
        if ("StatefulSet", f"{PREFIX}-redis") in resources:
            start_chart_redis(resources, deployment, secrets)
        elif store_url:
            start_external_redis(store_url, deployment)
        for name in deployments:
            for pod in pods[name]:
                env = local_environment(resources, name, deployment, secrets, pod)
                if engine and "DISAGG_ENGINE" in env:
                    env["DISAGG_ENGINE"] = engine
                if "DISAGG_CONFIG" in env:
                    mount_config(resources, name, env, deployment)
                if "DISAGG_RESPONSE_STORE_URL" in env:
                    env["DISAGG_RESPONSE_STORE_URL"] = local_store_url(resources, deployment,
                                                                       env["DISAGG_RESPONSE_STORE_URL"])
                deployment.start(pod, Image.read().entrypoint, container(resources[("Deployment", name)])["args"],
                                 env)
        for name in deployments:
            for pod in pods[name]:
                deployment.wait_until(pod, functools.partial(probe_passes, resources, name, deployment,
                                                             "readinessProbe", pod), 90, "ready")
        for name in deployments:
            for kind in ("startupProbe", "livenessProbe"):
                if kind in container(resources[("Deployment", name)]):
                    assert probe_passes(resources, name, deployment, kind), f"{name}: {kind} fails when ready"
        orchestrator = resources[("Service", orchestrator_name)]
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
        number = container_port(resources[("Deployment", orchestrator_name)], "http")
        converse([f"http://127.0.0.1:{deployment.port(pod, number)}" for pod in pods[orchestrator_name]], api_key,
                 model)
        if store_url:  # what the pods share is the Redis the chart pointed them at
            with redis.Redis.from_url(local_store_url(resources, deployment, store_url)) as client:
                assert any(client.scan_iter(match="*disagg:responses*")), "no stored response in the Redis"


def test_default_values_serve(tmp_path: Path) -> None:
    run_chart(None, tmp_path, engine="synthetic")


def test_non_default_values_serve(tmp_path: Path) -> None:
    """Metadata-only, an existing Secret's API key and store URL (the operator's Redis), other routers, a served
    model name, extra env."""
    run_chart(NON_DEFAULT, tmp_path, engine="synthetic")


def test_the_charts_redis_serves_a_conversation_across_orchestrator_pods(tmp_path: Path) -> None:
    run_chart(CHART_REDIS, tmp_path, engine="synthetic")


def test_the_grafana_dashboard_is_an_opt_in_configmap_for_grafanas_sidecar() -> None:
    assert not [m for m in render(None) if m["metadata"]["name"].endswith("grafana-dashboard")]
    resources = by_kind(render({"grafanaDashboard": {"enabled": True}}))
    configmap = resources[("ConfigMap", f"{PREFIX}-grafana-dashboard")]
    assert configmap["metadata"]["labels"]["grafana_dashboard"] == "1"
    shipped = json.loads((REPO / "deploy" / "grafana" / "disagg-serve.json").read_text())
    assert json.loads(configmap["data"]["disagg-serve.json"]) == shipped  # the chart links to the one file


# -- the deployment secret and who may reach the workers (issue 44) ---------------------------------------------
def token_refs(resources: dict[tuple[str, str], dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Each orchestrator and worker Deployment's DISAGG_INTERNAL_TOKEN source."""
    return {c: env_of(resources[("Deployment", f"{PREFIX}-{c}")])["DISAGG_INTERNAL_TOKEN"]["valueFrom"]
            for c in ("orchestrator", "ctx", "gen")}


def test_every_orchestrator_and_worker_pod_gets_one_generated_deployment_secret() -> None:
    resources = by_kind(render(None))
    token = decoded(resources[("Secret", f"{PREFIX}-internal")])["token"]
    assert len(token) == 64 and token.isalnum()
    assert InternalSecret(token).accepts(token)  # long enough for every process to start with it
    ref = {"secretKeyRef": {"name": f"{PREFIX}-internal", "key": "token"}}
    assert token_refs(resources) == {"orchestrator": ref, "ctx": ref, "gen": ref}
    again = decoded(by_kind(render(None))[("Secret", f"{PREFIX}-internal")])["token"]
    assert again != token  # made by the chart, not a constant shared by every install
    assert f"DISAGG_INTERNAL_TOKEN from Secret {PREFIX}-internal" in notes(None)
    assert "internalSecret.token is stored in this release's history" in notes({"internalSecret": {"token": "x" * 16}})


def test_a_given_or_existing_deployment_secret_is_used() -> None:
    given = "an-operator-chosen-token-0123456789"
    resources = by_kind(render({"internalSecret": {"token": given}}))
    assert decoded(resources[("Secret", f"{PREFIX}-internal")]) == {"token": given}
    existing = by_kind(render(NON_DEFAULT))
    assert ("Secret", f"{PREFIX}-internal") not in existing
    ref = {"secretKeyRef": {"name": "disagg-internal", "key": "shared-token"}}
    assert set(map(str, token_refs(existing).values())) == {str(ref)}
    with pytest.raises(Exception, match="at least 16 characters"):
        render({"internalSecret": {"token": "too-short"}})


def test_only_the_orchestrators_reach_the_workers_and_the_workers_each_other_for_kv() -> None:
    resources = by_kind(render(None))
    labels = {c: resources[("Deployment", f"{PREFIX}-{c}")]["spec"]["template"]["metadata"]["labels"]
              for c in ("orchestrator", "ctx", "gen")}

    def selects(selector: dict[str, Any]) -> set[str]:
        return {c for c, pod in labels.items() if selector["matchLabels"].items() <= pod.items()}

    for component in ("ctx", "gen"):
        spec = resources[("NetworkPolicy", f"{PREFIX}-{component}")]["spec"]
        assert selects(spec["podSelector"]) == {component} and spec["policyTypes"] == ["Ingress"]
        rules = spec["ingress"]
        for rule in rules:
            assert all(set(peer) == {"podSelector"} for peer in rule["from"])  # this release's pods, nothing else
        [any_port] = [rule for rule in rules if "ports" not in rule]
        assert set().union(*(selects(peer["podSelector"]) for peer in any_port["from"])) == {"orchestrator"}
        for rule in rules:
            if "ports" in rule:  # a worker reaches another's HTTP (generation-first) and KV transfer ports only
                assert {p["port"] for p in rule["ports"]} == {"http", "kv"}
                assert set().union(*(selects(peer["podSelector"]) for peer in rule["from"])) == {"ctx", "gen"}
    extra = NON_DEFAULT["networkPolicy"]["extraIngress"][0]
    assert extra in by_kind(render(NON_DEFAULT))[("NetworkPolicy", f"{PREFIX}-gen")]["spec"]["ingress"]
    off = by_kind(render({"networkPolicy": {"enabled": False}}))
    assert not [k for k in off if k[0] == "NetworkPolicy"]
    assert "WARNING: networkPolicy.enabled is false" in notes({"networkPolicy": {"enabled": False}})
    assert "NetworkPolicies let only this release's orchestrators reach the workers" in notes(None)


# -- alerts for KV that never moved and for streams that broke ------------------------------------------------
def test_the_alert_rules_are_an_opt_in_prometheus_rule_over_metrics_the_orchestrator_exports() -> None:
    from frontend.metrics import Metrics
    from orchestrator.metric_labels import MIGRATION_OUTCOMES, MIGRATION_RESUMED

    assert not [m for m in render(None) if m["kind"] == "PrometheusRule"]
    rule = by_kind(render({"prometheusRule": {"enabled": True, "labels": {"release": "kps"}}}))[
        ("PrometheusRule", f"{PREFIX}-alerts")]
    assert rule["apiVersion"] == "monitoring.coreos.com/v1" and rule["metadata"]["labels"]["release"] == "kps"
    alerts = {r["alert"]: r for group in rule["spec"]["groups"] for r in group["rules"]}
    assert set(alerts) == {"DisaggGenRecomputingPrompts", "DisaggKVPairProbeFailing",
                           "DisaggStreamsBrokenNotContinued"}
    exported = {metric.name for metric in Metrics().registry.collect()}  # counters without their _total
    for alert in alerts.values():
        names = set(re.findall(r"disagg_\w+", alert["expr"]))
        assert names and {re.sub(r"_total$", "", n) for n in names} <= exported, alert["expr"]
        assert alert["for"] == "10m" and alert["labels"] == {"severity": "warning"}
        # Prometheus's own template variables reach the rule unexpanded by Helm.
        assert "{{ $labels." in alert["annotations"]["summary"]
    # Streams that broke and were not continued: every outcome the orchestrator counts but ``resumed``.
    broken = alerts["DisaggStreamsBrokenNotContinued"]["expr"]
    named = re.search(r'disagg_stream_migrations_total\{outcome=~"([^"]+)"\}', broken)
    assert named and set(named.group(1).split("|")) == set(MIGRATION_OUTCOMES) - {MIGRATION_RESUMED}, broken
    assert "{{ $labels.outcome }}" in alerts["DisaggStreamsBrokenNotContinued"]["annotations"]["summary"]


def test_the_pair_probe_is_set_in_the_orchestrators_config() -> None:
    def pair_probe(values: dict[str, Any] | None) -> Any:
        configmap = by_kind(render(values))[("ConfigMap", f"{PREFIX}-orchestrator")]
        return parse_config(yaml.safe_load(configmap["data"]["orchestrator.yaml"])).pair_probe

    assert not pair_probe(None).enabled  # off by default: each probe costs the pairs' workers a prefill
    on = pair_probe({"orchestrator": {"config": {"pair_probe": {"enabled": True, "interval_s": 60}}}})
    assert on.enabled and on.interval_s == 60
