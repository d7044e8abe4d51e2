"""n > 1 in the scheduler: one prefill forked into n sequences, each seeded seed + index, each decoding on its own
copy of the prompt's KV; CTX parks one hand-off for all n; one sequence can be stopped while its siblings go on."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from frontend.sampling import SamplingParams
from frontend.token_codec import TOKEN_DTYPE
from tests.workers.engines.reference.conftest import Engine
from workers.engines.reference.kv_store import KVStore
from workers.engines.reference.scheduler import Scheduler, SchedulerConfig
from workers.engines.reference.sequences import SubmitSpec
from workers.engines.reference.transformer import fork_kv

PROMPT = np.arange(3, 40, dtype=TOKEN_DTYPE)
Frames = list[dict[str, Any]]


def _scheduler(tiny: Engine, emitted: Frames, store: KVStore | None = None) -> Scheduler:
    config = SchedulerConfig(model_hash="h", eos_token_ids=frozenset(), prefill_chunk=4096)
    return Scheduler(tiny.transformer, config, store or KVStore(1 << 30, 60.0),
                     lambda header, payload=b"": emitted.append(header))


def _spec(request_id: str, *, n: int, seed: int = 7, max_tokens: int = 5, phase: str = "aggregated") -> SubmitSpec:
    sampling = SamplingParams(max_tokens=max_tokens, temperature=1.0, seed=seed, n=n)
    return SubmitSpec(request_id=request_id, phase=phase, prompt=PROMPT, placeholder=False, max_tokens=max_tokens,
                      sampling=sampling)


def _run(scheduler: Scheduler) -> None:
    while scheduler.busy:
        scheduler.step()


def _tokens_by_index(frames: Frames) -> dict[int, list[int]]:
    tokens: dict[int, list[int]] = {}
    for frame in frames:
        tokens.setdefault(frame["index"], []).extend(frame["tokens"])
    return tokens


def test_one_prefill_forks_into_n_sequences_each_a_lone_request_seeded_seed_plus_index(
    tiny: Engine, monkeypatch: pytest.MonkeyPatch
) -> None:
    prefills: list[int] = []
    prefill = tiny.transformer.prefill

    def counted_prefill(chunk: Any, *args: Any) -> Any:
        prefills.append(len(chunk))
        return prefill(chunk, *args)

    monkeypatch.setattr(tiny.transformer, "prefill", counted_prefill)
    emitted: Frames = []
    scheduler = _scheduler(tiny, emitted)
    try:
        scheduler.submit(_spec("together", n=3))
        _run(scheduler)
        assert prefills == [PROMPT.size]  # the prompt, once, for three sequences
        together = _tokens_by_index(emitted)
        assert sorted(together) == [0, 1, 2] and all(len(t) == 5 for t in together.values())
        assert [f["finish"] for f in emitted if f["finish"]] == ["length"] * 3
        assert [bool(f.get("done")) for f in emitted].count(True) == 1 and emitted[-1]["done"]
        for index in range(3):
            emitted.clear()
            scheduler.submit(_spec(f"alone-{index}", n=1, seed=7 + index))
            _run(scheduler)
            assert _tokens_by_index(emitted)[0] == together[index]
        assert len(set(map(tuple, together.values()))) > 1
    finally:
        scheduler.close()


def test_ctx_parks_one_handoff_with_every_first_token(tiny: Engine) -> None:
    emitted: Frames = []
    store = KVStore(1 << 30, 60.0)
    scheduler = _scheduler(tiny, emitted, store)
    try:
        scheduler.submit(_spec("ctx", n=3, phase="context_only"))
        _run(scheduler)
        assert [f["index"] for f in emitted] == [0, 1, 2]
        assert all(len(f["tokens"]) == 1 for f in emitted)
        assert [bool(f.get("handoff_state")) for f in emitted] == [False, False, True]
        assert emitted[-1]["done"]
        assert store.stats[0] == 1  # one hand-off: the prompt's KV, shared by the three sequences
        assert scheduler.stats()["active"] == 0
    finally:
        scheduler.close()


def test_a_stopped_sequence_stops_decoding_and_its_siblings_go_on(tiny: Engine) -> None:
    emitted: Frames = []
    scheduler = _scheduler(tiny, emitted)
    try:
        scheduler.submit(_spec("r", n=2, max_tokens=12))
        scheduler.step()  # the prefill, both first tokens, and one decode step of each
        assert scheduler.stats()["sequences"] == 2
        scheduler.stop_sequence("r", 0)  # the front end met a stop string in sequence 0
        assert scheduler.stats()["sequences"] == 1
        before = len(emitted)
        _run(scheduler)
        assert {f["index"] for f in emitted[before:]} == {1}
        assert emitted[-1]["done"] and emitted[-1]["finish"] == "length"
        assert len(_tokens_by_index(emitted)[1]) == 12
        assert scheduler.stats()["active"] == 0
    finally:
        scheduler.close()


def test_an_abort_drops_every_sequence(tiny: Engine) -> None:
    emitted: Frames = []
    scheduler = _scheduler(tiny, emitted)
    try:
        scheduler.submit(_spec("r", n=3, max_tokens=50))
        scheduler.step()
        assert scheduler.stats()["sequences"] == 3 and scheduler.stats()["active"] == 1
        scheduler.abort("r")
        assert scheduler.stats()["sequences"] == 0 and scheduler.stats()["active"] == 0
        assert not scheduler.busy
    finally:
        scheduler.close()


def test_a_forked_cache_decodes_bitwise_like_the_original_and_apart_from_it(tiny: Engine) -> None:
    model = tiny.transformer
    original = model.new_cache(PROMPT.size + 8)
    model.prefill(PROMPT, original)
    forked = fork_kv(original)
    assert np.array_equal(model.decode(11, forked), model.decode(11, original))
    model.decode(12, forked)  # the fork moves on; the original does not see it
    assert (forked.length, original.length) == (PROMPT.size + 2, PROMPT.size + 1)
