"""Mock CTX and GEN workers that answer prebuilt bytes, so that a benchmark measures the orchestrator alone.

Run as ``python -m bench.mock_workers --role ctx|gen --port PORT --prompt-tokens N``. The answers are built once at
start-up; a request costs the mock one parse of its head (httptools, the C parser uvicorn uses) and one write:

- ``ctx``: every POST gets a context-only chat answer that GEN must continue (``finish_reason`` "length", a hand-off
  in ``choices[0].disaggregated_params``) with the prompt as ``prompt_token_ids_b64`` (N random int32 ids, ~5.3
  bytes of base64 per token) unless the request asked ``"return_prompt_token_ids_b64":false``;
- ``gen``: every POST gets a chunked ``text/event-stream`` of ``--tokens`` chat deltas and ``data: [DONE]``, one
  chunk per frame.

Both answer ``GET /health`` and ``GET /v1/models`` (engine facts that admit metadata-only mode: no KV block reuse,
the prompt's tokens travel with the KV), so the orchestrator's health checks find them as they find real workers.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from typing import Any

import httptools
import orjson

from bench.bodies import random_tokens
from frontend.token_codec import TOKEN_DTYPE

_NO_TOKENS_ASKED = b'"return_prompt_token_ids_b64":false'


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


def generation_frames(tokens: int) -> list[bytes]:
    """GEN's streamed answer as HTTP chunks: one SSE frame per token, then ``[DONE]``, then the last chunk."""
    frames = [b"data: " + orjson.dumps({"id": "chatcmpl-mock", "object": "chat.completion.chunk", "created": 0,
                                        "model": "mock", "choices": [{"index": 0, "delta": {"content": "tok"},
                                                                      "finish_reason": None}]}) + b"\n\n"
              for _ in range(tokens)]
    frames.append(b"data: [DONE]\n\n")
    return [f"{len(frame):x}\r\n".encode() + frame + b"\r\n" for frame in frames] + [b"0\r\n\r\n"]


class Answers:
    def __init__(self, role: str, prompt_tokens: int, tokens: int) -> None:
        self.role = role
        self.health = _response(b"200 OK", b'{"status":"ok"}')
        self.models = _response(b"200 OK", orjson.dumps({"object": "list", "data": [{
            "id": "mock", "object": "model",
            "engine_info": {"kv_block_reuse": False, "prompt_tokens_in_handoff": True}}]}))
        self.not_found = _response(b"404 Not Found", b'{"error":{"message":"not found"}}')
        if role == "ctx":
            self.with_b64 = _response(b"200 OK", context_answer(prompt_tokens, True))
            self.without_b64 = _response(b"200 OK", context_answer(prompt_tokens, False))
        else:
            self.stream_head = (b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
                                b"transfer-encoding: chunked\r\n\r\n")
            self.stream_chunks = generation_frames(tokens)


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
            transport.write(answers.health if self.url == b"/health" else
                            answers.models if self.url == b"/v1/models" else answers.not_found)
        elif answers.role == "ctx":
            transport.write(answers.without_b64 if any(_NO_TOKENS_ASKED in part for part in self.body)
                            else answers.with_b64)
        else:
            transport.write(answers.stream_head)
            for chunk in answers.stream_chunks:
                transport.write(chunk)
        self.body = []


async def serve(role: str, port: int, prompt_tokens: int, tokens: int) -> None:
    answers = Answers(role, prompt_tokens, tokens)
    loop = asyncio.get_running_loop()
    server = await loop.create_server(lambda: MockProtocol(answers), "127.0.0.1", port, backlog=1024)
    async with server:
        await server.serve_forever()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--role", choices=("ctx", "gen"), required=True)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--prompt-tokens", type=int, default=1_024)
    parser.add_argument("--tokens", type=int, default=8, help="tokens GEN streams")
    args = parser.parse_args(argv)
    import uvloop

    uvloop.run(serve(args.role, args.port, args.prompt_tokens, args.tokens))
    return 0


if __name__ == "__main__":
    sys.exit(main())
