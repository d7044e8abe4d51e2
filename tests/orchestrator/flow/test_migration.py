"""Mid-stream migration with real processes: a CTX and two GEN reference-engine workers (each its own process with
its own engine core), the orchestrator in front. The GEN that serves a request is SIGKILLed after the client has
part of the answer; the answer must go on on the other GEN exactly as if nothing had happened.

Each GEN sits behind a ``CuttingProxy``, so that what the client has when the worker dies is a condition the test
sets (the answer's first frames), not a race with how fast the worker decodes. The tiny random model writes
arbitrary bytes, so its answers cut multi-byte characters across tokens: the continuation's text must join them
exactly as the uninterrupted answer does.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import os
import signal
import subprocess
import sys
import tracemalloc
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any, cast

import httpx
import openai
import pytest

from entrypoints.launcher import free_port
from frontend.config import parse_config
from frontend.errors import EngineError, EngineRequestError
from frontend.metrics import Metrics
from frontend.openai_output import Endpoint, stream_error_frames
from orchestrator.flow.migration import Migration, Migrations, StreamLedger
from orchestrator.flow.request import FlowRequest
from orchestrator.routers import RoutingKey
from orchestrator.server import create_orchestrator_app
from tests.orchestrator.flow.cutting_proxy import CuttingProxy
from tests.orchestrator.members import idle_members
from tests.servers import answers_healthy, running
from tests.waiting import eventually
from tests.workers.engines.reference.tiny_model import write_tiny_model

ROOT = Path(__file__).resolve().parents[3]
MESSAGES: Any = [{"role": "user", "content": "Tell me a long story about the sea."}]
PROMPT = "Once upon a time, far away,"
MAX_TOKENS = 48
# What the client has when its GEN dies: the stream's opening frames (a chat role, a Responses stream's four first
# events), then this many frames of text.
CUT_TEXT_FRAMES = 3


@dataclass
class Gen:
    port: int
    proxy: CuttingProxy
    url: str  # the proxy's: what the orchestrator knows
    process: subprocess.Popen[bytes] | None = None


@dataclass
class System:
    model_path: Path
    logs: Path
    ctx_url: str
    gens: list[Gen]
    orchestrator: str
    app: Any = None
    # A second orchestrator over the same workers that prefills short prompts on GEN alone (conditional
    # disaggregation): a stream it moves goes on through CTX all the same.
    local: str = ""
    local_app: Any = None
    processes: list[subprocess.Popen[bytes]] = field(default_factory=list)

    def client(self) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.orchestrator + "/v1", api_key="x", max_retries=0, timeout=120)

    def start_gen(self, gen: Gen) -> None:
        gen.process = _worker(self, "generation", gen.port, f"gen-{gen.port}")
        assert eventually(lambda: answers_healthy(f"http://127.0.0.1:{gen.port}"), timeout_s=120), self.log(gen.port)

    def log(self, port: int) -> str:
        return (self.logs / f"gen-{port}.log").read_text(errors="replace")[-4000:]

    def all_routable(self) -> bool:
        """Both GEN workers run, and the orchestrator would route to either (it takes a dead one back only once its
        health check passes)."""
        return (all(gen.process is not None and gen.process.poll() is None for gen in self.gens)
                and all(worker.routable for app in (self.app, self.local_app)
                        for worker in app.state.pools["generation"].workers))

    def arm(self, frames: int) -> None:
        for gen in self.gens:
            gen.proxy.arm(frames)

    def arm_to_fail(self, frames: int, error: bytes) -> None:
        """The next answer's engine fails after ``frames`` frames: its GEN ends it with ``error`` (GEN's own error
        event) in place of the rest, and lives on; the other proxies are disarmed at the cut, so the continuation
        runs in full wherever it goes."""
        for gen in self.gens:
            gen.proxy.arm(frames, then=error, disarming=tuple(g.proxy for g in self.gens if g is not gen))

    def kill_the_one_holding(self) -> Gen:
        """SIGKILL the GEN worker (and its engine core) whose answer the proxy cut; the other is disarmed, so the
        continuation runs in full wherever it goes."""
        assert eventually(lambda: any(g.proxy.holding.is_set() for g in self.gens))
        return self.kill(next(g for g in self.gens if g.proxy.holding.is_set()))

    def kill(self, victim: Gen) -> Gen:
        for gen in self.gens:
            gen.proxy.disarm()
        assert victim.process is not None
        os.killpg(victim.process.pid, signal.SIGKILL)
        victim.process.wait(timeout=30)
        return victim

    def metric(self, name: str, orchestrator: str | None = None, **labels: str) -> float:
        text = httpx.get((orchestrator or self.orchestrator) + "/metrics", timeout=5).text
        total = 0.0
        for line in text.splitlines():
            if line.startswith(name + "{") and all(f'{k}="{v}"' in line for k, v in labels.items()):
                total += float(line.rsplit(" ", 1)[1])
        return total


def _worker(system: System, role: str, port: int, name: str) -> subprocess.Popen[bytes]:
    log = (system.logs / f"{name}.log").open("ab")
    process = subprocess.Popen(
        [sys.executable, "-m", "entrypoints.cli", "--log-level", "warning", "worker", "--role", role,
         "--port", str(port), "--engine", "reference", "--model", str(system.model_path), "--blas-threads", "1"],
        cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    system.processes.append(process)
    return process


@pytest.fixture(scope="module")
def system(tmp_path_factory: pytest.TempPathFactory) -> Iterator[System]:
    tmp = tmp_path_factory.mktemp("migration")
    model = write_tiny_model(tmp / "tiny.gguf", seed=0)
    ctx_port = free_port()
    with contextlib.ExitStack() as stack:
        gens = []
        for _ in range(2):
            port = free_port()
            proxy = CuttingProxy(f"http://127.0.0.1:{port}")
            url = proxy.start()
            stack.callback(proxy.stop)
            gens.append(Gen(port, proxy, url))
        system = System(model, tmp, f"http://127.0.0.1:{ctx_port}", gens, "")

        def stop_all() -> None:
            for process in system.processes:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(process.pid, signal.SIGKILL)
                process.wait(timeout=30)
        stack.callback(stop_all)
        _worker(system, "context", ctx_port, "ctx")
        for gen in gens:
            gen.process = _worker(system, "generation", gen.port, f"gen-{gen.port}")
        urls = [system.ctx_url, *(f"http://127.0.0.1:{g.port}" for g in gens)]
        assert eventually(lambda: all(answers_healthy(url) for url in urls), timeout_s=120), \
            (tmp / "ctx.log").read_text()
        config = parse_config({"context_servers": {"urls": [system.ctx_url]},
                               "generation_servers": {"urls": [g.url for g in gens]},
                               "max_retries": 1, "health_check_interval_s": 0.2, "request_timeout_s": 60})
        system.app = create_orchestrator_app(config)
        system.orchestrator = stack.enter_context(running(system.app))
        system.local_app = create_orchestrator_app(config.model_copy(update={"max_local_prefill_length": 100_000}))
        system.local = stack.enter_context(running(system.local_app))
        yield system


@pytest.fixture
def fresh(system: System) -> Iterator[System]:
    """Both GEN workers up and in the pool, no proxy armed; a GEN killed by the test is started again after it."""
    for gen in system.gens:
        gen.proxy.disarm()
        if gen.process is None or gen.process.poll() is not None:
            system.start_gen(gen)
    assert eventually(system.all_routable, timeout_s=60)
    yield system


def _chat_stream(client: openai.OpenAI, model: str, **extra: Any) -> Iterator[Any]:
    return iter(client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=MAX_TOKENS,
                                               stream=True, stream_options={"include_usage": True},
                                               extra_body={"ignore_eos": True}, **extra))


def _model(system: System) -> str:
    return str(httpx.get(system.orchestrator + "/v1/models", timeout=10).json()["data"][0]["id"])


def _read_chat(chunks: Iterator[Any], until: int | None = None) -> tuple[list[str], list[str | None], Any]:
    texts: list[str] = []
    finishes: list[str | None] = []
    usage = None
    for chunk in chunks:
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            if choice.delta.content:
                texts.append(choice.delta.content)
            if choice.finish_reason is not None:
                finishes.append(choice.finish_reason)
        if until is not None and len(texts) >= until:
            break
    return texts, finishes, usage


_ANSWER_SCHEMA: Any = {"type": "object", "properties": {"story": {"type": "string"}}, "required": ["story"]}


@pytest.mark.parametrize("sampling", [
    {"temperature": 0.0},
    {"temperature": 1.0, "seed": 1234},
    # What reads the tokens already sent: penalties count them, a bias and stop strings go on applying.
    {"temperature": 0.8, "seed": 99, "frequency_penalty": 1.5, "presence_penalty": 0.5,
     "logit_bias": {"300": 5, "214": -100}, "stop": ["Hello", "zz"]},
    # The grammar's state is advanced over the tokens the client has.
    {"temperature": 0.0, "response_format": {"type": "json_schema",
                                             "json_schema": {"name": "story", "schema": _ANSWER_SCHEMA}}},
], ids=["greedy", "seeded", "penalties-bias-stops", "structured"])
def test_a_chat_stream_goes_on_on_another_gen_when_its_gen_is_killed(fresh: System, sampling: dict[str, Any]
                                                                     ) -> None:
    model = _model(fresh)
    with fresh.client() as client:
        whole_texts, whole_finishes, whole_usage = _read_chat(_chat_stream(client, model, **sampling))
        resumed_before = fresh.metric("disagg_stream_migrations_total", outcome="resumed")
        assert len(whole_texts) > CUT_TEXT_FRAMES + 2  # (so the cut is mid-stream)
        fresh.arm(1 + CUT_TEXT_FRAMES)
        chunks = _chat_stream(client, model, **sampling)
        first, _, _ = _read_chat(chunks, until=CUT_TEXT_FRAMES - 1)  # the client has part of the answer ...
        fresh.kill_the_one_holding()  # ... when its GEN dies
        rest, finishes, usage = _read_chat(chunks)
    assert "".join(first + rest) == "".join(whole_texts)
    assert finishes == whole_finishes and len(finishes) == 1
    assert usage.completion_tokens == whole_usage.completion_tokens
    assert usage.prompt_tokens == whole_usage.prompt_tokens
    assert fresh.metric("disagg_stream_migrations_total", outcome="resumed") == resumed_before + 1


def test_a_completions_stream_with_logprobs_goes_on_with_the_same_tokens(fresh: System) -> None:
    model = _model(fresh)

    def stream() -> Iterator[Any]:
        return iter(fresh.client().completions.create(
            model=model, prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0.0, stream=True, logprobs=2,
            stream_options={"include_usage": True}, extra_body={"ignore_eos": True}))

    def read(chunks: Iterator[Any], until: int | None = None) -> tuple[list[str], list[Any], Any]:
        """The texts, each token's (text, logprob, offset in the whole text) and the usage."""
        texts: list[str] = []
        tokens: list[Any] = []
        usage = None
        for chunk in chunks:
            usage = chunk.usage or usage
            for choice in chunk.choices:
                texts.append(choice.text)
                if choice.logprobs is not None:
                    lp = choice.logprobs
                    tokens += zip(lp.tokens or [], lp.token_logprobs or [], lp.text_offset or [], strict=True)
            if until is not None and len(tokens) >= until:
                break
        return texts, tokens, usage

    whole_texts, whole_tokens, whole_usage = read(stream())
    resumed_before = fresh.metric("disagg_stream_migrations_total", outcome="resumed")
    assert len(whole_tokens) > CUT_TEXT_FRAMES + 2
    fresh.arm(CUT_TEXT_FRAMES)
    chunks = stream()
    first, first_tokens, _ = read(chunks, until=CUT_TEXT_FRAMES - 1)
    fresh.kill_the_one_holding()
    rest, rest_tokens, usage = read(chunks)
    assert "".join(first + rest) == "".join(whole_texts)
    assert first_tokens + rest_tokens == whole_tokens  # each token once, in order, its logprob and offset too
    assert usage.completion_tokens == whole_usage.completion_tokens == MAX_TOKENS
    assert fresh.metric("disagg_stream_migrations_total", outcome="resumed") == resumed_before + 1


