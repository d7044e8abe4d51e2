from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator

import httpx
import pytest
from fastapi import FastAPI, Request
from starlette.responses import Response

from frontend.errors import (
    EngineError,
    InvalidRequestError,
    OverloadedError,
    RelayedError,
    ServingError,
    UpstreamTimeoutError,
)
from frontend.http import (
    CLIENT_CLOSED_REQUEST,
    ClientDisconnected,
    answered_status,
    cancel_on_disconnect,
    install_error_handlers,
    install_request_ids,
    invalid_request_from,
    json_response,
    parse_json_object,
    read_body,
    validate_wire,
)
from frontend.openai_models import ChatCompletionRequest, CompletionRequest
from tests.servers import running

LIMIT = 1024
RELAYED = b'{"error":{"message":"a teapot","type":"invalid_request_error","param":null,"code":"teapot"}}'


class Probe:
    def __init__(self) -> None:
        self.started = threading.Event()
        self.cancelled = threading.Event()


def make_app(probe: Probe) -> FastAPI:
    app = FastAPI()
    install_error_handlers(app)

    @app.post("/echo")
    async def echo(request: Request) -> Response:
        return json_response(parse_json_object(await read_body(request, LIMIT)))

    @app.post("/chat")
    async def chat(request: Request) -> Response:
        wire = validate_wire(ChatCompletionRequest, parse_json_object(await read_body(request, LIMIT)))
        return json_response({"model": wire.model})

    @app.get("/boom")
    async def boom() -> Response:
        raise RuntimeError("secret internals")

    @app.get("/busy")
    async def busy() -> Response:
        raise OverloadedError("busy", retry_after_s=3)

    @app.get("/relayed")
    async def relayed() -> Response:
        raise RelayedError(418, RELAYED)

    @app.post("/hang")
    async def hang(request: Request) -> Response:
        await read_body(request, LIMIT)

        async def work() -> Response:
            probe.started.set()
            try:
                await asyncio.Event().wait()
            except asyncio.CancelledError:
                probe.cancelled.set()
                raise
            return json_response({})

        return await cancel_on_disconnect(request, work)

    return app


@pytest.fixture(scope="module")
def probe() -> Probe:
    return Probe()


@pytest.fixture(scope="module")
def http(probe: Probe) -> Iterator[httpx.Client]:
    with running(make_app(probe)) as url, httpx.Client(base_url=url, timeout=10) as client:
        yield client


def test_a_json_object_round_trips(http: httpx.Client) -> None:
    reply = http.post("/echo", content=b'{"a": [1, 2, {"b": null}]}')
    assert reply.status_code == 200
    assert reply.headers["content-type"] == "application/json"
    assert reply.json() == {"a": [1, 2, {"b": None}]}


def test_a_body_exactly_at_the_limit_is_accepted(http: httpx.Client) -> None:
    body = b'{"x": "' + b"a" * (LIMIT - 9) + b'"}'
    assert len(body) == LIMIT
    assert http.post("/echo", content=body).status_code == 200


def test_a_declared_too_large_body_is_413(http: httpx.Client) -> None:
    reply = http.post("/echo", content=b'{"x": "' + b"a" * LIMIT + b'"}')
    assert reply.status_code == 413
    assert reply.json()["error"]["code"] == "payload_too_large"
    assert reply.json()["error"]["type"] == "invalid_request_error"


def test_a_chunked_too_large_body_is_413(http: httpx.Client) -> None:
    def chunks() -> Iterator[bytes]:
        yield b'{"x": "'
        for _ in range(3):
            yield b"a" * 500
        yield b'"}'

    reply = http.post("/echo", content=chunks())
    assert reply.request.headers.get("transfer-encoding") == "chunked"
    assert reply.status_code == 413


@pytest.mark.parametrize("body", [b"{", b"", b"\xff\xfe", b'{"a": 1} trailing', b"NaN"])
def test_malformed_json_is_400(http: httpx.Client, body: bytes) -> None:
    reply = http.post("/echo", content=body)
    assert reply.status_code == 400
    error = reply.json()["error"]
    assert error["type"] == "invalid_request_error"
    assert "not valid JSON" in error["message"]


@pytest.mark.parametrize("body", [b"[1, 2]", b'"text"', b"42", b"null", b"true"])
def test_json_that_is_not_an_object_is_400(http: httpx.Client, body: bytes) -> None:
    reply = http.post("/echo", content=body)
    assert reply.status_code == 400
    assert "JSON object" in reply.json()["error"]["message"]


def test_wire_validation_errors_name_the_field(http: httpx.Client) -> None:
    reply = http.post("/chat", json={"model": "m", "messages": [{"role": "user", "content": "x"}], "bogus": 1})
    assert reply.status_code == 400
    assert reply.json()["error"]["param"] == "bogus"
    assert "unrecognized request argument" in reply.json()["error"]["message"]
    ok = http.post("/chat", json={"model": "m", "messages": [{"role": "user", "content": "x"}]})
    assert ok.json() == {"model": "m"}


