"""Item 6: multi-turn with the Responses API through the orchestrator, whole and streamed, with the official SDK:
the server's own output items replayed as input, ``previous_response_id`` from the bounded store (404 in OpenAI's
shape when unknown, evicted, expired or never stored), and ``GET`` / ``DELETE /v1/responses/{id}``. Every case of the
store runs on both stores: this process's memory and a real Redis."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import openai
import pytest
from openai.types.responses import Response

from frontend.config import ResponseStoreConfig, parse_config
from frontend.metrics import Metrics
from orchestrator.response_store import MemoryResponseStore, ResponseStore
from orchestrator.response_store_redis import RedisResponseStore
from orchestrator.server import create_orchestrator_app
from tests.cluster import sample
from tests.orchestrator.test_response_store import FakeClock
from tests.servers import running
from tests.workers.engines.reference.cluster import RefCluster

GREEDY: dict[str, Any] = {"model": "tiny", "temperature": 0, "max_output_tokens": 4}


def ask(client: openai.OpenAI, stream: bool, **request: Any) -> Response:
    """The whole response, read from the answer or from the stream's final event."""
    if not stream:
        whole: Response = client.responses.create(**{**GREEDY, **request})
        return whole
    events = list(client.responses.create(**{**GREEDY, **request}, stream=True))
    final = events[-1]
    assert final.type in ("response.completed", "response.incomplete")
    streamed: Response = final.response
    return streamed


def dumped(response: Response) -> list[dict[str, Any]]:
    return [item.model_dump() for item in response.output]


@contextlib.contextmanager
def orchestrator(cluster: RefCluster, store: ResponseStore | None = None, metrics: Metrics | None = None,
                 **limits: Any) -> Iterator[openai.OpenAI]:
    """An orchestrator of its own in front of the suite's CTX and GEN workers, with these store settings."""
    config = parse_config({"context_servers": {"urls": [cluster.ctx.url]},
                           "generation_servers": {"urls": [cluster.gen.url]}, "response_store": limits})
    with running(create_orchestrator_app(config, metrics, response_store=store)) as url:
        yield openai.OpenAI(base_url=url + "/v1", api_key="test", max_retries=0, timeout=120)


@pytest.fixture(params=["memory", "redis"])
def backend(request: pytest.FixtureRequest) -> dict[str, Any]:
    """The store's settings: this process's memory, or the session's Redis (emptied for the test)."""
    if request.param == "memory":
        return {}
    return {"backend": "redis", "url": request.getfixturevalue("redis_url")}


@pytest.fixture
def client(conformance_cluster: RefCluster, backend: dict[str, Any]) -> Iterator[openai.OpenAI]:
    """A client of an orchestrator on each store with its default limits (the suite's own, for memory)."""
    if not backend:
        with conformance_cluster.orchestrator.client() as client:
            yield client
        return
    with orchestrator(conformance_cluster, **backend) as client:
        yield client


@pytest.mark.parametrize("stream", [False, True])
def test_replaying_the_servers_own_output_items_continues_the_conversation(
    conformance_cluster: RefCluster, stream: bool
) -> None:
    with conformance_cluster.orchestrator.client() as client:
        first = ask(client, stream, input="Hello there", store=False)
        follow_up = {"role": "user", "content": "And then?"}
        # As the SDK gives the items back (pydantic objects), and as their model_dump() dicts.
        as_objects = ask(client, stream, input=[*first.output, follow_up], store=False)
        as_dicts = ask(client, stream, input=[*dumped(first), follow_up], store=False)
    assert as_objects.output_text == as_dicts.output_text
    assert as_objects.usage is not None and first.usage is not None and as_dicts.usage is not None
    assert as_objects.usage.input_tokens == as_dicts.usage.input_tokens > first.usage.input_tokens


@pytest.mark.parametrize("stream", [False, True])
def test_previous_response_id_continues_the_stored_conversation(client: openai.OpenAI, stream: bool) -> None:
    first = ask(client, stream, input="Hello there", instructions="Be brief.")
    second = ask(client, stream, previous_response_id=first.id, input="And then?")
    third = ask(client, stream, previous_response_id=second.id,
                input=[{"role": "user", "content": [{"type": "input_text", "text": "Why?"}]}])
    # The same conversation sent whole: the stored turns' items, then the new input. Instructions are not
    # carried over, as OpenAI does.
    replayed = ask(client, stream, store=False, input=[
        {"role": "user", "content": "Hello there"}, *dumped(first), {"role": "user", "content": "And then?"},
        *dumped(second), {"role": "user", "content": [{"type": "input_text", "text": "Why?"}]},
    ])
    assert third.output_text == replayed.output_text
    assert third.usage is not None and replayed.usage is not None and second.usage is not None
    assert third.usage.input_tokens == replayed.usage.input_tokens > second.usage.input_tokens


@pytest.mark.parametrize("stream", [False, True])
def test_an_answer_ctx_finished_by_itself_is_stored_too(client: openai.OpenAI, stream: bool) -> None:
    # max_output_tokens=1: CTX answers alone (a stream is CTX's answer replayed), GEN is never called.
    first = ask(client, stream, input="Hello there", max_output_tokens=1)
    assert client.responses.retrieve(first.id).output_text == first.output_text
    second = ask(client, stream, previous_response_id=first.id, input="And then?")
    assert second.usage is not None and first.usage is not None
    assert second.usage.input_tokens > first.usage.input_tokens