def test_a_responses_stream_goes_on_with_its_numbering_and_one_completion(fresh: System) -> None:
    model = _model(fresh)

    def stream() -> Iterator[Any]:
        return iter(fresh.client().responses.create(model=model, input=MESSAGES[0]["content"],
                                                    max_output_tokens=MAX_TOKENS, temperature=0.0, stream=True,
                                                    extra_body={"ignore_eos": True}))

    whole = list(stream())
    resumed_before = fresh.metric("disagg_stream_migrations_total", outcome="resumed")
    assert [e.type for e in whole].count("response.output_text.delta") > CUT_TEXT_FRAMES + 2
    fresh.arm(4 + CUT_TEXT_FRAMES)
    events = stream()
    got = [next(events) for _ in range(4 + CUT_TEXT_FRAMES - 1)]
    fresh.kill_the_one_holding()
    got += list(events)
    numbers = [event.sequence_number for event in got]
    assert numbers == list(range(len(got)))  # numbered on, never restarted or repeated
    assert [e.type for e in got].count("response.created") == 1
    ends = [e for e in got if e.type in ("response.completed", "response.incomplete")]
    assert len(ends) == 1
    deltas = "".join(e.delta for e in got if e.type == "response.output_text.delta")
    whole_end = whole[-1].response
    assert deltas == "".join(e.delta for e in whole if e.type == "response.output_text.delta")
    assert ends[0].response.output_text == whole_end.output_text == deltas
    assert ends[0].response.id == got[0].response.id  # one answer, one id
    assert ends[0].response.usage.output_tokens == whole_end.usage.output_tokens
    assert fresh.metric("disagg_stream_migrations_total", outcome="resumed") == resumed_before + 1


