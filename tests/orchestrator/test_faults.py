"""Faults between the orchestrator and its workers: dead CTX workers, GEN workers that refuse or die mid-stream,
and workers that come back. Every worker is a real server on loopback: synthetic-engine workers, or (to fail at
an exact point) a small real ASGI app that speaks just enough of the worker protocol.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import threading
from collections.abc import AsyncIterator, Iterator
from typing import Any

import httpx
import openai
import orjson
import pytest
from fastapi import FastAPI
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from entrypoints.launcher import free_port
from tests.cluster import MODEL, Node, Recorder, RecordingEngine, sample, start_orchestrator, start_worker
from tests.servers import ServerThread, running
from tests.waiting import eventually
from workers.engines.synthetic import SYNTHETIC_TEXT
from workers.server import create_worker_app
from workers.settings import Role, WorkerSettings

MESSAGES: Any = [{"role": "user", "content": "hello"}]


def synthetic_text(n: int) -> str:
    return bytes(SYNTHETIC_TEXT[i % len(SYNTHETIC_TEXT)] for i in range(n)).decode()


def closed_port_url() -> str:
    """A loopback URL where nothing listens (bound then closed, so the port is free but unused)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{sock.getsockname()[1]}"


def chat(url: str, n: int = 4, stream: bool = False) -> str:
    with openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=30) as client:
        if not stream:
            reply = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=n)
            return reply.choices[0].message.content or ""
        return "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(
            model=MODEL, messages=MESSAGES, max_tokens=n, stream=True) if c.choices)


def worker_thread(role: Role, port: int = 0) -> tuple[ServerThread, Recorder, str]:
    recorder = Recorder(create_worker_app(RecordingEngine(), WorkerSettings(role=role)))
    server = ServerThread(recorder, port=port)
    return server, recorder, server.start()


# -- small real ASGI apps that fail at an exact point ------------------------------------------------------------
async def _health(_: Request) -> Response:
    return JSONResponse({"status": "ok", "role": "generation", "inflight": 0})


async def _models(_: Request) -> Response:
    return JSONResponse({"object": "list", "data": [{"id": MODEL, "object": "model", "engine_info": {
        "engine": "fake", "role": "generation", "vocab_size": 50_000, "kv_block_reuse": False,
        "prompt_tokens_in_handoff": False}}]})


def refusing_gen() -> FastAPI:
    """Healthy to health checks; every generation request is refused with a 503 before any byte of output."""
    async def refuse(_: Request) -> Response:
        return JSONResponse({"error": {"message": "overloaded, try another", "type": "service_unavailable",
                                       "param": None, "code": None}}, status_code=503)

    return FastAPI(routes=[Route("/health", _health), Route("/v1/models", _models),
                           Route("/v1/chat/completions", refuse, methods=["POST"]),
                           Route("/v1/completions", refuse, methods=["POST"])])


def chunk(text: str) -> bytes:
    payload = {"id": "chatcmpl-fake", "object": "chat.completion.chunk", "created": 0, "model": MODEL,
               "choices": [{"index": 0, "delta": {"content": text}, "logprobs": None, "finish_reason": None}]}
    return b"data: " + orjson.dumps(payload) + b"\n\n"


def dying_gen(how: str) -> FastAPI:
    """Streams two chunks, then the process "dies": the connection breaks (raise) or just ends without [DONE]."""
    async def stream(_: Request) -> Response:
        async def frames() -> AsyncIterator[bytes]:
            yield chunk("Th")
            await asyncio.sleep(0.05)
            yield chunk("e ")
            await asyncio.sleep(0.05)
            if how == "breaks":
                raise RuntimeError("the GEN process died")

        return StreamingResponse(frames(), media_type="text/event-stream")

    return FastAPI(routes=[Route("/health", _health), Route("/v1/models", _models),
                           Route("/v1/chat/completions", stream, methods=["POST"])])


# -- CTX down ----------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def live() -> Iterator[tuple[Node, Node]]:
    with contextlib.ExitStack() as stack:
        yield start_worker(stack, "context"), start_worker(stack, "generation")


def test_a_ctx_at_a_closed_port_is_routed_around(live: tuple[Node, Node]) -> None:
    ctx, gen = live
    dead = closed_port_url()
    with contextlib.ExitStack() as stack:
        orch = start_orchestrator(stack, [dead, ctx.url], [gen.url], max_retries=1)
        for i in range(6):
            assert chat(orch.url, 5, stream=i % 2 == 1) == synthetic_text(5)
        health = httpx.get(orch.url + "/health", timeout=10)
        assert health.status_code == 200
        assert health.json()["context_servers"] == {dead: False, ctx.url: True}


