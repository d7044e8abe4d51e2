"""The mock workers: the prebuilt answers of each P/D flavour, GEN's pacing (its schedule on a fake clock, and
the paced stream over a real socket), the POST counter a benchmark reads to see both legs called."""

from __future__ import annotations

import http.client
import socket
import time
from collections.abc import Callable, Iterator

import orjson
import pytest

from bench.driver.common import PYTHON, Processes, Server, free_port, http_get, wait_healthy
from bench.peers import mock_workers


class FakeTransport:
    def __init__(self, clock: list[float]) -> None:
        self.clock = clock
        self.writes: list[tuple[float, bytes]] = []
        self.closing = False

    def write(self, data: bytes) -> None:
        self.writes.append((self.clock[0], data))

    def is_closing(self) -> bool:
        return self.closing


class FakeLoop:
    """``call_later`` on a clock that moves only when ``run`` says so: the schedule, with no time passing."""

    def __init__(self) -> None:
        self.clock = [0.0]
        self.pending: list[tuple[float, Callable[[], None]]] = []

    def call_later(self, delay: float, callback: Callable[[], None]) -> None:
        self.pending.append((self.clock[0] + delay, callback))

    def run(self, on_each: Callable[[], None] | None = None) -> None:
        while self.pending:
            self.pending.sort(key=lambda item: item[0])
            when, callback = self.pending.pop(0)
            self.clock[0] = when
            if on_each is not None:
                on_each()
            callback()


def test_paced_writes_are_the_burst_bytes_split_per_frame() -> None:
    answers = mock_workers.Answers("gen", 0, 8, frame_gap_ms=1.0)
    assert b"".join(answers.paced_writes) == answers.stream_head + b"".join(answers.stream_chunks)
    assert len(answers.paced_writes) == 9  # head + token 1, tokens 2..8, [DONE] with the last chunk
    assert answers.paced_writes[0].startswith(answers.stream_head)
    assert answers.paced_writes[-1].endswith(b"data: [DONE]\n\n\r\n0\r\n\r\n")
    assert mock_workers.Answers("gen", 0, 0, frame_gap_ms=1.0).paced_writes == [
        answers.stream_head + b"e\r\ndata: [DONE]\n\n\r\n0\r\n\r\n"]


def test_send_paced_writes_one_frame_per_gap() -> None:
    loop = FakeLoop()
    transport = FakeTransport(loop.clock)
    writes = [b"a", b"b", b"c", b"d"]
    mock_workers.send_paced(transport, writes, 0.001, loop.call_later)  # type: ignore[arg-type]
    loop.run()
    assert [data for _, data in transport.writes] == writes
    assert [when for when, _ in transport.writes] == pytest.approx([0.0, 0.001, 0.002, 0.003])


def test_send_paced_stops_when_the_client_goes_away() -> None:
    loop = FakeLoop()
    transport = FakeTransport(loop.clock)

    def close_after_two() -> None:
        transport.closing = len(transport.writes) >= 2

    mock_workers.send_paced(transport, [b"a", b"b", b"c", b"d"], 0.001, loop.call_later)  # type: ignore[arg-type]
    loop.run(close_after_two)
    assert [data for _, data in transport.writes] == [b"a", b"b"]
    assert not loop.pending


def test_each_flavour_answers_its_gateways_prefill() -> None:
    trtllm = mock_workers.Answers("ctx", 1_000, 8)
    assert b'"prompt_token_ids_b64"' in trtllm.with_b64 and b'"disaggregated_params"' in trtllm.with_b64
    assert trtllm.with_b64 == mock_workers._response(b"200 OK", mock_workers.context_answer(1_000, True))
    vllm = mock_workers.Answers("ctx", 1_000, 8, flavour="vllm")
    body = orjson.loads(vllm.with_b64.partition(b"\r\n\r\n")[2])
    assert body["kv_transfer_params"]["do_remote_prefill"] is True and body["choices"][0]["finish_reason"] == "length"
    assert "prompt_token_ids_b64" not in body
    sglang = orjson.loads(mock_workers.Answers("ctx", 1_000, 8, flavour="sglang").with_b64.partition(b"\r\n\r\n")[2])
    assert "kv_transfer_params" not in sglang and sglang["usage"]["prompt_tokens"] == 1_000
    with pytest.raises(ValueError, match="flavour"):
        mock_workers.Answers("ctx", 1_000, 8, flavour="nope")


def _mock(processes: Processes, *args: str) -> Server:
    port = free_port()
    server = processes.spawn(f"mock-{port}", [PYTHON, "-m", "bench.peers.mock_workers", "--port", str(port), *args],
                             f"http://127.0.0.1:{port}")
    wait_healthy([server], 60)
    return server


@pytest.fixture(scope="module")
def paced_gen() -> Iterator[Server]:
    with Processes() as processes:
        yield _mock(processes, "--role", "gen", "--tokens", "8", "--frame-gap-ms", "20")


def _stream(server: Server, path: str, body: bytes) -> bytes:
    """One POST over a plain socket: the raw bytes of a chunked answer, head and chunks, to its last chunk."""
    host, port = server.url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=30) as sock:
        sock.sendall(f"POST {path} HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
                     f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
        data = b""
        while not data.endswith(b"\r\n0\r\n\r\n"):
            chunk = sock.recv(65536)
            assert chunk, f"the stream ended early: {data!r}"
            data += chunk
        return data


def _post(server: Server, path: str, body: bytes) -> tuple[int, bytes]:
    host, port = server.url.removeprefix("http://").split(":")
    connection = http.client.HTTPConnection(host, int(port), timeout=30)
    try:
        connection.request("POST", path, body, {"Content-Type": "application/json"})
        response = connection.getresponse()
        return response.status, response.read()
    finally:
        connection.close()


def test_a_paced_gen_streams_the_same_bytes_a_gap_apart(paced_gen: Server) -> None:
    chat = orjson.dumps({"model": "synthetic", "messages": [{"role": "user", "content": "hi"}], "stream": True})
    started = time.monotonic()
    answer = _stream(paced_gen, "/v1/chat/completions", chat)
    elapsed = time.monotonic() - started
    burst = mock_workers.Answers("gen", 0, 8)
    assert answer == burst.stream_head + b"".join(burst.stream_chunks)
    assert elapsed >= 8 * 0.020 * 0.75  # eight gaps of 20 ms: a lower bound, however busy the machine


def test_the_mock_counts_posts_and_answers_gateway_probes(paced_gen: Server) -> None:
    before = orjson.loads(http_get(paced_gen.url, "/mock_stats")[1])["posts"]
    status, body = _post(paced_gen, "/v1/completions", b'{"prompt":"hi","stream":true}')
    assert status == 200 and body.endswith(b"data: [DONE]\n\n")
    assert _post(paced_gen, "/v1/chat/completions/render", b"{}")[0] == 404  # vLLM's rendering: not a leg's POST
    assert _post(paced_gen, "/tokenize", b"{}")[0] == 404
    assert orjson.loads(http_get(paced_gen.url, "/mock_stats")[1])["posts"] == before + 1
    status, info = http_get(paced_gen.url, "/server_info")
    assert status == 200 and orjson.loads(info)["disaggregation_mode"] == "decode"
    assert http_get(paced_gen.url, "/version")[0] == 404  # SMG takes a worker answering /server_info only as SGLang
    assert http_get(paced_gen.url, "/loads?model=mock")[0] == 404
