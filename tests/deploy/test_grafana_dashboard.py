"""deploy/grafana/disagg-serve.json: every metric it queries is exported by a running system (so no panel can
silently stay empty), and by a fresh one before its first request (so no panel shows "No data" where the truth is
zero), and the JSON keeps the structural rules of the Grafana schema version it declares."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from orchestrator.metric_labels import MIGRATION_OUTCOMES, MIGRATION_RESUMED
from tests.cluster import MODEL, Cluster, cluster_running
from tests.workers.engines.reference.cluster import reference_cluster
from tests.workers.engines.reference.tiny_model import write_tiny_model
from workers.engines.reference.options import ReferenceOptions

DASHBOARD_PATH = Path(__file__).resolve().parents[2] / "deploy" / "grafana" / "disagg-serve.json"
# Schema 39 is Grafana 10.4/11.0's; the rules below hold for every version from 36 (datasource references as
# objects, fieldConfig on every panel) to 41.
SUPPORTED_SCHEMA_VERSIONS = range(36, 42)
PANEL_TYPES = {"row", "timeseries", "stat", "gauge", "bargauge", "table", "heatmap", "text", "piechart"}
BUILT_IN_VARIABLES = {"__rate_interval", "__interval", "__range"}
GRID_COLUMNS = 24
METRIC = re.compile(r"\bdisagg_[a-z0-9_]+\b")
# Counted by HTTP status, whose values are not known before the first answer: the one family a fresh system
# cannot export at 0 (the traffic panels that read it show "No data" until the first request, which is the truth).
COUNTED_BY_OPEN_LABELS = {"disagg_requests_total"}
# Labelled by what the config names, and absent when it names none: a system without tenants has no tenant series
# (orchestrator/tenants.py exports each configured tenant's at 0 from start-up).
LABELLED_BY_CONFIG = {"disagg_tenant_refusals_total"}
# A CTX/GEN pair's verdict, exported once a pair probe has judged the pair (orchestrator/pair_probe.py): before it,
# there is no verdict to show, and the panel's query says 0 pairs kept out (``or vector(0)``).
PER_PROBED_PAIR = {"disagg_pair_probe_passing"}


@pytest.fixture(scope="module")
def dashboard() -> dict[str, Any]:
    loaded: dict[str, Any] = json.loads(DASHBOARD_PATH.read_text())
    return loaded


def panels(dashboard: dict[str, Any]) -> list[dict[str, Any]]:
    found = []
    for panel in dashboard["panels"]:
        found.append(panel)
        found += panel.get("panels", [])  # a collapsed row keeps its panels inside
    return found


def queries(dashboard: dict[str, Any]) -> list[str]:
    exprs = [t["expr"] for p in panels(dashboard) for t in p.get("targets", [])]
    for variable in dashboard["templating"]["list"]:
        if variable["type"] == "query":
            exprs.append(variable["query"]["query"] if isinstance(variable["query"], dict) else variable["query"])
    return exprs


# -- the metrics a running system exports ------------------------------------------------------------------
_SAMPLE_SUFFIXES = {"counter": ("_total", "_created"), "histogram": ("_bucket", "_count", "_sum", "_created"),
                    "gauge": ("",), "summary": ("", "_count", "_sum", "_created")}


@pytest.fixture(scope="module")
def exported() -> Iterator[set[str]]:
    """Every sample name the orchestrator, a CTX and a GEN worker export after serving one streamed request,
    families declared without samples yet (no failover so far) included."""
    with cluster_running() as cluster:
        yield _exported_by(cluster)


def _exported_by(cluster: Cluster) -> set[str]:
    with openai.OpenAI(base_url=cluster.orchestrator.url + "/v1", api_key="x", max_retries=0, timeout=60) as client:
        assert list(client.completions.create(model=MODEL, prompt="hello", max_tokens=4, stream=True))
    names: set[str] = set()
    for node in (cluster.orchestrator, cluster.ctx, cluster.gen):
        text = httpx.get(node.url + "/metrics", timeout=10).text
        for family in text_string_to_metric_families(text):
            names.update(family.name + suffix for suffix in _SAMPLE_SUFFIXES.get(family.type, ("",)))
            names.update(sample.name for sample in family.samples)
    return names


def test_every_metric_the_dashboard_queries_is_exported_by_a_running_system(dashboard: dict[str, Any],
                                                                            exported: set[str]) -> None:
    queried = {name for expr in queries(dashboard) for name in METRIC.findall(expr)}
    assert len(queried) >= 15
    assert sorted(queried - exported) == []


@pytest.fixture(scope="module")
def exported_at_start_up(tmp_path_factory: pytest.TempPathFactory) -> set[str]:
    """Every sample name (samples only, not bare families) a fresh system exports before its first request: an
    orchestrator, CTX, GEN and aggregated workers on the reference engine, which has a KV store (and a ledger)."""
    model = write_tiny_model(tmp_path_factory.mktemp("dashboard") / "tiny.gguf", seed=0)
    names: set[str] = set()
    with reference_cluster(ReferenceOptions(model_path=str(model), served_model_name="tiny", blas_threads=1)) as c:
        for node in (c.orchestrator, c.ctx, c.gen, c.aggregated):
            text = httpx.get(node.url + "/metrics", timeout=10).text
            names.update(sample.name for family in text_string_to_metric_families(text) for sample in family.samples)
    return names


def test_every_series_the_dashboard_queries_is_exported_from_start_up(dashboard: dict[str, Any],
                                                                     exported_at_start_up: set[str]) -> None:
    """So that no panel (nor the instance picker) shows "No data" on a fresh system where the truth is zero:
    labelled series whose label values are known are exported at 0 before their first event."""
    queried = {name for expr in queries(dashboard) for name in METRIC.findall(expr)}
    assert sorted(queried - COUNTED_BY_OPEN_LABELS - LABELLED_BY_CONFIG - PER_PROBED_PAIR - exported_at_start_up) == []
    assert not COUNTED_BY_OPEN_LABELS & exported_at_start_up  # still true: else it belongs in the check again


def test_every_query_names_a_metric_and_is_well_formed(dashboard: dict[str, Any]) -> None:
    for expr in queries(dashboard):
        assert METRIC.search(expr), expr
        for opening, closing in ("()", "{}", "[]"):
            assert expr.count(opening) == expr.count(closing), expr
        if "histogram_quantile" in expr:  # a quantile needs the buckets, summed by le
            assert "_bucket" in expr and re.search(r"by \((le\b|[^)]*\ble\b)", expr), expr


def test_the_stream_migration_panels_count_every_outcome_and_single_out_the_streams_not_continued(
        dashboard: dict[str, Any]) -> None:
    """One panel by outcome, whatever the outcomes; one of the streams that ended in an error for the client: every
    outcome the orchestrator counts but ``resumed`` (the outcomes the alert of the Helm chart fires on)."""
    exprs = [t["expr"] for p in panels(dashboard) for t in p.get("targets", [])
             if "disagg_stream_migrations_total" in t["expr"]]
    assert len(exprs) == 2, exprs
    by_outcome, not_continued = sorted(exprs, key=lambda expr: "outcome=~" in expr)
    assert by_outcome.startswith("sum by (outcome) ") and "outcome=" not in by_outcome
    named = re.search(r'outcome=~"([^"]+)"', not_continued)
    assert named and set(named.group(1).split("|")) == set(MIGRATION_OUTCOMES) - {MIGRATION_RESUMED}
    assert "worker" in not_continued.split("(")[1]  # by GEN worker: which one breaks


def test_the_exported_set_is_not_vacuous(exported: set[str]) -> None:
    # The other test is only as good as this set: a typo'd name must fail it.
    assert "disagg_requests_total" in exported and "disagg_time_to_first_token_seconds_bucket" in exported
    assert "disagg_request_total" not in exported


# -- the JSON, against the rules of its schema version -----------------------------------------------------
def test_declares_a_supported_schema_version_and_the_top_level_fields(dashboard: dict[str, Any]) -> None:
    assert dashboard["schemaVersion"] in SUPPORTED_SCHEMA_VERSIONS
    assert isinstance(dashboard["title"], str) and dashboard["title"]
    assert re.fullmatch(r"[A-Za-z0-9_-]{1,40}", dashboard["uid"])
    assert dashboard["id"] is None  # an exported dashboard carries no database id: importing must not clash
    assert isinstance(dashboard["version"], int)
    assert set(dashboard["time"]) == {"from", "to"}
    assert isinstance(dashboard["templating"]["list"], list)
    assert isinstance(dashboard["annotations"]["list"], list)


def test_panel_ids_are_unique_and_positive(dashboard: dict[str, Any]) -> None:
    ids = [p["id"] for p in panels(dashboard)]
    assert all(isinstance(i, int) and i > 0 for i in ids)
    assert len(ids) == len(set(ids))


def test_every_panel_has_a_grid_position_on_24_columns_and_none_overlap(dashboard: dict[str, Any]) -> None:
    taken: set[tuple[int, int]] = set()
    for panel in dashboard["panels"]:
        assert panel["type"] in PANEL_TYPES, panel["type"]
        grid = panel["gridPos"]
        assert all(isinstance(grid[k], int) for k in ("h", "w", "x", "y")), grid
        assert grid["h"] > 0 and 0 < grid["w"] <= GRID_COLUMNS and grid["x"] >= 0 and grid["y"] >= 0
        assert grid["x"] + grid["w"] <= GRID_COLUMNS, panel["title"]
        cells = {(x, y) for x in range(grid["x"], grid["x"] + grid["w"])
                 for y in range(grid["y"], grid["y"] + grid["h"])}
        assert not cells & taken, f"{panel['title']} overlaps another panel"
        taken |= cells
        if panel["type"] == "row":
            assert grid["h"] == 1 and grid["w"] == GRID_COLUMNS and isinstance(panel["collapsed"], bool)


def test_every_data_panel_has_a_prometheus_datasource_targets_and_field_config(dashboard: dict[str, Any]) -> None:
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    for panel in panels(dashboard):
        if panel["type"] == "row":
            continue
        assert panel["title"] and panel.get("description"), panel["id"]
        source = panel["datasource"]
        assert source["type"] == "prometheus"
        name = re.fullmatch(r"\$\{(\w+)\}", source["uid"])
        assert name and variables[name.group(1)]["type"] == "datasource", source
        assert "defaults" in panel["fieldConfig"] and isinstance(panel["fieldConfig"]["overrides"], list)
        targets = panel["targets"]
        assert targets, panel["title"]
        ref_ids = [t["refId"] for t in targets]
        assert len(ref_ids) == len(set(ref_ids)), panel["title"]
        for target in targets:
            assert target["datasource"] == source and target["expr"].strip()


def test_every_variable_a_query_uses_is_declared(dashboard: dict[str, Any]) -> None:
    declared = {v["name"] for v in dashboard["templating"]["list"]} | BUILT_IN_VARIABLES
    for expr in queries(dashboard):
        used = set(re.findall(r"\$\{?(\w+)\}?", expr))
        assert used <= declared, (expr, used - declared)
