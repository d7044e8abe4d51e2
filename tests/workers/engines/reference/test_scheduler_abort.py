"""Aborts under a storm: a prefill stops within the layer it is in, a queued request the abort names is never
started, and a submit whose abort has already reached the core is never queued (nor takes KV memory)."""

from __future__ import annotations

import argparse
import socket
from collections.abc import Iterator

import numpy as np
import pytest

from frontend.sampling import SamplingParams
from frontend.token_codec import TOKEN_DTYPE
from tests.workers.engines.reference.conftest import Engine
from workers.engines.reference.core import Channel, Core
from workers.engines.reference.frames import submit_frame
from workers.engines.reference.kv_store import KVStore
from workers.engines.reference.scheduler import Scheduler, SchedulerConfig
from workers.engines.reference.sequences import SubmitSpec
from workers.engines.reference.transformer import STOP_CHECKS_PER_LAYER, Interrupted
from workers.engines.request import GenerationRequest

Emitted = list[dict[str, object]]


def _spec(request_id: str, tokens: int) -> SubmitSpec:
    return SubmitSpec(request_id=request_id, phase="aggregated", prompt=np.full(tokens, 5, dtype=TOKEN_DTYPE),
                      placeholder=False, max_tokens=4, sampling=SamplingParams(max_tokens=4, temperature=0.0))


class _Aborts:
    """The core's pending aborts as the scheduler sees them, with every ask recorded (one per check)."""

    def __init__(self, arrives: dict[str, int] | None = None) -> None:
        self.pending: set[str] = set()
        self.asked: list[str] = []
        self.arrives = arrives or {}  # request id -> the ask at which its abort arrives

    def __call__(self, request_id: str) -> bool:
        self.asked.append(request_id)
        if self.arrives.get(request_id) == len(self.asked):
            self.pending.add(request_id)
        return request_id in self.pending


def _scheduler(tiny: Engine, aborts: _Aborts, emitted: Emitted, prefill_chunk: int = 4096) -> Scheduler:
    config = SchedulerConfig(model_hash="h", eos_token_ids=frozenset(), prefill_chunk=prefill_chunk)
    return Scheduler(tiny.transformer, config, KVStore(1 << 30, 60.0),
                     lambda header, payload=b"": emitted.append(header), abort_pending=aborts)


def _run_until_idle(scheduler: Scheduler, limit: int = 100) -> None:
    for _ in range(limit):
        if not scheduler.busy:
            return
        scheduler.step()
    raise AssertionError("the scheduler never went idle")


@pytest.fixture
def emitted() -> Emitted:
    return []


def test_a_queued_request_whose_abort_is_pending_is_never_started(tiny: Engine, emitted: Emitted) -> None:
    aborts = _Aborts()
    scheduler = _scheduler(tiny, aborts, emitted)
    checks_per_pass = STOP_CHECKS_PER_LAYER * tiny.transformer.config.n_layers
    try:
        scheduler.submit(_spec("gone", 64))
        scheduler.submit(_spec("stays", 8))
        aborts.pending.add("gone")  # its abort frame has reached the core but the loop has not handled it yet
        scheduler.step()
        # "gone" was asked about once, at the head of the queue, and dropped there: never prefilled at all. The same
        # step went on to "stays", whose finished pass asked at every check of every layer (decode never asks).
        assert aborts.asked == ["gone"] + ["stays"] * (1 + checks_per_pass)
        assert {h["id"] for h in emitted} == {"stays"}  # nothing answered for "gone"
        assert scheduler.active_requests == 1  # "stays", decoding
    finally:
        scheduler.close()


def test_an_abort_arriving_mid_chunk_stops_it_at_the_next_check_and_no_chunk_follows(
        tiny: Engine, emitted: Emitted, monkeypatch: pytest.MonkeyPatch) -> None:
    checks_per_pass = STOP_CHECKS_PER_LAYER * tiny.transformer.config.n_layers
    per_step = 1 + checks_per_pass  # the head of the queue, then every check of its chunk
    aborts = _Aborts(arrives={"gone": 2 * per_step + 1 + 5})  # at the 5th check of the third chunk
    scheduler = _scheduler(tiny, aborts, emitted, prefill_chunk=8)
    chunks: list[int] = []
    prefill = tiny.transformer.prefill

    def counting_prefill(token_ids: np.ndarray, cache: object, stop: object = None) -> np.ndarray:
        chunks.append(len(token_ids))
        return prefill(token_ids, cache, stop)  # type: ignore[arg-type]

    monkeypatch.setattr(tiny.transformer, "prefill", counting_prefill)
    try:
        scheduler.submit(_spec("gone", 32))  # four chunks of 8
        _run_until_idle(scheduler)
        assert chunks == [8, 8, 8]  # two whole chunks, the third begun; the fourth never
        assert len(aborts.asked) == 2 * per_step + 1 + 5  # nothing asked after the check that saw the abort
        assert scheduler.active_requests == 0 and emitted == []
    finally:
        scheduler.close()


