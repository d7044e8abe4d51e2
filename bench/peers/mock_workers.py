"""Mock CTX and GEN workers that answer prebuilt bytes, so that a benchmark measures the proxy in front of them alone.

``python -m bench.peers.mock_workers --role ctx|gen --port PORT --prompt-tokens N``. A request costs the mock one
parse of its head (httptools) and one write. CTX answers in the P/D wire of ``--flavour`` (``trtllm``, our
orchestrator's; ``vllm`` and ``sglang``, the Rust gateways'); GEN streams ``--tokens`` chat deltas, paced
``--frame-gap-ms`` apart as a decode loop sends them. Both answer the GETs that health checks and the gateways'
registration probe, and ``GET /mock_stats`` counts the POSTs, so a benchmark sees that both legs were called.
"""

from __future__ import annotations

import asyncio
import sys
from collections.abc import Callable
from typing import Any

import httptools
import orjson

from bench.driver.bodies import random_tokens
from bench.driver.common import arguments
from frontend.token_codec import TOKEN_DTYPE

_NO_TOKENS_ASKED = b'"return_prompt_token_ids_b64":false'
FLAVOURS = ("trtllm", "vllm", "sglang")
_NOT_SERVED = (b"/render", b"/tokenize", b"/detokenize")  # POSTs a gateway may try that a leg does not answer
MODEL = "mock"


def _response(status: bytes, body: bytes, content_type: bytes = b"application/json") -> bytes:
    return (b"HTTP/1.1 " + status + b"\r\ncontent-type: " + content_type + b"\r\ncontent-length: "
            + str(len(body)).encode() + b"\r\n\r\n" + body)


def context_answer(prompt_tokens: int, with_b64: bool) -> bytes:
    """CTX's whole answer: the first token, the hand-off, and (when asked) the prompt as base64 int32."""
    import pybase64

    answer: dict[str, Any] = {
        "id": "chatcmpl-mock", "object": "chat.completion", "created": 0, "model": "mock",
        "choices": [{
            "index": 0, "message": {"role": "assistant", "content": "T"}, "finish_reason": "length",
            "disaggregated_params": {
                "request_type": "context_only", "ctx_request_id": 1, "disagg_request_id": 1,
                "first_gen_tokens": [84], "first_gen_log_probs": None, "encoded_opaque_state": "bW9jayBzdGF0ZQ==",
                "draft_tokens": None, "prompt_len": prompt_tokens,
            },
        }],
        "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": 1, "total_tokens": prompt_tokens + 1},
    }
    if with_b64:
        tokens = random_tokens(prompt_tokens).astype(TOKEN_DTYPE).tobytes()
        answer["prompt_token_ids_b64"] = pybase64.b64encode(tokens).decode("ascii")
    return orjson.dumps(answer)


def vllm_prefill_answer(prompt_tokens: int) -> bytes:
    """A vLLM prefill's answer to a P/D router: one token, and the ``kv_transfer_params`` that tell decode where to
    pull the KV from (the NIXL connector's fields)."""
    return orjson.dumps({
        "id": "cmpl-mock", "object": "chat.completion", "created": 0, "model": MODEL,
        "choices": [{"index": 0, "message": {"role": "assistant", "content": "T"}, "text": "T",
                     "finish_reason": "length"}],
        "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": 1, "total_tokens": prompt_tokens + 1},
        "kv_transfer_params": {"do_remote_prefill": True, "do_remote_decode": False,
                               "remote_engine_id": "mock-engine", "remote_block_ids": [0],
                               "remote_host": "127.0.0.1", "remote_port": 5600, "tp_size": 1},
    })


def sglang_prefill_answer(prompt_tokens: int) -> bytes:
    """An SGLang prefill's answer in P/D mode: one token (the KV goes to decode through the bootstrap room)."""
    return orjson.dumps({
        "id": "chatcmpl-mock", "object": "chat.completion", "created": 0, "model": MODEL,
        "choices": [{"index": 0, "message": {"role": "assistant", "content": "T"}, "text": "T",
                     "finish_reason": "length"}],
        "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": 1, "total_tokens": prompt_tokens + 1},
    })


def server_info(role: str) -> bytes:
    """What SGLang's ``/server_info`` says, as far as a gateway reads it at registration."""
    return orjson.dumps({"model_path": MODEL, "served_model_name": MODEL, "tokenizer_path": None,
                         "disaggregation_mode": "prefill" if role == "ctx" else "decode", "tp_size": 1,
                         "dp_size": 1, "is_embedding": False, "version": "0.0.0-mock"})


def generation_frames(tokens: int) -> list[bytes]:
    """GEN's streamed answer as HTTP chunks: one SSE frame per token, then ``[DONE]``, then the last chunk."""
    frames = [b"data: " + orjson.dumps({"id": "chatcmpl-mock", "object": "chat.completion.chunk", "created": 0,
                                        "model": "mock", "choices": [{"index": 0, "delta": {"content": "tok"},
                                                                      "finish_reason": None}]}) + b"\n\n"
              for _ in range(tokens)]
    frames.append(b"data: [DONE]\n\n")
    return [f"{len(frame):x}\r\n".encode() + frame + b"\r\n" for frame in frames] + [b"0\r\n\r\n"]