def test_a_ctx_that_dies_after_joining_is_retried_on_the_live_one(live: tuple[Node, Node]) -> None:
    ctx, gen = live
    doomed, doomed_recorder, doomed_url = worker_thread("context")
    try:
        with contextlib.ExitStack() as stack:
            # Active checks far apart: the orchestrator still believes the dead CTX is healthy when it is asked.
            # Round robin, so the first request goes to the dead CTX whatever the ports are (cache_aware places
            # one conversation by a rendezvous hash of the ports, which could leave the dead CTX never asked).
            orch = start_orchestrator(stack, [doomed_url, ctx.url], [gen.url], max_retries=1,
                                      health_check_interval_s=3600,
                                      context_servers={"urls": [doomed_url, ctx.url],
                                                       "router": {"type": "round_robin"}})
            doomed.stop()
            texts = [chat(orch.url, 5, stream=i % 2 == 1) for i in range(4)]
            assert texts == [synthetic_text(5)] * 4
            assert sample(orch.metrics, "disagg_upstream_retries_total", step="ctx",
                          reason="UpstreamUnavailableError") == 1
            assert sample(orch.metrics, "disagg_upstream_failovers_total", step="ctx") == 1
            assert [w.healthy for w in orch.app.state.pools["context"].workers] == [False, True]  # passive health
            assert doomed_recorder.posts("/v1/chat/completions") == []
    finally:
        doomed.stop()


@pytest.mark.parametrize("max_retries", [0, 1])
@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_all_ctx_down_is_503_naming_the_ctx_step(live: tuple[Node, Node], max_retries: int, stream: bool) -> None:
    _, gen = live
    doomed, _, doomed_url = worker_thread("context")
    try:
        with contextlib.ExitStack() as stack:
            orch = start_orchestrator(stack, [doomed_url, closed_port_url()], [gen.url], max_retries=max_retries,
                                      health_check_interval_s=3600)
            doomed.stop()
            gen_before = len(gen.recorder.posts())
            body = {"model": MODEL, "messages": MESSAGES, "max_tokens": 3, "stream": stream}
            for _ in range(2):  # the first finds the dead worker, the second finds none healthy at all
                reply = httpx.post(orch.url + "/v1/chat/completions", json=body, timeout=30)
                assert reply.status_code == 503
                assert reply.headers["content-type"] == "application/json"
                error = reply.json()["error"]
                assert set(error) == {"message", "type", "param", "code"}
                assert error["type"] == "service_unavailable"
                assert error["code"] == "upstream_unavailable"
                assert "ctx" in error["message"].lower(), error["message"]
            assert len(gen.recorder.posts()) == gen_before  # GEN was never asked
            assert httpx.get(orch.url + "/health", timeout=10).status_code == 503
            assert sample(orch.metrics, "disagg_requests_total", role="orchestrator", endpoint="chat",
                          status="503") == 2
            assert eventually(lambda: sample(orch.metrics, "disagg_engine_inflight_requests",
                                             role="orchestrator") == 0)
    finally:
        doomed.stop()


# -- GEN fails before its first byte ---------------------------------------------------------------------------------
def test_a_gen_refusing_before_the_first_byte_is_retried_on_another(live: tuple[Node, Node]) -> None:
    ctx, gen = live
    refusing = Recorder(refusing_gen())
    with contextlib.ExitStack() as stack:
        refusing_url = stack.enter_context(running(refusing))
        orch = start_orchestrator(stack, [ctx.url], [refusing_url, gen.url], max_retries=1)
        assert all(w.healthy for w in orch.app.state.pools["generation"].workers)
        texts = [chat(orch.url, 6, stream=i % 2 == 1) for i in range(6)]
        assert texts == [synthetic_text(6)] * 6
        refused = len(refusing.posts("/v1/chat/completions"))
        assert refused >= 3  # round robin tried it about every other request
        assert sample(orch.metrics, "disagg_upstream_retries_total", step="gen", reason="status_5xx") == refused
        # A stream is counted when its last frame has been written, which may be just after the client read it.
        assert eventually(lambda: sample(orch.metrics, "disagg_requests_total", role="orchestrator", endpoint="chat",
                                         status="200") == 6)


def test_when_every_gen_refuses_the_client_gets_the_503_and_ctx_is_not_blamed(live: tuple[Node, Node]) -> None:
    ctx, _ = live
    with contextlib.ExitStack() as stack:
        urls = [stack.enter_context(running(refusing_gen())) for _ in range(2)]
        orch = start_orchestrator(stack, [ctx.url], urls, max_retries=1)
        for stream in (False, True):
            reply = httpx.post(orch.url + "/v1/chat/completions",
                               json={"model": MODEL, "messages": MESSAGES, "max_tokens": 3, "stream": stream},
                               timeout=30)
            assert reply.status_code == 503
            assert set(reply.json()["error"]) == {"message", "type", "param", "code"}
        assert chat(ctx.url.replace("/v1", ""), 1) == "T"  # CTX itself is fine