def test_a_pass_stops_inside_a_layer_and_a_finished_pass_is_unchanged(tiny: Engine) -> None:
    tr = tiny.transformer
    ids = np.arange(1, 40, dtype=np.int32)
    expected = tr.prefill(ids, tr.new_cache())
    asks = 0

    def never() -> bool:
        nonlocal asks
        asks += 1
        return False

    assert np.array_equal(tr.prefill(ids, tr.new_cache(), never), expected)  # asking changes no bit
    assert asks == STOP_CHECKS_PER_LAYER * tr.config.n_layers
    for stop_at in range(1, STOP_CHECKS_PER_LAYER + 1):  # each check inside layer 0 ends the pass there
        asks = 0

        def at(n: int = stop_at) -> bool:
            nonlocal asks
            asks += 1
            return asks == n

        with pytest.raises(Interrupted):
            tr.prefill(ids, tr.new_cache(), at)
        assert asks == stop_at


def test_a_queued_request_aborted_before_it_starts_is_never_prefilled_and_holds_no_kv(tiny: Engine,
                                                                                     emitted: Emitted) -> None:
    aborts = _Aborts()
    scheduler = _scheduler(tiny, aborts, emitted, prefill_chunk=8)
    try:
        scheduler.submit(_spec("running", 24))
        scheduler.submit(_spec("queued", 24))
        queued = scheduler._prefill_queue[1]
        assert not queued.cache.allocated  # waiting in the queue takes no KV memory
        scheduler.step()  # the first chunk of "running"
        assert scheduler._prefill_queue[0].cache.allocated
        aborts.pending.add("queued")  # while "running" prefills: its abort frame is in the inbox
        _run_until_idle(scheduler)
        assert aborts.asked.count("queued") == 1  # asked once, at the head of the queue, and dropped unstarted
        assert queued.prefilled == 0 and not queued.cache.allocated
        assert {h["id"] for h in emitted} == {"running"}
        scheduler.abort("queued")  # the abort frame, handled later, finds nothing
        assert scheduler.active_requests == 0
    finally:
        scheduler.close()


@pytest.fixture
def core_and_channel() -> Iterator[tuple[Core, Channel]]:
    ours, theirs = socket.socketpair()
    core = Core(argparse.Namespace(), ours)
    channel = Channel(1, ours)
    core.channels[channel.id] = channel
    try:
        yield core, channel
    finally:
        ours.close()
        theirs.close()


def _submit(core: Core, scheduler: Scheduler, channel_id: int, request_id: str, tokens: int) -> None:
    request = GenerationRequest(request_id, np.full(tokens, 5, dtype=TOKEN_DTYPE),
                                SamplingParams(max_tokens=4, temperature=0.0))
    header, payload = submit_frame(request)
    assert core._dispatch(scheduler, channel_id, header, bytes(payload))


def test_a_submit_whose_abort_already_arrived_is_never_queued(tiny: Engine, emitted: Emitted,
                                                              core_and_channel: tuple[Core, Channel]) -> None:
    core, channel = core_and_channel
    aborts = _Aborts()
    scheduler = _scheduler(tiny, aborts, emitted)
    aborts.pending = core.aborts_pending  # the scheduler reads the very set the reader threads fill
    try:
        core.aborts_pending.add("abandoned")  # a reader thread saw its abort while its submit waited in the inbox
        _submit(core, scheduler, channel.id, "abandoned", 64)
        assert scheduler.active_requests == 0 and "abandoned" not in core.owner_of
        assert core._dispatch(scheduler, channel.id, {"op": "abort", "id": "abandoned"}, b"")
        assert not core.aborts_pending
        channel.open = False  # a front end gone: what it submitted has no one to answer to
        _submit(core, scheduler, channel.id, "orphan", 64)
        assert scheduler.active_requests == 0 and not core.owner_of
        channel.open = True
        _submit(core, scheduler, channel.id, "served", 8)
        assert scheduler.active_requests == 1 and core.owner_of == {"served": channel.id}
        _run_until_idle(scheduler)
        assert {h["id"] for h in emitted} == {"served"} and emitted[-1]["done"]
    finally:
        scheduler.close()