def test_a_stream_prefilled_on_gen_alone_goes_on_through_ctx(fresh: System) -> None:
    model = _model(fresh)
    with openai.OpenAI(base_url=fresh.local + "/v1", api_key="x", max_retries=0, timeout=120) as client:
        whole_texts, _, whole_usage = _read_chat(_chat_stream(client, model, temperature=0.0))
        assert fresh.metric("disagg_prefill_placement_total", fresh.local, placement="gen_short") >= 1
        fresh.arm(1 + CUT_TEXT_FRAMES)
        chunks = _chat_stream(client, model, temperature=0.0)
        first, _, _ = _read_chat(chunks, until=CUT_TEXT_FRAMES - 1)
        fresh.kill_the_one_holding()
        rest, finishes, usage = _read_chat(chunks)
    assert "".join(first + rest) == "".join(whole_texts)
    assert finishes == ["length"] and usage.completion_tokens == whole_usage.completion_tokens == MAX_TOKENS
    assert fresh.metric("disagg_stream_migrations_total", fresh.local, outcome="resumed") == 1

@pytest.mark.parametrize("endpoint", ["chat", "completions", "responses"])
def test_a_whole_answer_lost_with_its_gen_is_answered_by_another(fresh: System, endpoint: str) -> None:
    model = _model(fresh)
    client = fresh.client()

    def ask() -> str:
        more: Any = {"temperature": 0.0, "extra_body": {"ignore_eos": True}}
        if endpoint == "chat":
            reply = client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=MAX_TOKENS, **more)
            return reply.choices[0].message.content or ""
        if endpoint == "completions":
            return str(client.completions.create(model=model, prompt=PROMPT, max_tokens=MAX_TOKENS,
                                                 **more).choices[0].text)
        return str(client.responses.create(model=model, input=MESSAGES[0]["content"], max_output_tokens=MAX_TOKENS,
                                           **more).output_text)

    expected = ask()
    assert expected
    fresh.arm(0)
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        answer = pool.submit(ask)  # GEN's whole answer is held by its proxy ...
        fresh.kill_the_one_holding()  # ... and lost with it
        assert answer.result(timeout=120) == expected