# -- GEN dies mid-stream -----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("how", ["breaks", "ends-early"])
def test_a_gen_dying_mid_stream_ends_the_clients_stream_with_an_error_then_done(
    live: tuple[Node, Node], how: str
) -> None:
    ctx, _ = live
    with contextlib.ExitStack() as stack:
        dying_url = stack.enter_context(running(dying_gen(how)))
        orch = start_orchestrator(stack, [ctx.url], [dying_url])
        body = {"model": MODEL, "messages": MESSAGES, "max_tokens": 50, "stream": True}
        with httpx.Client(timeout=30) as http, http.stream("POST", orch.url + "/v1/chat/completions",
                                                          json=body) as response:
            assert response.status_code == 200
            raw = response.read()  # the relay closes the stream cleanly: no protocol error reaches the client
        frames = raw.split(b"\n\n")
        assert frames[:2] == [chunk("Th").rstrip(b"\n"), chunk("e ").rstrip(b"\n")]
        assert frames[-2:] == [b"data: [DONE]", b""]
        error = orjson.loads(frames[-3].removeprefix(b"data: "))["error"]
        assert set(error) == {"message", "type", "param", "code"}
        assert error["code"] == "upstream_error"
        assert "GEN" in error["message"]
        assert len(frames) == 5
        # The official client surfaces it as an error, after the text that did arrive.
        received: list[str] = []
        with openai.OpenAI(base_url=orch.url + "/v1", api_key="x", max_retries=0, timeout=30) as client, \
                pytest.raises(openai.APIError) as caught:
            for piece in client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=50,
                                                        stream=True):
                received.append(piece.choices[0].delta.content or "")
        assert "".join(received) == "The "
        assert "GEN" in str(caught.value)
        assert eventually(lambda: sample(orch.metrics, "disagg_engine_inflight_requests", role="orchestrator") == 0)
        assert sample(orch.metrics, "disagg_requests_total", role="orchestrator", endpoint="chat", status="200") == 2


# -- a worker that comes back ----------------------------------------------------------------------------------------
def test_a_gen_that_comes_back_on_the_same_port_is_used_again(live: tuple[Node, Node]) -> None:
    ctx, gen = live
    port = free_port()
    first, first_recorder, url = worker_thread("generation", port)
    second: ServerThread | None = None
    try:
        with contextlib.ExitStack() as stack:
            orch = start_orchestrator(stack, [ctx.url], [url, gen.url], health_check_interval_s=0.1,
                                      health_failure_threshold=2, health_recovery_threshold=1)
            pool = orch.app.state.pools["generation"]
            for _ in range(4):
                assert chat(orch.url) == synthetic_text(4)
            assert len(first_recorder.posts("/v1/chat/completions")) == 2
            first.stop()
            assert eventually(lambda: not pool.workers[0].healthy)
            for i in range(4):
                assert chat(orch.url, stream=i % 2 == 1) == synthetic_text(4)
            second, second_recorder, again = worker_thread("generation", port)
            assert again == url
            assert eventually(lambda: pool.workers[0].healthy)
            for _ in range(4):
                assert chat(orch.url) == synthetic_text(4)
            assert len(second_recorder.posts("/v1/chat/completions")) == 2  # back in the round robin
            assert httpx.get(orch.url + "/health", timeout=10).json()["generation_servers"] == {url: True,
                                                                                               gen.url: True}
    finally:
        first.stop()
        if second is not None:
            second.stop()


