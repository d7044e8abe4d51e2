"""An abort cuts a prefill chunk short: the scheduler asks between layers, not only between chunks."""

from __future__ import annotations

import numpy as np

from frontend.sampling import SamplingParams
from frontend.token_codec import TOKEN_DTYPE
from tests.workers.engines.reference.conftest import Engine
from workers.engines.reference.kv_store import KVStore
from workers.engines.reference.scheduler import Scheduler, SchedulerConfig, SubmitSpec


def _spec(request_id: str, tokens: int) -> SubmitSpec:
    return SubmitSpec(request_id=request_id, phase="aggregated", prompt=np.full(tokens, 5, dtype=TOKEN_DTYPE),
                      placeholder=False, max_tokens=4, sampling=SamplingParams(max_tokens=4, temperature=0.0))


def test_a_pending_abort_stops_the_chunk_between_layers_and_drops_the_sequence(tiny: Engine) -> None:
    emitted: list[dict[str, object]] = []
    layers_asked: list[str] = []
    pending: set[str] = set()

    def abort_pending(request_id: str) -> bool:
        layers_asked.append(request_id)
        return request_id in pending

    config = SchedulerConfig(model_hash="h", eos_token_ids=frozenset(), prefill_chunk=4096)
    scheduler = Scheduler(tiny.transformer, config, KVStore(1 << 30, 60.0),
                          lambda header, payload=b"": emitted.append(header), abort_pending=abort_pending)
    try:
        scheduler.submit(_spec("gone", 64))
        scheduler.submit(_spec("stays", 8))
        pending.add("gone")  # its abort frame has reached the core but the loop has not handled it yet
        scheduler.step()
        assert layers_asked == ["gone"]  # asked before the first layer, and stopped there
        assert emitted == []  # nothing answered for it
        assert scheduler.active_requests == 1  # dropped; "stays" is next
        scheduler.step()
        assert {h["id"] for h in emitted} == {"stays"}  # its first token (and, same step, a decoded one)
        # A finished prefill pass asked before every layer; decode steps are one token and never ask.
        assert layers_asked == ["gone"] + ["stays"] * tiny.transformer.config.n_layers
    finally:
        scheduler.close()
