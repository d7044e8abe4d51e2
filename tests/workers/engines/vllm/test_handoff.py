"""The vllm engine's hand-off state: what CTX writes, what GEN accepts, and every refusal naming its field."""

from __future__ import annotations

import orjson
import pytest

from frontend.errors import HandoffError
from workers.engines.vllm.handoff import VllmHandoff, parse_handoff

NIXL = {"remote_engine_id": "e1", "remote_block_ids": [1, 2], "remote_host": "h", "remote_port": 1,
        "do_remote_prefill": True, "do_remote_decode": False}


def test_the_state_round_trips_and_gen_fetches_without_sending_on() -> None:
    state = VllmHandoff("hash", 300, NIXL).encode()
    handoff = parse_handoff(state, "hash", 300)
    assert handoff.kv_transfer_params == NIXL
    assert handoff.for_decode() == {**NIXL, "do_remote_prefill": True, "do_remote_decode": False}
    assert VllmHandoff("hash", 300, None).for_decode() == {"do_remote_prefill": True, "do_remote_decode": False}
    assert handoff.seed is None


def test_gen_counts_its_own_cached_tokens_not_ctxs() -> None:
    # vLLM would report P's remote_prefill_cached_tokens as D's own: GEN's count must be its own, to see a KV that
    # never moved (workers/engines/vllm/engine.py: recomputed_tokens).
    handoff = VllmHandoff("hash", 300, {**NIXL, "remote_prefill_cached_tokens": 256})
    assert handoff.for_decode() == {**NIXL, "do_remote_prefill": True, "do_remote_decode": False}


def test_the_seed_ctx_sampled_with_reaches_gen() -> None:
    assert parse_handoff(VllmHandoff("hash", 300, None, -12).encode(), "hash", 300).seed == -12


@pytest.mark.parametrize(
    ("state", "message"),
    [
        (b"not json", "not a vllm-engine hand-off"),
        (orjson.dumps({"engine": "vllm"}), "not a vllm-engine hand-off"),
        (orjson.dumps({"engine": "reference", "model_hash": "hash", "prompt_len": 300}), "engine 'reference'"),
        (orjson.dumps({"engine": "vllm", "model_hash": "other", "prompt_len": 300}), "different model"),
        (orjson.dumps({"engine": "vllm", "model_hash": "hash", "prompt_len": 299}), "299-token prompt"),
        (orjson.dumps({"engine": "vllm", "model_hash": "hash", "prompt_len": 300, "kv_transfer_params": [1]}),
         "must be an object"),
        (orjson.dumps({"engine": "vllm", "model_hash": "hash", "prompt_len": 300, "seed": "7"}),
         "seed in the hand-off must be an integer"),
    ],
)
def test_a_hand_off_gen_cannot_use_is_refused(state: bytes, message: str) -> None:
    with pytest.raises(HandoffError, match=message) as caught:
        parse_handoff(state, "hash", 300)
    assert caught.value.param is not None and caught.value.param.startswith("disaggregated_params")