class Answers:
    def __init__(self, role: str, prompt_tokens: int, tokens: int, flavour: str = "trtllm",
                 frame_gap_ms: float = 0.0) -> None:
        if flavour not in FLAVOURS:
            raise ValueError(f"unknown flavour {flavour!r}")
        self.role = role
        self.flavour = flavour
        self.frame_gap_s = max(0.0, frame_gap_ms) / 1e3
        self.posts = 0
        self.health = _response(b"200 OK", b'{"status":"ok"}')
        self.models = _response(b"200 OK", orjson.dumps({"object": "list", "data": [{
            "id": MODEL, "object": "model",
            "engine_info": {"kv_block_reuse": False, "prompt_tokens_in_handoff": True}}]}))
        self.not_found = _response(b"404 Not Found", b'{"error":{"message":"not found"}}')
        info = _response(b"200 OK", server_info(role))
        model_info = _response(b"200 OK", orjson.dumps({"model_path": MODEL, "tokenizer_path": None,
                                                        "is_generation": True}))
        self.gets = {b"/health": self.health, b"/v1/models": self.models, b"/server_info": info,
                     b"/get_server_info": info, b"/model_info": model_info, b"/get_model_info": model_info}
        if role == "ctx":
            if flavour == "trtllm":
                self.with_b64 = _response(b"200 OK", context_answer(prompt_tokens, True))
                self.without_b64 = _response(b"200 OK", context_answer(prompt_tokens, False))
            else:
                answer = vllm_prefill_answer if flavour == "vllm" else sglang_prefill_answer
                self.with_b64 = self.without_b64 = _response(b"200 OK", answer(prompt_tokens))
        else:
            self.stream_head = (b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
                                b"transfer-encoding: chunked\r\n\r\n")
            self.stream_chunks = generation_frames(tokens)
            # Paced: the head with the first frame, each next frame on its own, the last chunk with [DONE].
            *frames, last = self.stream_chunks
            self.paced_writes = [self.stream_head + frames[0], *frames[1:]]
            self.paced_writes[-1] += last

    def stats(self) -> bytes:
        return _response(b"200 OK", orjson.dumps({"posts": self.posts}))


def send_paced(transport: asyncio.WriteTransport, writes: list[bytes], gap_s: float,
               call_later: Callable[[float, Callable[[], None]], object]) -> None:
    """Write ``writes[0]`` now and each next one ``gap_s`` after the one before; stop if the client goes away."""
    index = 0

    def step() -> None:
        nonlocal index
        if transport.is_closing():
            return
        transport.write(writes[index])
        index += 1
        if index < len(writes):
            call_later(gap_s, step)

    step()


class MockProtocol(asyncio.Protocol):
    def __init__(self, answers: Answers) -> None:
        self.answers = answers
        self.parser = httptools.HttpRequestParser(self)
        self.transport: asyncio.Transport | None = None
        self.url = b""
        self.body: list[bytes] = []

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]  # a stream transport (uvloop's is no subclass)

    def data_received(self, data: bytes) -> None:
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError:
            if self.transport is not None:
                self.transport.close()

    # httptools callbacks
    def on_message_begin(self) -> None:
        self.url, self.body = b"", []

    def on_url(self, url: bytes) -> None:
        self.url += url

    def on_body(self, body: bytes) -> None:
        self.body.append(body)

    def on_message_complete(self) -> None:
        transport, answers = self.transport, self.answers
        if transport is None or transport.is_closing():
            return
        method = self.parser.get_method()
        if method == b"GET":
            path = self.url.partition(b"?")[0]
            transport.write(answers.stats() if path == b"/mock_stats" else answers.gets.get(path, answers.not_found))
            self.body = []
            return
        if self.url.endswith(_NOT_SERVED):  # vLLM's prompt rendering (its router's cache_aware asks): not served
            transport.write(answers.not_found)
            self.body = []
            return
        answers.posts += 1
        if answers.role == "ctx":
            transport.write(answers.without_b64 if answers.flavour == "trtllm" and any(
                _NO_TOKENS_ASKED in part for part in self.body) else answers.with_b64)
        elif answers.frame_gap_s > 0:
            send_paced(transport, answers.paced_writes, answers.frame_gap_s, asyncio.get_running_loop().call_later)
        else:
            transport.write(answers.stream_head)
            for chunk in answers.stream_chunks:
                transport.write(chunk)
        self.body = []


async def serve(role: str, port: int, prompt_tokens: int, tokens: int, flavour: str = "trtllm",
                frame_gap_ms: float = 0.0) -> None:
    answers = Answers(role, prompt_tokens, tokens, flavour, frame_gap_ms)
    loop = asyncio.get_running_loop()
    server = await loop.create_server(lambda: MockProtocol(answers), "127.0.0.1", port, backlog=1024)
    async with server:
        await server.serve_forever()


def main(argv: list[str] | None = None) -> int:
    parser = arguments(__doc__)
    parser.add_argument("--role", choices=("ctx", "gen"), required=True)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--prompt-tokens", type=int, default=1_024)
    parser.add_argument("--tokens", type=int, default=8, help="tokens GEN streams")
    parser.add_argument("--flavour", choices=FLAVOURS, default="trtllm",
                        help="the P/D wire CTX answers in: trtllm (our orchestrator's), vllm (vLLM's router), "
                             "sglang (SGLang's Model Gateway)")
    parser.add_argument("--frame-gap-ms", type=float, default=0.0,
                        help="GEN: milliseconds between streamed frames (0: the whole stream in one burst)")
    args = parser.parse_args(argv)
    import uvloop

    uvloop.run(serve(args.role, args.port, args.prompt_tokens, args.tokens, args.flavour, args.frame_gap_ms))
    return 0


if __name__ == "__main__":
    sys.exit(main())