@pytest.mark.parametrize(("item", "param"), [
    ({"role": "user", "content": "x", "bogus": 1}, "input.1.bogus"),
    ({"type": "reasoning", "id": "rs_1", "summary": []}, "input.1"),
])
def test_a_bad_item_in_a_follow_up_is_named_as_the_client_counted_it(
    client: openai.OpenAI, item: dict[str, Any], param: str
) -> None:
    first = ask(client, False, input="Hello there")
    with pytest.raises(openai.BadRequestError) as caught:
        ask(client, False, previous_response_id=first.id, input=[{"role": "user", "content": "Hi"}, item])
    assert caught.value.param == param


@pytest.mark.parametrize("stream", [False, True])
def test_an_unknown_previous_response_id_is_a_404_in_openais_shape(
    client: openai.OpenAI, stream: bool
) -> None:
    with pytest.raises(openai.NotFoundError) as caught:
        ask(client, stream, previous_response_id="resp_unknown", input="Hi")
    assert caught.value.status_code == 404
    assert caught.value.code == "previous_response_not_found"
    assert caught.value.param == "previous_response_id"
    assert caught.value.type == "invalid_request_error"
    assert "resp_unknown" in caught.value.message


@pytest.mark.parametrize("stream", [False, True])
def test_a_stored_response_can_be_retrieved_and_deleted(client: openai.OpenAI, stream: bool) -> None:
    answered = ask(client, stream, input="Hello there")
    retrieved = client.responses.retrieve(answered.id)
    assert (retrieved.id, retrieved.output_text, retrieved.usage) == (answered.id, answered.output_text,
                                                                       answered.usage)
    client.responses.delete(answered.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(answered.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.delete(answered.id)
    with pytest.raises(openai.NotFoundError):
        ask(client, stream, previous_response_id=answered.id, input="Hi")


@pytest.mark.parametrize("stream", [False, True])
def test_a_response_with_store_false_is_not_kept(client: openai.OpenAI, stream: bool) -> None:
    answered = ask(client, stream, input="Hello there", store=False)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(answered.id)
    with pytest.raises(openai.NotFoundError) as caught:
        ask(client, stream, previous_response_id=answered.id, input="Hi")
    assert caught.value.code == "previous_response_not_found"


def test_the_entry_bound_evicts_the_least_recently_used(conformance_cluster: RefCluster,
                                                        backend: dict[str, Any]) -> None:
    metrics = Metrics()
    with orchestrator(conformance_cluster, metrics=metrics, max_entries=2, **backend) as client:
        first, second = ask(client, False, input="One"), ask(client, True, input="Two")
        client.responses.retrieve(first.id)  # first is now more recent than second
        third = ask(client, False, input="Three")
        with pytest.raises(openai.NotFoundError):
            ask(client, False, previous_response_id=second.id, input="Hi")
        assert {client.responses.retrieve(r.id).id for r in (first, third)} == {first.id, third.id}
    assert sample(metrics, "disagg_response_store_entries") == 2
    assert sample(metrics, "disagg_response_store_bytes") > 0


def test_a_response_expires_on_the_stores_clock(conformance_cluster: RefCluster, backend: dict[str, Any]) -> None:
    clock = FakeClock()
    config = ResponseStoreConfig(ttl_s=60, **backend)
    store = RedisResponseStore(config, clock=clock) if backend else MemoryResponseStore(config, clock)
    with orchestrator(conformance_cluster, store, ttl_s=60, **backend) as client:
        answered = ask(client, True, input="Hello there")
        clock.now += 59
        ask(client, False, previous_response_id=answered.id, input="Hi", store=False)
        clock.now += 1
        with pytest.raises(openai.NotFoundError) as caught:
            ask(client, False, previous_response_id=answered.id, input="Hi")
    assert caught.value.code == "previous_response_not_found"


def test_with_the_store_off_store_true_and_previous_response_id_are_refused(conformance_cluster: RefCluster) -> None:
    # What a front end of `--api-workers N` serves: nothing stored, and it says so rather than 404ing at random.
    with orchestrator(conformance_cluster, max_entries=0) as client:
        answered = ask(client, False, input="Hello there")
        with pytest.raises(openai.NotFoundError):
            client.responses.retrieve(answered.id)
        for request in ({"store": True}, {"previous_response_id": answered.id}):
            with pytest.raises(openai.BadRequestError) as caught:
                ask(client, False, input="Hi", **request)
            assert caught.value.param == next(iter(request))


@pytest.mark.parametrize("stream", [False, True])
def test_a_response_repeats_the_settings_it_was_asked_with(client: openai.OpenAI, stream: bool) -> None:
    """Through CTX and GEN as on one worker: the Response object says what instructions, temperature and
    max_output_tokens the request set (GEN writes it, so it is sent the instructions to repeat)."""
    answer = ask(client, stream, input="Hello there", instructions="Be brief.")
    assert (answer.instructions, answer.temperature, answer.max_output_tokens) == ("Be brief.", 0, 4)
    plain = ask(client, stream, input="Hello there")
    assert plain.instructions is None