# -- a keep-alive connection the worker closes just as it is reused ----------------------------------------------------
class ReuseClosingProxy:
    """A real TCP proxy in front of a worker that hangs up when a POST arrives on a connection that has already
    carried an answer: what a server does when it closes an idle keep-alive connection at the moment the client
    reuses it (uvicorn closes idle connections after 5 s; httpx keeps them for 5 s: the two race)."""

    def __init__(self, upstream_url: str) -> None:
        self.upstream_port = int(upstream_url.rsplit(":", 1)[1])
        self.hung_up = 0
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.server: asyncio.Server | None = None

    async def _pipe(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, answered: asyncio.Event,
                    upstream: asyncio.StreamWriter | None) -> None:
        try:
            while data := await reader.read(65536):
                if upstream is None:  # worker -> client
                    answered.set()
                elif answered.is_set() and data.startswith(b"POST"):
                    self.hung_up += 1
                    break
                writer.write(data)
                await writer.drain()
        except ConnectionError:
            pass
        finally:
            writer.close()

    async def _handle(self, client_r: asyncio.StreamReader, client_w: asyncio.StreamWriter) -> None:
        up_r, up_w = await asyncio.open_connection("127.0.0.1", self.upstream_port)
        answered = asyncio.Event()
        await asyncio.gather(self._pipe(client_r, up_w, answered, up_w), self._pipe(up_r, client_w, answered, None),
                             return_exceptions=True)
        client_w.close()
        up_w.close()

    def __enter__(self) -> ReuseClosingProxy:
        self.thread.start()

        async def start() -> asyncio.Server:
            return await asyncio.start_server(self._handle, "127.0.0.1", 0)

        self.server = asyncio.run_coroutine_threadsafe(start(), self.loop).result(timeout=10)
        self.url = f"http://127.0.0.1:{self.server.sockets[0].getsockname()[1]}"
        return self

    def __exit__(self, *_: object) -> None:
        async def stop() -> None:
            assert self.server is not None
            self.server.close()
            for task in asyncio.all_tasks():
                if task is not asyncio.current_task():
                    task.cancel()

        asyncio.run_coroutine_threadsafe(stop(), self.loop).result(timeout=10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=10)
        self.loop.close()


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
@pytest.mark.parametrize("step", ["ctx", "gen"])
def test_a_request_met_by_a_close_on_a_kept_connection_is_not_sent_again(
    live: tuple[Node, Node], step: str, stream: bool
) -> None:
    """The proxy hangs up on a POST written on a kept connection: to the client this is the idle-timeout race, and
    equally a worker that took the request and died. It may have run, so it is not sent again on that worker: the
    request fails with a 502 (with another worker, the retry policy would move it there), the worker stays in
    routing, and the next request, on a fresh connection, is served."""
    ctx, gen = live
    with ReuseClosingProxy(ctx.url if step == "ctx" else gen.url) as proxy, contextlib.ExitStack() as stack:
        ctx_urls, gen_urls = ([proxy.url], [gen.url]) if step == "ctx" else ([ctx.url], [proxy.url])
        orch = start_orchestrator(stack, ctx_urls, gen_urls, max_retries=1, health_check_interval_s=3600)
        pool = orch.app.state.pools["context" if step == "ctx" else "generation"]
        texts, statuses = [], []
        for _ in range(3):
            try:
                texts.append(chat(orch.url, 5, stream=stream))
            except openai.APIStatusError as exc:
                statuses.append(exc.status_code)
        assert proxy.hung_up >= 1  # the race really happened
        assert statuses == [502] * proxy.hung_up  # each hang-up failed its request, once: nothing sent twice
        assert texts == [synthetic_text(5)] * (3 - proxy.hung_up)
        assert texts  # the connection after a hang-up is a fresh one, and serves
        assert pool.workers[0].healthy


# -- a lost hand-off: CTX runs again, once; a second loss is a 502 -----------------------------------------------------
def handoff_gone_gen() -> FastAPI:
    """Answers every generation request as a GEN whose hand-off was already taken by an earlier, failed GEN."""
    async def gone(_: Request) -> Response:
        return JSONResponse({"error": {"message": "no KV hand-off: already taken", "type": "invalid_request_error",
                                       "param": "disaggregated_params.encoded_opaque_state",
                                       "code": "invalid_handoff"}}, status_code=400)

    return FastAPI(routes=[Route("/health", _health), Route("/v1/models", _models),
                           Route("/v1/chat/completions", gone, methods=["POST"])])


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_a_lost_handoff_reruns_ctx_once_and_then_answers_502(live: tuple[Node, Node], stream: bool) -> None:
    ctx, _ = live
    with running(refusing_gen()) as refusing, running(handoff_gone_gen()) as gone, contextlib.ExitStack() as stack:
        # The 503 GEN is tried first and the hand-off-gone GEN second (round robin), every round.
        orch = start_orchestrator(stack, [ctx.url], [refusing, gone], max_retries=1)
        before = len(ctx.recorder.posts("/v1/chat/completions"))
        body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "stream": stream}
        reply = httpx.post(orch.url + "/v1/chat/completions", json=body, timeout=30)
        # Lost twice with failing GEN workers: a fault of the fleet, never the client's 400.
        assert reply.status_code == 502
        assert reply.json()["error"]["code"] == "upstream_error"
        assert "lost twice" in reply.json()["error"]["message"]
        ctx_steps = ctx.recorder.posts("/v1/chat/completions")[before:]
        assert len(ctx_steps) == 2  # the first CTX step and exactly one re-run
        assert sample(orch.metrics, "disagg_upstream_retries_total", step="ctx", reason="handoff_lost") == 1
        # The hand-off released is the second CTX's: the first one was already gone.
        latest = ctx_steps[-1].response_json()["choices"][0]["disaggregated_params"]["ctx_request_id"]
        assert eventually(lambda: any(e.request_json()["ctx_request_id"] == latest
                                      for e in ctx.recorder.posts("/v1/disagg/release") if e.request_body))
