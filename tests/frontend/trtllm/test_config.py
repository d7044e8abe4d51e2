"""A trtllm-serve disaggregated config file loads as written; what it cannot mean here stops start-up by name."""

from __future__ import annotations

import pathlib

import pytest

from entrypoints.arguments import build_parser
from frontend.config import ConfigError, load_config

# As TensorRT-LLM's docs write one: host:port URLs, num_instances, engine keys at both levels.
TRTLLM = """\
hostname: localhost
port: 8000
backend: pytorch
free_gpu_memory_fraction: 0.25
max_retries: 2
gen_tokids_ctxbytes: true
gen_strip_message_history: true
conditional_disagg_config:
  max_local_prefill_length: 128
context_servers:
  num_instances: 2
  tensor_parallel_size: 1
  kv_cache_config: {free_gpu_memory_fraction: 0.2, enable_block_reuse: false}
  cache_transceiver_config: {backend: DEFAULT}
  urls: ["localhost:8001", "localhost:8002"]
  router: {type: kv_cache_aware, max_cache_size: 1024}
generation_servers:
  num_instances: 1
  urls: ["localhost:8003"]
  router: {type: load_balancing, use_tokens: true}
"""


def write(tmp_path: pathlib.Path, text: str) -> pathlib.Path:
    path = tmp_path / "disagg.yaml"
    path.write_text(text)
    return path


def test_a_trtllm_serve_config_loads_as_written(tmp_path: pathlib.Path) -> None:
    config = load_config(write(tmp_path, TRTLLM))
    assert config.context_servers.urls == ["http://localhost:8001", "http://localhost:8002"]
    assert config.generation_servers.urls == ["http://localhost:8003"]
    assert config.context_servers.router.type == "prefix_affinity"
    assert config.generation_servers.router.type == "least_loaded"
    assert config.generation_servers.router.load_metric == "prompt_tokens"
    assert config.max_local_prefill_length == 128
    assert config.gen_tokids_ctxbytes is True
    assert config.gen_strip_message_history is True
    assert config.max_retries == 2


def test_the_cli_takes_the_file_with_dash_c(tmp_path: pathlib.Path) -> None:
    path = write(tmp_path, TRTLLM)
    args = build_parser().parse_args(["orchestrator", "-c", str(path)])
    assert args.config == str(path)


@pytest.mark.parametrize("router, ours", [("round_robin", "round_robin"), ("load_balancing", "least_loaded"),
                                          ("kv_cache_aware", "prefix_affinity"), ("conversation", "prefix_affinity")])
def test_every_trtllm_router_type_maps_to_one_of_ours(tmp_path: pathlib.Path, router: str, ours: str) -> None:
    config = load_config(write(tmp_path, TRTLLM.replace("type: load_balancing, use_tokens: true", f"type: {router}")))
    assert config.generation_servers.router.type == ours


@pytest.mark.parametrize(
    "text, names",
    [
        pytest.param(TRTLLM.replace("num_instances: 2", "num_instances: 3"),
                     ["context_servers.num_instances", "3", "2"], id="num-instances-mismatch"),
        pytest.param(TRTLLM + "not_a_key_anywhere: 1\n", ["unknown key", "not_a_key_anywhere"], id="unknown-key"),
        pytest.param(TRTLLM.replace("max_cache_size: 1024", "no_such_router_key: 1"),
                     ["context_servers.router.no_such_router_key"], id="unknown-router-key"),
        pytest.param(TRTLLM.replace("type: kv_cache_aware", "type: random"), ["context_servers.router.type"],
                     id="unknown-router-type"),
        pytest.param(TRTLLM + "schedule_style: decode_first\n", ["schedule_style", "generation_first"],
                     id="unknown-schedule-style"),
        pytest.param(TRTLLM + "disagg_cluster_config: {cluster_uri: 'etcd://x'}\n", ["disagg_cluster_config"],
                     id="cluster-store"),
        pytest.param(TRTLLM.replace("max_local_prefill_length: 128", "max_local_prefill_length: 128\n  other: 1"),
                     ["conditional_disagg_config"], id="conditional-extra-key"),
    ],
)
def test_what_cannot_be_honoured_stops_start_up_by_name(tmp_path: pathlib.Path, text: str, names: list[str]) -> None:
    with pytest.raises(ConfigError) as caught:
        load_config(write(tmp_path, text))
    for name in names:
        assert name in str(caught.value)


@pytest.mark.parametrize("style", ["context_first", "generation_first"])
def test_schedule_style_is_read_into_the_trtllm_settings(tmp_path: pathlib.Path, style: str) -> None:
    config = load_config(write(tmp_path, TRTLLM + f"schedule_style: {style}\n"))
    assert config.trtllm.schedule_style == style


def test_our_own_file_sets_lifecycle_and_schedule(tmp_path: pathlib.Path) -> None:
    config = load_config(write(tmp_path, TRTLLM + "trtllm: {lifecycle_protocol: v0, grant_ttl_s: 30, "
                                                  "grant_renew_interval_s: 10}\nschedule_style: generation_first\n"))
    assert (config.trtllm.lifecycle_protocol, config.trtllm.grant_ttl_s, config.trtllm.schedule_style) == (
        "v0", 30, "generation_first")
    with pytest.raises(ConfigError, match="grant_renew_interval_s"):
        load_config(write(tmp_path, TRTLLM + "trtllm: {grant_ttl_s: 10, grant_renew_interval_s: 10}\n"))
