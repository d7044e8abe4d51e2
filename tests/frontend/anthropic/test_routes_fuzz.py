"""Schemathesis against the Messages routes of the orchestrator and of a worker in role ``both`` (synthetic
engines), as tests/frontend/test_openapi_fuzz.py does for the OpenAI routes: whatever the body, valid by the
schema or not, no 5xx, and every error in Anthropic's shape."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import pytest
import requests
import schemathesis
from hypothesis import HealthCheck, given, settings
from schemathesis import GenerationMode
from schemathesis.core.result import Ok

from tests.cluster import MODEL, Node, start_orchestrator, start_worker
from workers.engines.synthetic import SyntheticConfig

MAX_EXAMPLES = 30


@pytest.fixture(scope="module")
def nodes() -> Iterator[dict[str, Node]]:
    with contextlib.ExitStack() as stack:
        small = SyntheticConfig(max_context=2048)  # bounds what a generated max_tokens can ask for
        ctx, gen = start_worker(stack, "context", small), start_worker(stack, "generation", small)
        worker = start_worker(stack, "both", small)
        yield {"orchestrator": start_orchestrator(stack, [ctx.url], [gen.url]), "worker": worker}


@pytest.mark.parametrize("which", ["orchestrator", "worker"])
@pytest.mark.parametrize("path", ["/v1/messages", "/v1/messages/count_tokens"])
@pytest.mark.parametrize("mode", [GenerationMode.POSITIVE, GenerationMode.NEGATIVE])
def test_no_generated_request_gets_a_5xx(nodes: dict[str, Node], which: str, path: str,
                                         mode: GenerationMode) -> None:
    node = nodes[which]
    operations = {}
    for result in schemathesis.openapi.from_dict(node.app.openapi()).get_all_operations():
        assert isinstance(result, Ok), result
        operation = result.ok()
        operations[(operation.method.upper(), operation.path)] = operation
    operation = operations[("POST", path)]
    with requests.Session() as session:
        @settings(max_examples=MAX_EXAMPLES, suppress_health_check=list(HealthCheck), deadline=None)
        @given(case=operation.as_strategy(mode))
        def check(case: Any) -> None:
            if mode is GenerationMode.POSITIVE and isinstance(case.body, dict):
                case.body["model"] = MODEL  # so that valid cases go all the way to the engine
            reply = case.call(base_url=node.url, session=session, timeout=15)
            assert reply.status_code < 500, (case.body, reply.text[:500])
            if reply.status_code >= 400:
                assert reply.json()["type"] == "error", reply.text[:500]

        check()
