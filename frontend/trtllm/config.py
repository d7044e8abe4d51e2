"""A ``trtllm-serve disaggregated -c disagg.yaml`` file, read as this project's orchestrator configuration.

TensorRT-LLM's file and ours share most names (``hostname``, ``port``, ``context_servers.urls``, ``max_retries``,
``gen_tokids_ctxbytes``); this module rewrites the few that differ into ours, before our strict model validates the
result, so that a key neither project knows still stops start-up with its name. It is a no-op on our own files.

What differs: URLs are written ``host:port`` (http assumed); ``num_instances`` counts the URLs; router type names;
``conditional_disagg_config.max_local_prefill_length``; and keys that configure the TensorRT-LLM engine or its
orchestrator's internals, which mean nothing here and are dropped (they are listed in docs/interop.md).
"""

from __future__ import annotations

from typing import Any

# TensorRT-LLM router types -> ours (docs/interop.md says what each mapping keeps and loses).
ROUTER_TYPES = {
    "round_robin": "round_robin",
    "load_balancing": "least_loaded",
    "kv_cache_aware": "prefix_affinity",  # routes by the prompt's prefix, as a KV-cache-aware router mostly does
    "conversation": "prefix_affinity",  # one conversation's turns share their prefix, so they stay together
}

# Engine arguments and TensorRT-LLM-orchestrator internals: they configure the workers' engines or TensorRT-LLM's
# own server process, not the request flow, so this orchestrator has nothing to do with them.
IGNORED_TOP_LEVEL = frozenset({
    "backend", "model", "tokenizer", "free_gpu_memory_fraction", "tensor_parallel_size", "pipeline_parallel_size",
    "moe_expert_parallel_size", "moe_tensor_parallel_size", "enable_attention_dp", "max_batch_size",
    "max_num_tokens", "max_seq_len", "kv_cache_config", "cache_transceiver_config", "cuda_graph_config",
    "disable_overlap_scheduler", "enable_chunked_prefill", "print_iter_log", "trust_remote_code",
    "node_id", "perf_metrics_max_requests", "num_workers", "speculative_config", "scheduler_config",
})
IGNORED_IN_SERVER_GROUP = IGNORED_TOP_LEVEL | {"num_instances"}  # num_instances is checked, then dropped
IGNORED_IN_ROUTER = frozenset({"max_cache_size", "tokens_per_block", "server_role"})

# TensorRT-LLM settings this orchestrator cannot honour: refused by name rather than silently dropped.
REFUSED = {
    "disagg_cluster_config": "worker discovery through TensorRT-LLM's cluster store is not supported; list the "
                             "workers under 'urls', or use our 'discovery' (DNS) or 'registration'",
    "disagg_coordinator_url": "a TensorRT-LLM coordinator fleet is not supported; run several disagg-serve "
                              "front ends instead (docs/deployment-at-scale.md)",
    "metadata_server_config": "TensorRT-LLM's etcd metadata server is not supported; list the workers under 'urls'",
}


def from_trtllm(raw: dict[str, Any]) -> dict[str, Any]:
    """``raw`` with TensorRT-LLM's spellings rewritten into ours; raises ``ValueError`` naming a key it refuses."""
    out = {k: v for k, v in raw.items() if k not in IGNORED_TOP_LEVEL}
    for key, why in REFUSED.items():
        if out.get(key) is not None:
            raise ValueError(f"'{key}': {why}")
        out.pop(key, None)
    style = out.pop("schedule_style", None)
    if style is not None:  # ours lives with the other trtllm-serve settings (frontend/config.py: TrtllmConfig)
        if style not in ("context_first", "generation_first"):
            raise ValueError(f"'schedule_style' is 'context_first' or 'generation_first', not {style!r}")
        trtllm = out.get("trtllm")
        out["trtllm"] = {**(trtllm if isinstance(trtllm, dict) else {}), "schedule_style": style}
    if out.pop("allow_request_chat_template", False):
        raise ValueError("'allow_request_chat_template': per-request chat templates are not supported")
    conditional = out.pop("conditional_disagg_config", None)
    if conditional is not None:
        if not isinstance(conditional, dict) or set(conditional) - {"max_local_prefill_length"}:
            raise ValueError("'conditional_disagg_config' takes only 'max_local_prefill_length'")
        out.setdefault("max_local_prefill_length", conditional.get("max_local_prefill_length", 0))
    for group in ("context_servers", "generation_servers"):
        if isinstance(out.get(group), dict):
            out[group] = _server_group(group, out[group])
    return out


def _server_group(name: str, group: dict[str, Any]) -> dict[str, Any]:
    out = {k: v for k, v in group.items() if k not in IGNORED_IN_SERVER_GROUP}
    urls = group.get("urls")
    if isinstance(urls, list):
        out["urls"] = [_with_scheme(u) for u in urls]
        count = group.get("num_instances")
        if count is not None and count != len(urls):
            raise ValueError(f"'{name}.num_instances' is {count} but '{name}.urls' lists {len(urls)} workers")
    elif group.get("num_instances") and "discovery" not in group and not group.get("registration"):
        raise ValueError(f"'{name}.num_instances' without 'urls': list the workers under '{name}.urls' "
                         "(TensorRT-LLM's metadata-server discovery is not supported)")
    router = group.get("router")
    if isinstance(router, dict):
        out["router"] = _router(name, router)
    return out


def _router(group: str, router: dict[str, Any]) -> dict[str, Any]:
    out = {k: v for k, v in router.items() if k not in IGNORED_IN_ROUTER}
    kind = out.get("type")
    if kind in ROUTER_TYPES:
        out["type"] = ROUTER_TYPES[kind]
    if "use_tokens" in out:  # load_balancing: count prompt tokens rather than requests
        out["load_metric"] = "prompt_tokens" if out.pop("use_tokens") else "requests"
    return out


def _with_scheme(url: Any) -> Any:
    return f"http://{url}" if isinstance(url, str) and "://" not in url else url
