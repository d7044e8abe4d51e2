"""The orchestrator's Responses memory without servers: what a turn sends the workers, and when an answer is kept
(a stream's, before its final event reaches the client; a broken stream's, never)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import orjson
import pytest

from frontend.config import ResponseStoreConfig
from frontend.errors import (
    InvalidRequestError,
    RelayedError,
    ResponseNotFoundError,
    UnsupportedParameterError,
    error_body,
)
from frontend.openai_output import ResponseIdentity, StreamRenderer, Usage, render_response
from orchestrator.flow.request import Answer, StreamedAnswer, WholeAnswer
from orchestrator.response_memory import ResponseMemory

BODY: dict[str, Any] = {"model": "m", "input": "Hello"}


def answer_to(response_id: str, text: str) -> dict[str, Any]:
    return render_response(ResponseIdentity("responses", response_id, "m"), text, "stop", Usage(3, 1))


def stream_of(response_id: str, text: str) -> list[bytes]:
    renderer = StreamRenderer(ResponseIdentity("responses", response_id, "m"))
    return [*renderer.begin(), *renderer.delta(text), *renderer.finish("stop", Usage(3, 1))]


async def frames_of(chunks: list[bytes]) -> AsyncIterator[bytes]:
    for chunk in chunks:
        yield chunk


async def conversation(memory: ResponseMemory, response_id: str) -> Any:
    return orjson.loads((await memory.stored(response_id)).conversation)


async def test_a_follow_up_carries_the_whole_conversation_and_no_previous_response_id() -> None:
    memory = ResponseMemory(ResponseStoreConfig())
    await (await memory.begin(BODY)).remember(WholeAnswer(orjson.dumps(answer_to("resp_1", "Hi."))))
    turn = await memory.begin({**BODY, "input": "And then?", "previous_response_id": "resp_1", "instructions": "x"})
    assert "previous_response_id" not in turn.body and turn.body["instructions"] == "x"
    assert [(i["role"], i.get("type")) for i in turn.body["input"]] == [("user", None), ("assistant", "message"),
                                                                        ("user", None)]
    assert turn.body["input"][1]["content"][0]["text"] == "Hi."


async def test_a_streamed_answer_is_kept_before_its_final_event_reaches_the_client() -> None:
    memory = ResponseMemory(ResponseStoreConfig())
    answer = await (await memory.begin(BODY)).remember(StreamedAnswer(frames_of(stream_of("resp_s", "Yes."))))
    assert isinstance(answer, StreamedAnswer)
    kept_when_seen = []
    async for chunk in answer.frames:
        if chunk.startswith(b"event: response.completed"):
            kept_when_seen.append(await memory.store.get("resp_s") is not None)
    assert kept_when_seen == [True]
    assert (await conversation(memory, "resp_s"))[-1]["content"][0]["text"] == "Yes."


async def test_a_stream_cut_before_its_final_event_is_not_kept() -> None:
    memory = ResponseMemory(ResponseStoreConfig())
    cut = stream_of("resp_cut", "Yes.")[:-1]
    answer = await (await memory.begin(BODY)).remember(StreamedAnswer(frames_of(cut)))
    assert isinstance(answer, StreamedAnswer)
    assert len([chunk async for chunk in answer.frames]) == len(cut)
    assert await memory.store.get("resp_cut") is None


async def test_store_false_or_a_store_by_default_of_false_keeps_nothing() -> None:
    for config, body in ((ResponseStoreConfig(), {**BODY, "store": False}),
                         (ResponseStoreConfig(store_by_default=False), BODY)):
        memory = ResponseMemory(config)
        await (await memory.begin(body)).remember(WholeAnswer(orjson.dumps(answer_to("resp_1", "Hi."))))
        assert await memory.store.get("resp_1") is None


@pytest.mark.parametrize(("body", "param"), [
    ({**BODY, "store": "yes"}, "store"),
    ({**BODY, "previous_response_id": 7}, "previous_response_id"),
])
async def test_fields_of_the_wrong_type_are_a_400_naming_them(body: dict[str, Any], param: str) -> None:
    with pytest.raises(InvalidRequestError) as caught:
        await ResponseMemory(ResponseStoreConfig()).begin(body)
    assert caught.value.param == param


async def test_a_follow_up_whose_input_is_neither_text_nor_items_is_a_400() -> None:
    memory = ResponseMemory(ResponseStoreConfig())
    await (await memory.begin(BODY)).remember(WholeAnswer(orjson.dumps(answer_to("resp_1", "Hi."))))
    with pytest.raises(InvalidRequestError) as caught:
        await memory.begin({**BODY, "input": 5, "previous_response_id": "resp_1"})
    assert caught.value.param == "input"


async def test_an_unknown_id_is_a_404_naming_previous_response_id() -> None:
    with pytest.raises(ResponseNotFoundError) as caught:
        await ResponseMemory(ResponseStoreConfig()).begin({**BODY, "previous_response_id": "resp_x"})
    assert (caught.value.status_code, caught.value.code, caught.value.param) == (
        404, "previous_response_not_found", "previous_response_id")


async def test_with_the_store_off_what_needs_it_is_refused_and_the_rest_served() -> None:
    memory = ResponseMemory(ResponseStoreConfig(max_entries=0))
    assert (await memory.begin(BODY)).store is None
    for body, param in (({**BODY, "store": True}, "store"), ({**BODY, "previous_response_id": "r"},
                                                             "previous_response_id")):
        with pytest.raises(UnsupportedParameterError) as caught:
            await memory.begin(body)
        assert caught.value.param == param


def worker_refusal(param: str | None) -> RelayedError:
    return RelayedError(400, error_body(InvalidRequestError(f"{param}: bad", param=param)))


@pytest.mark.parametrize(("worker_param", "client_param"), [
    ("input.3.content", "input.1.content"),  # the client's second item, after two stored ones
    ("input.2", "input.0"),
    ("input.1.content", "input.1.content"),  # a stored item: left as the worker said
    ("max_output_tokens", "max_output_tokens"),
    (None, None),
])
async def test_a_workers_error_about_an_item_names_it_as_the_client_counted_it(
    worker_param: str | None, client_param: str | None
) -> None:
    memory = ResponseMemory(ResponseStoreConfig())
    await (await memory.begin(BODY)).remember(WholeAnswer(orjson.dumps(answer_to("resp_1", "Hi."))))
    turn = await memory.begin({**BODY, "input": [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}],
                         "previous_response_id": "resp_1"})

    async def refused() -> Answer:
        raise worker_refusal(worker_param)

    with pytest.raises(RelayedError) as caught:
        await turn.answer(refused)
    error = orjson.loads(caught.value.content)["error"]
    assert (caught.value.status_code, error["param"]) == (400, client_param)
    assert error["message"] == f"{client_param}: bad"


async def test_every_turn_of_a_conversation_is_keyed_by_its_first_response() -> None:
    """The routing key of a Responses conversation (orchestrator/routers.py): the same for all its turns."""
    memory = ResponseMemory(ResponseStoreConfig())
    first = await memory.begin(BODY)
    assert first.session is None
    await first.remember(WholeAnswer(orjson.dumps(answer_to("resp_1", "Hi."))))
    second = await memory.begin({**BODY, "input": "And then?", "previous_response_id": "resp_1"})
    assert second.session == "resp_1"
    await second.remember(WholeAnswer(orjson.dumps(answer_to("resp_2", "Then this."))))
    third = await memory.begin({**BODY, "input": "And after?", "previous_response_id": "resp_2"})
    assert third.session == "resp_1"
