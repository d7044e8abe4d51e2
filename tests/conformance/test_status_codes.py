"""Item 7 and stream_options: OpenAI-shaped 404/405, ``models.retrieve``, 400s naming the parameter, the worker's
own message passed through, and a 5xx logged with its request id and cause."""

from __future__ import annotations

import httpx
import openai
import pytest

from tests.workers.engines.reference.cluster import RefCluster, RefNode


def nodes(cluster: RefCluster) -> list[RefNode]:
    return [cluster.orchestrator, cluster.ctx, cluster.gen, cluster.aggregated]


@pytest.mark.parametrize(("method", "path", "status", "code"), [
    ("GET", "/v1/nope", 404, "not_found"),
    ("POST", "/v1/embeddings", 404, "not_found"),
    ("GET", "/v1/chat/completions", 405, "method_not_allowed"),
    ("DELETE", "/v1/models", 405, "method_not_allowed"),
])
def test_unknown_routes_and_wrong_methods_answer_in_openai_shape(
    conformance_cluster: RefCluster, method: str, path: str, status: int, code: str
) -> None:
    for node in nodes(conformance_cluster):
        reply = httpx.request(method, node.url + path, timeout=30)
        assert reply.status_code == status
        error = reply.json()["error"]
        assert error["code"] == code and error["type"] == "invalid_request_error" and path in error["message"]


def test_models_retrieve_works_everywhere(conformance_cluster: RefCluster) -> None:
    for node in nodes(conformance_cluster):
        with node.client() as client:
            assert client.models.retrieve("tiny").id == "tiny"
            with pytest.raises(openai.NotFoundError) as caught:
                client.models.retrieve("gpt-nope")
            assert caught.value.code == "model_not_found"


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions", "/v1/responses"])
def test_stream_options_without_stream_is_a_400_naming_it(conformance_cluster: RefCluster, path: str) -> None:
    body = {"model": "tiny", "messages": [{"role": "user", "content": "Hi"}], "prompt": "Hi", "input": "Hi",
            "stream_options": {"include_usage": True}}
    body = {k: v for k, v in body.items() if k in ("model", "stream_options") or k == _prompt_field(path)}
    for node in nodes(conformance_cluster):
        for stream in (None, False):
            sent = body if stream is None else {**body, "stream": stream}
            reply = httpx.post(node.url + path, json=sent, timeout=60)
            assert reply.status_code == 400, (node.url, reply.text)
            assert reply.json()["error"]["param"] == "stream_options"


def _prompt_field(path: str) -> str:
    return {"/v1/chat/completions": "messages", "/v1/completions": "prompt", "/v1/responses": "input"}[path]


def test_a_workers_400_reaches_the_client_with_its_message(conformance_cluster: RefCluster) -> None:
    with conformance_cluster.orchestrator.client() as client, pytest.raises(openai.BadRequestError) as caught:
        client.completions.create(model="tiny", prompt="Hi", max_tokens=100_000)
    assert caught.value.code == "context_length_exceeded"
    assert "exceeds the model's context" in caught.value.message
