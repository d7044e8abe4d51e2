"""The vllm engine's KV hand-off state: what CTX's answer carries in ``encoded_opaque_state`` for GEN.

The KV travels through vLLM's KV connector; this state says which KV and from what: CTX's ``kv_transfer_params``
for GEN's ``do_remote_prefill``, the model hash and prompt length (so GEN refuses a hand-off that is not its own
before vLLM reads the wrong KV), and the seed CTX sampled with, which GEN must draw with again."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import orjson

from frontend.errors import HandoffError

_PARAM = "disaggregated_params.encoded_opaque_state"


@dataclass(frozen=True, slots=True)
class VllmHandoff:
    model_hash: str
    prompt_len: int
    kv_transfer_params: dict[str, Any] | None
    seed: int | None = None

    def encode(self) -> bytes:
        return orjson.dumps({"engine": "vllm", "model_hash": self.model_hash, "prompt_len": self.prompt_len,
                             "kv_transfer_params": self.kv_transfer_params, "seed": self.seed})

    def for_decode(self) -> dict[str, Any]:
        """GEN's ``kv_transfer_params``: CTX's answer, told to fetch (``do_remote_prefill``) and not to send on.
        Without CTX's ``remote_prefill_cached_tokens``: vLLM would report that as GEN's cached tokens, and GEN's own
        count (what it found cached or loaded through the connector) is what tells a KV that never moved."""
        params = {k: v for k, v in (self.kv_transfer_params or {}).items() if k != "remote_prefill_cached_tokens"}
        return {**params, "do_remote_prefill": True, "do_remote_decode": False}


def parse_handoff(opaque_state: bytes, model_hash: str, prompt_len: int) -> VllmHandoff:
    try:
        state = orjson.loads(opaque_state)
        engine, theirs, length = state["engine"], state["model_hash"], state["prompt_len"]
        params, seed = state.get("kv_transfer_params"), state.get("seed")
    except (orjson.JSONDecodeError, KeyError, TypeError) as exc:
        raise HandoffError("encoded_opaque_state is not a vllm-engine hand-off", param=_PARAM) from exc
    if engine != "vllm":
        raise HandoffError(f"hand-off from engine {engine!r}, this is 'vllm'", param=_PARAM)
    if theirs != model_hash:
        raise HandoffError("hand-off from a different model (model hash differs)", param=_PARAM)
    if length != prompt_len:
        raise HandoffError(f"hand-off is for a {length}-token prompt, the request has {prompt_len}",
                           param="disaggregated_params.prompt_len")
    if params is not None and not isinstance(params, dict):
        raise HandoffError("kv_transfer_params in the hand-off must be an object", param=_PARAM)
    if seed is not None and (not isinstance(seed, int) or isinstance(seed, bool)):
        raise HandoffError("seed in the hand-off must be an integer", param=_PARAM)
    return VllmHandoff(theirs, length, params, seed)