def test_unexpected_errors_are_a_500_in_openai_shape_without_internals(http: httpx.Client) -> None:
    reply = http.get("/boom")
    assert reply.status_code == 500
    assert reply.json() == {"error": {"message": "internal server error", "type": "server_error", "param": None,
                                      "code": None}}


def test_overloaded_carries_retry_after(http: httpx.Client) -> None:
    reply = http.get("/busy")
    assert reply.status_code == 429
    assert reply.headers["retry-after"] == "3"


def test_a_relayed_error_is_answered_with_the_workers_status_and_bytes(http: httpx.Client) -> None:
    reply = http.get("/relayed")
    assert reply.status_code == 418
    assert reply.content == RELAYED
    assert reply.headers["content-type"] == "application/json"


@pytest.mark.parametrize(
    ("exc", "status"),
    [
        (InvalidRequestError("bad"), 400),
        (OverloadedError("busy"), 429),
        (UpstreamTimeoutError("slow"), 504),
        (RelayedError(418, RELAYED), 418),
        (ServingError("ours"), 500),
        (ClientDisconnected(), CLIENT_CLOSED_REQUEST),
        (RuntimeError("unexpected"), 500),
        (asyncio.CancelledError(), 500),
    ],
)
def test_answered_status_is_what_the_handlers_answer(exc: BaseException, status: int) -> None:
    assert answered_status(exc) == status
    assert CLIENT_CLOSED_REQUEST == 499


def test_a_client_that_goes_away_cancels_the_work(http: httpx.Client, probe: Probe) -> None:
    with pytest.raises(httpx.ReadTimeout):
        http.post("/hang", content=b"{}", timeout=httpx.Timeout(10, read=0.5))
    assert probe.started.wait(10)
    assert probe.cancelled.wait(10)
    assert http.post("/echo", content=b"{}").status_code == 200


# -- pydantic errors -> param ----------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("payload", "param"),
    [
        ({"model": "m", "messages": [{"role": "user", "content": "x"}], "temperature": "hot"}, "temperature"),
        ({"model": "m", "messages": [{"role": "user", "content": "x"}], "temperature": 3}, "temperature"),
        ({"model": "m", "messages": [{"role": "wizard", "content": "x"}]}, "messages.0.role"),
        ({"model": "m", "messages": [{"role": "user", "content": 5}]}, "messages.0.content"),
        ({"model": "m", "messages": []}, "messages"),
        ({"messages": [{"role": "user", "content": "x"}]}, "model"),
        ({"model": "m", "messages": [{"role": "user", "content": "x"}], "stream": "yes"}, "stream"),
        ({"model": "m", "messages": [{"role": "user", "content": "x"}], "prompt_token_ids": [1, "2"]},
         "prompt_token_ids.1"),
    ],
)
def test_invalid_request_from_names_the_wire_field(payload: dict[str, object], param: str) -> None:
    with pytest.raises(InvalidRequestError) as caught:
        validate_wire(ChatCompletionRequest, payload)
    assert caught.value.param == param
    assert caught.value.status_code == 400


def test_union_member_tags_are_dropped_from_param() -> None:
    from pydantic import ValidationError

    try:
        CompletionRequest.model_validate({"model": "m", "prompt": {"a": 1}})
    except ValidationError as exc:
        assert invalid_request_from(exc).param == "prompt"
    else:
        pytest.fail("a dict prompt must not validate")


def test_an_unexpected_error_keeps_the_keep_alive_connection_usable(http: httpx.Client) -> None:
    for _ in range(3):
        assert http.get("/boom").status_code == 500
        assert http.post("/echo", content=b'{"still": "serving"}').json() == {"still": "serving"}


def test_every_5xx_is_logged_with_its_request_id_and_cause(caplog: pytest.LogCaptureFixture) -> None:
    app = FastAPI()
    install_error_handlers(app)
    install_request_ids(app)

    @app.get("/engine")
    async def engine() -> Response:
        raise EngineError("the engine core went away")

    @app.get("/relayed-5xx")
    async def relayed_5xx() -> Response:
        raise RelayedError(503, b'{"error":{"message":"KV store full","type":"x","param":null,"code":"c"}}')

    caplog.set_level("ERROR", logger="frontend.http")
    with running(app) as url:
        assert httpx.get(url + "/engine", headers={"X-Request-Id": "req-5xx-1"}).status_code == 500
        assert httpx.get(url + "/relayed-5xx", headers={"X-Request-Id": "req-5xx-2"}).status_code == 503
        assert httpx.get(url + "/nowhere").json()["error"]["code"] == "not_found"
    messages = [r.getMessage() for r in caplog.records]
    assert any("req-5xx-1" in m and "the engine core went away" in m for m in messages)
    assert any("req-5xx-2" in m and "KV store full" in m for m in messages)