def test_a_stream_whose_client_left_is_never_migrated(fresh: System) -> None:
    model = _model(fresh)
    before = fresh.metric("disagg_stream_migrations_total")
    for gen in fresh.gens:
        gen.proxy.armed_posts = 0
    fresh.arm(1 + CUT_TEXT_FRAMES)
    with fresh.client() as client:
        chunks = _chat_stream(client, model, temperature=0.0)
        _read_chat(chunks, until=1)
        chunks.close()  # type: ignore[attr-defined]  # the client leaves ...
    assert eventually(lambda: all(w.inflight == 0 for w in fresh.app.state.pools["generation"].workers))
    fresh.kill(next(g for g in fresh.gens if g.proxy.armed_posts))  # ... before its GEN dies
    assert eventually(lambda: not fresh.all_routable())
    assert fresh.metric("disagg_stream_migrations_total") == before


def test_a_stream_of_several_choices_is_not_migrated_but_counted_and_ends_with_an_error(fresh: System) -> None:
    before = fresh.metric("disagg_stream_migrations_total", outcome="not_resumable")
    body = {"model": _model(fresh), "messages": MESSAGES, "max_tokens": MAX_TOKENS, "n": 2, "temperature": 1.0,
            "seed": 7, "stream": True, "ignore_eos": True}
    fresh.arm(2 + 2 * CUT_TEXT_FRAMES)
    received = b""
    with httpx.stream("POST", fresh.orchestrator + "/v1/chat/completions", json=body, timeout=120) as reply:
        pieces = reply.iter_raw()
        while received.count(b'"content":"') < 3:  # the client has part of both answers ...
            received += next(pieces)
        fresh.kill_the_one_holding()  # ... when their GEN dies
        received += b"".join(pieces)
    assert b": token_ids" not in received  # the ids are stripped all the same
    assert received.endswith(b'data: [DONE]\n\n') and b'"code":"upstream_error"' in received
    assert fresh.metric("disagg_stream_migrations_total", outcome="not_resumable") == before + 1

