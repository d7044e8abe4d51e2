"""Admission: the bounded queue over the running limit, by priority class, FIFO within one; deadlines, Retry-After
from the drain rate, a client leaving while queued; and through a real orchestrator, a request that waits for the
slot a stream holds."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import pytest
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from frontend.config import AdmissionConfig
from frontend.errors import InvalidRequestError, OverloadedError, UpstreamUnavailableError
from frontend.metrics import Metrics
from orchestrator.admission import BATCH, DEFAULT, INTERACTIVE, Admission, priority_of
from tests.cluster import MODEL, Cluster, Node, RecordingEngine, sample, start_orchestrator, start_worker
from tests.orchestrator.test_response_store import FakeClock
from tests.servers import running
from tests.waiting import eventually, eventually_async

MESSAGES = [{"role": "user", "content": "hi"}]


def counted(metrics: Metrics, priority: str, outcome: str, gate: str = "orchestrator") -> float:
    return sample(metrics, "disagg_admission_total", gate=gate, priority=priority, outcome=outcome)


def waiting(metrics: Metrics, priority: str, gate: str = "orchestrator") -> float:
    return sample(metrics, "disagg_admission_queue_length", gate=gate, priority=priority)


def admission_of(limit: int, clock: FakeClock | None = None, metrics: Metrics | None = None,
                 workers: bool = True, **config: Any) -> Admission:
    return Admission(limit, AdmissionConfig.model_validate(config), metrics or Metrics(), lambda: workers,
                     clock or FakeClock())


async def queued(admission: Admission, priority: int) -> asyncio.Task[None]:
    """A request of this class waiting in the queue (asserted: it did not run at once)."""
    before = admission.queued
    task = asyncio.create_task(admission.admit(priority))
    assert await eventually_async(lambda: admission.queued == before + 1 or task.done())
    assert not task.done()
    return task


async def test_under_the_limit_a_request_runs_at_once_and_over_it_waits_its_turn() -> None:
    admission = admission_of(2)
    await admission.admit(DEFAULT)
    await admission.admit(DEFAULT)
    first, second = await queued(admission, DEFAULT), await queued(admission, DEFAULT)
    admission.release(DEFAULT)
    await first
    assert not second.done() and admission.running == [0, 2, 0]
    admission.release(DEFAULT)
    await second
    assert admission.queued == 0


async def test_a_higher_class_is_served_first_whatever_its_arrival() -> None:
    admission = admission_of(1, batch_share=1.0)
    await admission.admit(BATCH)
    batch, default, interactive = (await queued(admission, BATCH), await queued(admission, DEFAULT),
                                   await queued(admission, INTERACTIVE))
    order: list[asyncio.Task[None]] = []

    def served(n: int) -> bool:
        order.extend(task for task in (batch, default, interactive) if task.done() and task not in order)
        return len(order) == n

    for n in range(1, 4):
        admission.release(next(p for p in range(3) if admission.running[p]))
        assert await eventually_async(lambda n=n: served(n))  # type: ignore[misc]
    assert order == [interactive, default, batch]


async def test_batch_holds_at_most_its_share_and_default_leaves_the_interactive_reserve() -> None:
    admission = admission_of(10, batch_share=0.5, interactive_reserve=0.1)
    for _ in range(5):
        await admission.admit(BATCH)
    sixth_batch = await queued(admission, BATCH)  # five slots free, none for batch
    for _ in range(4):
        await admission.admit(DEFAULT)
    tenth_default = await queued(admission, DEFAULT)  # one slot free: the interactive reserve
    await admission.admit(INTERACTIVE)  # takes it at once, ahead of both queues
    assert admission.running == [1, 4, 5]
    admission.release(BATCH)  # nine in use: still no room below interactive
    assert admission.running == [1, 4, 4] and not tenth_default.done()
    admission.release(INTERACTIVE)  # eight: one slot opens for the waiting default, none more
    await tenth_default
    assert admission.running == [0, 5, 4] and not sixth_batch.done()
    sixth_batch.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await sixth_batch


async def test_a_full_queue_is_a_429_whose_retry_after_is_the_queue_ahead_at_the_drain_rate() -> None:
    clock = FakeClock()
    metrics = Metrics()
    admission = admission_of(4, clock, metrics, max_queued=3)
    for _ in range(4):
        await admission.admit(DEFAULT)
    for _ in range(4):  # four finished over the last two seconds: 2 per second
        clock.now += 0.5
        admission.release(DEFAULT)
        await admission.admit(DEFAULT)
    queue = [await queued(admission, DEFAULT) for _ in range(3)]
    with pytest.raises(OverloadedError) as caught:
        await admission.admit(DEFAULT)
    # Three ahead and itself, at 2 a second (the window is the 2 s since start, not yet 10 s).
    assert caught.value.headers == {"Retry-After": "2"}
    assert counted(metrics, "default", "queue_full") == 1
    assert waiting(metrics, "default") == 3
    for task in queue:
        task.cancel()
    await asyncio.gather(*queue, return_exceptions=True)
    assert waiting(metrics, "default") == 0
    assert counted(metrics, "default", "left") == 3


async def test_a_request_that_waits_past_the_deadline_is_a_429_and_out_of_the_queue() -> None:
    metrics = Metrics()
    admission = admission_of(1, metrics=metrics, queue_timeout_s=0.05)
    await admission.admit(DEFAULT)
    with pytest.raises(OverloadedError, match=r"no slot freed within 0\.05 s"):
        await admission.admit(DEFAULT)
    assert admission.queued == 0
    assert counted(metrics, "default", "timed_out") == 1


async def test_a_client_that_leaves_as_its_slot_is_granted_passes_the_slot_on() -> None:
    admission = admission_of(1)
    await admission.admit(DEFAULT)
    leaving, next_one = await queued(admission, DEFAULT), await queued(admission, DEFAULT)
    admission.release(DEFAULT)  # granted to ``leaving``, which is cancelled before it runs
    leaving.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await leaving
    await next_one
    assert admission.running == [0, 1, 0] and admission.queued == 0


async def test_with_no_healthy_worker_a_request_that_would_wait_is_a_503() -> None:
    admission = admission_of(1, workers=False)
    await admission.admit(DEFAULT)  # a free slot: the flow itself answers 503 for want of a worker
    with pytest.raises(UpstreamUnavailableError):
        await admission.admit(DEFAULT)


def test_the_priority_header_names_a_class_or_is_a_400() -> None:
    assert [priority_of(v) for v in (None, "interactive", " Batch ", "default")] == [DEFAULT, INTERACTIVE, BATCH,
                                                                                      DEFAULT]
    with pytest.raises(InvalidRequestError) as caught:
        priority_of("urgent")
    assert (caught.value.status_code, caught.value.code) == (400, "invalid_priority")


@pytest.fixture(scope="module")
def one_slot(cluster: Cluster) -> Iterator[tuple[Node, Node]]:
    """An orchestrator that runs one request at a time and queues the rest, in front of a slow GEN."""
    with contextlib.ExitStack() as stack:
        from workers.engines.synthetic import SyntheticConfig

        slow_gen = start_worker(stack, "generation", SyntheticConfig(inter_token_latency_s=0.05))
        yield start_orchestrator(stack, [cluster.ctx.url], [slow_gen.url], max_concurrent_requests=1), slow_gen


def test_through_the_orchestrator_a_request_waits_for_the_slot_and_then_runs(one_slot: tuple[Node, Node]) -> None:
    orchestrator, _ = one_slot
    url = orchestrator.url
    body = {"model": MODEL, "messages": MESSAGES, "max_tokens": 200, "stream": True}
    with httpx.Client(timeout=60) as http, ThreadPoolExecutor(1) as pool:
        with http.stream("POST", url + "/v1/chat/completions", json=body) as first:
            chunks = first.iter_raw()
            next(chunks)  # streaming: it holds the only slot
            second = pool.submit(httpx.post, url + "/v1/chat/completions", timeout=60,
                                 json={**body, "stream": False, "max_tokens": 2},
                                 headers={"x-priority": "batch"})
            assert eventually(lambda: waiting(orchestrator.metrics, "batch") == 1)
            assert not second.done()
        # The client that held the slot left: the waiting request runs.
        answer = second.result(timeout=60)
        assert answer.status_code == 200, answer.text
        assert counted(orchestrator.metrics, "batch", "queued") == 1
        bad = http.post(url + "/v1/chat/completions", json={**body, "stream": False}, headers={"x-priority": "vip"})
        assert (bad.status_code, bad.json()["error"]["code"]) == (400, "invalid_priority")


def test_a_client_that_is_no_tenant_cannot_take_the_interactive_reserve(cluster: Cluster) -> None:
    # The interactive class is a tenant's, by its configuration: anyone else asking for it runs as default (the
    # header is not refused, as a tenant's ask above its class is not), and may still ask for batch.
    orchestrator = cluster.orchestrator
    classes = ("interactive", "default", "batch")
    before = [counted(orchestrator.metrics, p, "admitted") for p in classes]
    for asked in ("interactive", "Interactive", "batch"):
        answer = httpx.post(orchestrator.url + "/v1/chat/completions", timeout=60, headers={"x-priority": asked},
                            json={"model": MODEL, "messages": MESSAGES, "max_tokens": 2})
        assert answer.status_code == 200, answer.text
    after = [counted(orchestrator.metrics, p, "admitted") for p in classes]
    assert [b - a for a, b in zip(before, after, strict=True)] == [0, 2, 1]


@pytest.fixture(scope="module")
def one_prefill_at_a_time(cluster: Cluster) -> Iterator[tuple[Node, Node]]:
    """An orchestrator whose one CTX worker takes one prefill at a time (its window), each 1 s long: long beside
    the milliseconds the test takes to queue two more behind it, even on a busy machine."""
    with contextlib.ExitStack() as stack:
        from workers.engines.synthetic import SyntheticConfig

        slow_ctx = start_worker(stack, "context", SyntheticConfig(time_to_first_token_s=1.0))
        orchestrator = start_orchestrator(stack, [slow_ctx.url], [cluster.gen.url],
                                          context_servers={"urls": [slow_ctx.url], "max_running_prefills": 1})
        yield orchestrator, slow_ctx


def test_prefills_past_a_ctx_workers_window_wait_at_the_orchestrator_by_class(
    one_prefill_at_a_time: tuple[Node, Node]
) -> None:
    orchestrator, ctx = one_prefill_at_a_time
    assert ctx.recorder is not None
    ctx.recorder.exchanges.clear()

    def ask(text: str, priority: str) -> httpx.Response:
        return httpx.post(orchestrator.url + "/v1/chat/completions", timeout=60, headers={"x-priority": priority},
                          json={"model": MODEL, "messages": [{"role": "user", "content": text}], "max_tokens": 2})

    def prefill_waiting(priority: str) -> bool:
        return waiting(orchestrator.metrics, priority, gate="prefill") == 1

    with ThreadPoolExecutor(3) as pool:
        first = pool.submit(ask, "first batch", "batch")
        assert eventually(lambda: len(ctx.recorder.exchanges) == 1)
        second = pool.submit(ask, "second batch", "batch")
        assert eventually(lambda: prefill_waiting("batch"))
        urgent = pool.submit(ask, "urgent", "default")
        assert eventually(lambda: prefill_waiting("default"))
        assert [f.result(timeout=60).status_code for f in (first, second, urgent)] == [200, 200, 200]
    order = [exchange.request_json()["messages"][0]["content"] for exchange in ctx.recorder.exchanges
             if exchange.path == "/v1/chat/completions"]
    assert order == ["first batch", "urgent", "second batch"]  # the default one went ahead of the waiting batch
    assert counted(orchestrator.metrics, "default", "queued", gate="prefill") == 1


async def test_a_waiter_at_a_limit_that_grows_without_an_event_is_let_in() -> None:
    # The prefill gate's limit moves when a worker's circuit breaker turns half-open: nothing announces it.
    room = {"slots": 1}
    admission = Admission(lambda: room["slots"], AdmissionConfig(), Metrics(), lambda: True, FakeClock())
    await admission.admit(DEFAULT)
    room["slots"] = 0  # the one worker's breaker opened
    waiter = await queued(admission, DEFAULT)
    admission.release(DEFAULT)
    assert not waiter.done()
    room["slots"] = 1  # its cool-down is over
    assert await eventually_async(waiter.done)
    assert admission.running == [0, 1, 0]


END_MARKERS = (b"data: [DONE]", b"event: response.completed", b"event: response.incomplete")


class StallsAfterDone:
    """A GEN's ASGI app that sends its stream's end marker (``data: [DONE]``, a Responses stream's last event) and
    then not its body's end: it holds the connection until its peer closes it (counted in ``released``)."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app
        self.released = 0

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        held = False

        async def stalling_send(message: Message) -> None:
            nonlocal held
            if held:
                return  # what comes after the marker never leaves
            body = message.get("body", b"") if message["type"] == "http.response.body" else b""
            if any(marker in body for marker in END_MARKERS):
                held = True
                await send({**message, "more_body": True})
                while (await receive())["type"] != "http.disconnect":
                    pass
                self.released += 1
                return
            await send(message)
        await self.app(scope, receive, stalling_send)


@pytest.fixture(scope="module")
def stalling_gen(cluster: Cluster) -> Iterator[tuple[Node, StallsAfterDone]]:
    """An orchestrator that runs one request at a time, in front of a GEN that stalls after its end marker."""
    from workers.server import create_worker_app
    from workers.settings import WorkerSettings

    with contextlib.ExitStack() as stack:
        stalling = StallsAfterDone(create_worker_app(RecordingEngine(), WorkerSettings(role="generation")))
        gen_url = stack.enter_context(running(stalling))
        yield start_orchestrator(stack, [cluster.ctx.url], [gen_url], max_concurrent_requests=1), stalling


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/responses"])
def test_a_gen_that_stalls_after_its_end_marker_holds_no_slot_and_no_connection(
    stalling_gen: tuple[Node, StallsAfterDone], path: str
) -> None:
    orchestrator, stalling = stalling_gen
    url = orchestrator.url + path
    released = stalling.released
    queued = counted(orchestrator.metrics, "default", "queued")
    ask: dict[str, Any] = ({"model": MODEL, "prompt": "hi", "max_tokens": 4} if path == "/v1/completions" else
                           {"model": MODEL, "input": "hi", "max_output_tokens": 4})  # a Responses answer is kept
    # A hang guard only: a GEN read waits request_timeout_s (600 s) for the end that never comes.
    with httpx.Client(timeout=60) as keep_alive:
        streamed = keep_alive.post(url, json={**ask, "stream": True})
        assert streamed.status_code == 200, streamed.text
        assert streamed.text.endswith(("data: [DONE]\n\n", "}\n\n"))  # whole, at the marker
        # The only running slot went with the end marker: another client's request runs at once, not queued.
        other = httpx.post(url, json=ask, timeout=60)
        assert other.status_code == 200, other.text
        assert counted(orchestrator.metrics, "default", "queued") == queued
        # The kept-alive connection's next request is served once the stalled tail was given up on.
        assert keep_alive.post(url, json=ask).status_code == 200
    assert eventually(lambda: stalling.released == released + 1)  # the orchestrator closed its connection to GEN
    assert sample(orchestrator.metrics, "disagg_engine_inflight_requests", role="orchestrator") == 0


class WorkerComingBack:
    """A ``WorkerWait`` whose worker comes back when the test says so (or never, when ``expected`` is False)."""

    def __init__(self, expected: bool = True) -> None:
        self.is_expected = expected
        self.returned = asyncio.Event()
        self.waiting = 0

    def expected(self) -> bool:
        return self.is_expected

    async def back(self, timeout_s: float) -> None:
        self.waiting += 1
        try:
            async with asyncio.timeout(timeout_s):
                await self.returned.wait()
        except TimeoutError:
            raise UpstreamUnavailableError("no healthy gen worker is available: none came back") from None
        finally:
            self.waiting -= 1


def admission_waiting_for(wait: WorkerComingBack, workers: dict[str, bool], metrics: Metrics | None = None,
                          **config: Any) -> Admission:
    return Admission(4, AdmissionConfig.model_validate(config), metrics or Metrics(), lambda: workers["up"],
                     FakeClock(), worker_wait=wait)


async def test_a_request_that_finds_no_worker_waits_for_one_expected_back_and_runs_when_it_is() -> None:
    wait, workers = WorkerComingBack(), {"up": False}
    admission = admission_waiting_for(wait, workers)
    task = asyncio.create_task(admission.admit(DEFAULT))
    assert await eventually_async(lambda: wait.waiting == 1)
    assert not task.done() and admission.awaiting_workers == 1
    workers["up"] = True
    wait.returned.set()
    await task
    assert admission.running == [0, 1, 0] and admission.awaiting_workers == 0


async def test_a_wait_for_a_worker_that_does_not_come_back_in_time_is_a_503_counted_no_worker() -> None:
    metrics = Metrics()
    admission = admission_waiting_for(WorkerComingBack(), {"up": False}, metrics, queue_timeout_s=0.01)
    with pytest.raises(UpstreamUnavailableError, match="none came back"):
        await admission.admit(DEFAULT)
    assert counted(metrics, "default", "no_worker") == 1
    assert admission.running == [0, 0, 0] and admission.awaiting_workers == 0


async def test_with_no_worker_expected_back_a_request_does_not_wait() -> None:
    wait = WorkerComingBack(expected=False)
    admission = admission_waiting_for(wait, {"up": False})
    await admission.admit(DEFAULT)  # a free slot: the flow itself answers 503, naming the pool it lacks
    assert wait.waiting == 0


async def test_no_more_requests_wait_for_a_worker_than_may_queue() -> None:
    wait = WorkerComingBack()
    admission = admission_waiting_for(wait, {"up": False}, max_queued=1)
    first = asyncio.create_task(admission.admit(DEFAULT))
    assert await eventually_async(lambda: wait.waiting == 1)
    with pytest.raises(UpstreamUnavailableError, match="already wait"):
        await admission.admit(DEFAULT)
    first.cancel()  # a client that leaves while it waits holds nothing
    with contextlib.suppress(asyncio.CancelledError):
        await first
    assert admission.awaiting_workers == 0 and admission.running == [0, 0, 0]


async def test_a_request_that_waited_for_a_worker_queues_only_what_is_left_of_its_timeout() -> None:
    # The worker came back only as the timeout ran out, and the one slot is taken: the request has no time left to
    # queue for it, and is refused now rather than after a second whole timeout.
    wait, workers, clock = WorkerComingBack(), {"up": True}, FakeClock()
    admission = Admission(1, AdmissionConfig.model_validate({"queue_timeout_s": 3600}), Metrics(),
                          lambda: workers["up"], clock, worker_wait=wait)
    await admission.admit(DEFAULT)  # the slot, held
    workers["up"] = False
    task = asyncio.create_task(admission.admit(DEFAULT))
    assert await eventually_async(lambda: wait.waiting == 1)
    clock.now += 3600
    workers["up"] = True
    wait.returned.set()
    assert await eventually_async(task.done)
    with pytest.raises(OverloadedError):
        await task
    assert admission.running == [0, 1, 0] and admission.queued == 0