def test_no_hand_off_is_left_parked_after_migrations(fresh: System) -> None:
    def parked() -> float:
        text = httpx.get(fresh.ctx_url + "/metrics", timeout=5).text
        return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                   if line.startswith("disagg_kv_store_entries"))
    # A migration of its own (the suite's order is random: the other tests' may not have run yet), then none of the
    # hand-offs CTX parked for it, the first answer's and the continuation's, is left.
    model = _model(fresh)
    resumed_before = fresh.metric("disagg_stream_migrations_total", outcome="resumed")
    with fresh.client() as client:
        fresh.arm(1 + CUT_TEXT_FRAMES)
        chunks = _chat_stream(client, model, temperature=0.0)
        _read_chat(chunks, until=CUT_TEXT_FRAMES - 1)
        fresh.kill_the_one_holding()
        _, finishes, _ = _read_chat(chunks)
    assert finishes == ["length"]
    assert fresh.metric("disagg_stream_migrations_total", outcome="resumed") == resumed_before + 1
    assert eventually(lambda: parked() == 0, timeout_s=60)


# -- the ledger alone: what of GEN's pieces reaches the client ---------------------------------------------------

def _chunk(name: bytes, text: bytes, ids: bytes | None = None, created: int = 1) -> bytes:
    frame = b'data: {"id":"chatcmpl-%s","created":%d,"choices":[{"delta":{"content":"%s"}}]}\n\n' % (
        name, created, text)
    return b": token_ids " + ids + b"\n" + frame if ids is not None else frame


def test_the_ledger_passes_whole_frames_only_and_strips_the_ids() -> None:
    ledger = StreamLedger("chat")
    piece = _chunk(b"a1", b"x", b"5") + _chunk(b"a1", b"y", b"6,7")
    assert ledger.feed(piece[:-30]) == _chunk(b"a1", b"x")  # the second frame is not whole yet
    assert ledger.feed(piece[-30:] + b": token_ids 8\n\n") == _chunk(b"a1", b"y")  # (a frame of ids alone: nothing)
    assert ledger.sent_token_ids() == [5, 6, 7, 8]
    assert ledger.sent_steps() == [1, 2, 1]


def test_gen_s_own_error_event_is_held_back_and_breaks_the_stream() -> None:
    ledger = StreamLedger("chat")
    error = b'data: {"error":{"message":"the engine failed","type":"server_error"}}\n\ndata: [DONE]\n\n'
    assert ledger.feed(_chunk(b"a1", b"x", b"5") + error) == _chunk(b"a1", b"x")
    assert ledger.broken == "GEN wrote an error event: the engine failed"
    assert ledger.feed(_chunk(b"a1", b"z", b"9")) == b""


def test_a_continuation_s_opening_is_passed_over_and_the_rest_named_as_the_first_answer() -> None:
    ledger = StreamLedger("chat")
    role = b'data: {"id":"chatcmpl-%s","created":%d,"choices":[{"delta":{"role":"assistant"}}]}\n\n'
    ledger.feed(role % (b"a1", 1) + _chunk(b"a1", b"x", b"5") + _chunk(b"a1", b"y", b"6,7"))
    ledger.begin_replay()
    replayed = role % (b"b2", 9) + _chunk(b"b2", b"x", b"5", 9) + _chunk(b"b2", b"y", b"6,7", 9)
    assert ledger.feed(replayed + _chunk(b"b2", b"z", b"8", 9) + b"data: [DONE]\n\n") == (
        _chunk(b"a1", b"z") + b"data: [DONE]\n\n")
    assert ledger.broken is None
    assert ledger.sent_token_ids() == [5, 6, 7, 8]


def test_a_continuation_that_replays_other_tokens_breaks_the_stream() -> None:
    ledger = StreamLedger("chat")
    ledger.feed(_chunk(b"a1", b"x", b"5") + _chunk(b"a1", b"y", b"6"))
    ledger.begin_replay()
    assert ledger.feed(_chunk(b"b2", b"x", b"5") + _chunk(b"b2", b"q", b"4") + _chunk(b"b2", b"z", b"8")) == b""
    assert ledger.broken == "the continuation did not replay the tokens the client has"


def _call_opened(name: bytes, created: int = 1) -> bytes:
    return (b'data: {"id":"chatcmpl-%s","created":%d,"choices":[{"delta":{"tool_calls":[{"index":0,"id":"call_1",'
            b'"function":{"name":"f"}}]}}]}\n\n' % (name, created))


def test_a_step_cut_between_its_frames_reaches_the_client_whole_or_not_at_all() -> None:
    """A step of two frames (a call opened, then its arguments' first piece with the step's ids) whose GEN dies
    between them: the first is held, so the continuation's replay of the step, passed over whole, repeats nothing."""
    ledger = StreamLedger("chat")
    assert ledger.feed(_chunk(b"a1", b"x", b"5")) == _chunk(b"a1", b"x")
    assert ledger.feed(_call_opened(b"a1")) == b""  # its step's ids have not come: held
    ledger.begin_replay()  # GEN died here; the client has "x" only
    assert ledger.sent_token_ids() == [5]
    replayed = _chunk(b"b2", b"x", b"5", 9) + _call_opened(b"b2", 9) + _chunk(b"b2", b"{", b"6,7", 9)
    assert ledger.feed(replayed + b"data: [DONE]\n\n") == (
        _call_opened(b"a1") + _chunk(b"a1", b"{") + b"data: [DONE]\n\n")
    assert ledger.broken is None and ledger.sent_token_ids() == [5, 6, 7]


def test_frames_after_the_last_step_go_out_with_the_end_marker_and_a_stream_that_cannot_move_holds_nothing() -> None:
    finish = b'data: {"id":"chatcmpl-a1","created":1,"choices":[{"delta":{},"finish_reason":"stop"}]}\n\n'
    ledger = StreamLedger("chat")
    assert ledger.feed(_chunk(b"a1", b"x", b"5")) == _chunk(b"a1", b"x")
    assert ledger.feed(finish) == b""
    assert ledger.feed(b"data: [DONE]\n\n") == finish + b"data: [DONE]\n\n"
    error = b'data: {"error":{"message":"the engine failed","type":"server_error"}}\n\n'
    ledger = StreamLedger("chat")
    ledger.feed(_chunk(b"a1", b"x", b"5"))
    assert ledger.feed(_call_opened(b"a1") + error) == b""  # the unfinished step is dropped with the break
    assert ledger.broken == "GEN wrote an error event: the engine failed"
    moving_nowhere = StreamLedger("chat", holds=False)
    assert moving_nowhere.feed(_chunk(b"a1", b"x", b"5") + finish) == _chunk(b"a1", b"x") + finish


def test_a_gen_that_writes_no_ids_is_not_buffered_and_its_break_is_not_continued() -> None:
    ledger = StreamLedger("chat")
    frames = [_chunk(b"a1", b"t%d" % i) for i in range(40)]
    out = b"".join(ledger.feed(frame) for frame in frames)
    assert out == b"".join(frames)  # held a step's worth at most, then passed on as they come
    assert ledger.feed(frames[0]) == frames[0]
    assert ledger.untagged  # the client has text whose ids it was never told: nothing to continue from


def test_a_continued_responses_stream_numbers_its_events_on() -> None:
    ledger = StreamLedger("responses")

    def event(kind: str, number: int, name: bytes, ids: bytes | None = None) -> bytes:
        body = (b'{"type":"%s","sequence_number":%d,"item_id":"msg_%s","response":{"id":"resp_%s","created_at":1}}'
                % (kind.encode(), number, name, name))
        frame = b"event: %s\ndata: %s\n\n" % (kind.encode(), body)
        return b": token_ids " + ids + b"\n" + frame if ids is not None else frame

    ledger.feed(event("response.created", 0, b"a1") + event("response.output_text.delta", 1, b"a1", b"5"))
    ledger.begin_replay()
    out = ledger.feed(event("response.created", 0, b"b2") + event("response.output_text.delta", 1, b"b2", b"5")
                      + event("response.output_text.delta", 2, b"b2", b"6"))
    assert out == event("response.output_text.delta", 2, b"a1")


# -- when a break is not continued ---------------------------------------------------------------------------------

def _count(metrics: Metrics, outcome: str) -> float:
    value = metrics.registry.get_sample_value("disagg_stream_migrations_total",
                                              {"pool": "gen", "worker": "http://127.0.0.1:1", "outcome": outcome})
    return value or 0.0


@pytest.mark.parametrize(("resumable", "outcome"), [(True, "over_limit"), (False, "not_resumable")])
def test_a_break_past_the_limit_or_on_a_stream_that_cannot_move_is_counted_and_not_continued(
        resumable: bool, outcome: str) -> None:
    metrics = Metrics()
    migrations = Migrations(1, cast(Any, SimpleNamespace(metrics=metrics)))
    migration = Migration(cast(Any, SimpleNamespace(endpoint="chat")), migrations, resumable)
    migration.count = 1 if resumable else 0  # moved once already (the limit); or never movable
    with idle_members(1, 1) as (worker,):
        assert asyncio.run(migration.resume(worker, "the worker is gone")) is None
    assert _count(metrics, outcome) == 1


def test_a_stream_that_broke_before_its_first_whole_frame_is_the_continuation_s_from_its_opening() -> None:
    ledger = StreamLedger("chat")
    role = b'data: {"id":"chatcmpl-b2","created":9,"choices":[{"delta":{"role":"assistant"}}]}\n\n'
    assert ledger.feed(role[:20]) == b""  # cut before the end of GEN's first frame: the client has nothing
    ledger.begin_replay()
    assert ledger.feed(role + _chunk(b"b2", b"x", b"5", 9)) == role + _chunk(b"b2", b"x", created=9)


# -- an engine that fails mid-answer, its GEN living on ----------------------------------------------------------

@pytest.mark.parametrize("endpoint", ["chat", "responses"])
def test_a_stream_whose_gen_writes_an_error_event_mid_answer_goes_on_on_another_gen(
        fresh: System, endpoint: Endpoint, caplog: pytest.LogCaptureFixture) -> None:
    """GEN's engine fails after the client has part of the answer: GEN ends its stream with its own error event (the
    frames a worker writes, sent by the proxy in place of the rest) and stays up. The orchestrator reads the event
    over HTTP, holds it back, and the stream goes on on the other GEN as if nothing had happened."""
    model = _model(fresh)
    failure = EngineError("the engine failed: RuntimeError")
    opening = 1 if endpoint == "chat" else 4  # a chat role; a Responses stream's first events

    def stream(client: openai.OpenAI) -> Iterator[Any]:
        if endpoint == "chat":
            return _chat_stream(client, model, temperature=0.0)
        return iter(client.responses.create(model=model, input=MESSAGES[0]["content"], max_output_tokens=MAX_TOKENS,
                                            temperature=0.0, stream=True, extra_body={"ignore_eos": True}))

    def text_and_ends(events: list[Any]) -> tuple[str, list[Any]]:
        if endpoint == "chat":
            texts, finishes, usage = _read_chat(iter(events))
            return "".join(texts), [finishes, usage.completion_tokens]
        ends = [e.response for e in events if e.type in ("response.completed", "response.incomplete")]
        deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
        errors = [e for e in events if e.type == "error"]  # (a chat's error event raises in the client)
        return deltas, [[e.status for e in ends], [e.usage.output_tokens for e in ends], errors]

    with fresh.client() as client:
        whole_text, whole_ends = text_and_ends(list(stream(client)))
        resumed_before = fresh.metric("disagg_stream_migrations_total", outcome="resumed")
        cut_before = sum(g.proxy.cut_answers for g in fresh.gens)
        # The frames GEN writes when its engine fails mid-stream (workers/rendering.py), numbered on for Responses.
        error = b"".join(stream_error_frames(endpoint, failure, opening + CUT_TEXT_FRAMES))
        fresh.arm_to_fail(opening + CUT_TEXT_FRAMES, error)
        with caplog.at_level(logging.WARNING, logger="disagg_serve.migration"):
            events = list(stream(client))
    text, ends = text_and_ends(events)
    assert sum(g.proxy.cut_answers for g in fresh.gens) == cut_before + 1  # one GEN failed mid-answer ...
    assert text == whole_text and ends == whole_ends  # ... and the client saw none of it
    if endpoint == "responses":
        assert [e.sequence_number for e in events] == list(range(len(events)))
    assert fresh.metric("disagg_stream_migrations_total", outcome="resumed") == resumed_before + 1
    assert all(g.process is not None and g.process.poll() is None for g in fresh.gens)  # nothing died
    # It moved for GEN's error event (which a Responses stream, ending without its completion, would not show).
    breaks = [r.getMessage() for r in caplog.records if r.name == "disagg_serve.migration"]
    assert any(f"GEN wrote an error event: {failure.message}" in line for line in breaks), breaks


class _FailingContinuation:
    """The flow's steps as a continuation sees them, the continuation failing with an error no one foresaw (a bug,
    not a ``ServingError``): at GEN, or while its hand-off is built. What CTX parked is recorded, and what is
    released."""

    def __init__(self, metrics: Metrics, fails_at: str) -> None:
        self.metrics = metrics
        self.fails_at = fails_at
        self.released: list[object] = []
        self.releaser = SimpleNamespace(release=lambda ctx, worker, headers: self.released.append(ctx))
        self.gen_pool = SimpleNamespace(workers=[])
        self.handoff = SimpleNamespace(finished=False, prompt_len=3, response={}, prompt_b64=None,
                                       handoff=None if fails_at == "handoff" else {"kv": 1})

    async def run_context_step(self, request: FlowRequest) -> object:
        request.ctx, request.ctx_worker = cast(Any, self.handoff), "http://ctx:1"
        return self.handoff

    async def call_gen(self, *args: object, **kwargs: object) -> object:
        raise RuntimeError("an unforeseen failure")


@pytest.mark.parametrize("fails_at", ["handoff", "gen"])
def test_a_continuation_failing_unforeseen_ends_the_stream_counted_and_releases_its_hand_off(fails_at: str) -> None:
    # Escaping the relay, the failure would cut the client's connection with no error event, and leave CTX's new
    # hand-off parked until it expires.
    metrics = Metrics()
    steps = _FailingContinuation(metrics, fails_at)
    migrations = Migrations(2, cast(Any, steps))
    request = FlowRequest("chat", {}, RoutingKey(), 0.0)
    migration = Migration(request, migrations)
    migration.feed(_chunk(b"a1", b"x", b"5"))
    with idle_members(1, 1) as (worker,):
        assert asyncio.run(migration.resume(worker, "the worker is gone")) is None
    assert _count(metrics, "failed") == 1
    assert steps.released == [steps.handoff]


def test_the_ids_a_long_stream_s_ledger_keeps_cost_a_few_bytes_a_token() -> None:
    # A ledger lives as long as its stream, one per stream in flight: thousands of streams of thousands of tokens.
    # Kept as one list of small bytes objects, they cost ~45 bytes a token (1.5 MB a 32k-token answer).
    ledger = StreamLedger("chat")
    ledger.feed(_chunk(b"a1", b"x", b"1"))
    pieces = [_chunk(b"a1", b"y", b"%d" % (10_000 + i)) for i in range(20_000)]
    tracemalloc.start()
    try:
        for piece in pieces:
            ledger.feed(piece)
        held, _ = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert held / len(pieces) < 12  # the id's 5 digits and a separator, and the buffer's growth room
    assert ledger.sent_token_ids() == [1, *range(10_000, 30_000)] and ledger.sent_steps() == [1] * 20_001


def test_ids_a_gen_wrote_wrong_end_the_stream_counted_rather_than_escape_the_relay() -> None:
    metrics = Metrics()
    migrations = Migrations(2, cast(Any, SimpleNamespace(metrics=metrics)))
    migration = Migration(FlowRequest("chat", {}, RoutingKey(), 0.0), migrations)
    migration.feed(_chunk(b"a1", b"x", b"5") + _chunk(b"a1", b"y", b"6;7"))
    with idle_members(1, 1) as (worker,):
        assert asyncio.run(migration.resume(worker, "the worker is gone")) is None
    assert _count(metrics, "failed") == 1


@pytest.mark.parametrize("endpoint", ["chat", "responses"])
def test_a_failure_that_would_repeat_on_any_gen_is_not_migrated(endpoint: Endpoint) -> None:
    # The engine failed on this request itself (a deterministic failure): another GEN would fail it the same way,
    # after a new prefill on CTX and the replay of the whole answer, up to the limit.
    metrics = Metrics()
    migrations = Migrations(2, cast(Any, SimpleNamespace(metrics=metrics)))  # (a continuation would fail on it)
    migration = Migration(FlowRequest(endpoint, {}, RoutingKey(), 0.0), migrations)
    error = b"".join(stream_error_frames(endpoint, EngineRequestError("the grammar rejects every token"), 1))
    assert migration.feed(_chunk(b"a1", b"x", b"5") + error) == _chunk(b"a1", b"x")
    assert migration.broken is not None and "the grammar rejects every token" in migration.broken
    with idle_members(1, 1) as (worker,):
        assert asyncio.run(migration.resume(worker, migration.broken)) is None
    assert migration.count == 0 and _count(metrics, "failed") == 0 and _count(metrics, "resumed") == 0
