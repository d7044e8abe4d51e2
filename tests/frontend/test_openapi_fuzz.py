"""Fuzzing: schemathesis against the orchestrator's and a worker's OpenAPI schema, and hypothesis on the wire models.

Schemathesis reads each app's own ``app.openapi()`` (which carries the wire models as request bodies) and sends
generated requests, valid by the schema (positive) and invalid by it (negative), over real HTTP to real servers
on loopback. The property: no 5xx and no hang, whatever the body. The budget is bounded and derandomized, so a
run is repeatable: ``MAX_EXAMPLES`` cases per operation and mode, each request with a timeout.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import hypothesis.strategies as st
import pytest
import requests
import schemathesis
from hypothesis import HealthCheck, given, settings
from schemathesis import GenerationMode
from schemathesis.core.result import Ok

from frontend.errors import ServingError
from frontend.http import validate_wire
from frontend.openai_models import ChatCompletionRequest, CompletionRequest, ResponsesRequest
from tests.cluster import MODEL, Node, sample, start_orchestrator, start_worker
from tests.waiting import eventually
from workers.engines.synthetic import SyntheticConfig

MAX_EXAMPLES = 30
REQUEST_TIMEOUT_S = 15
# A small context bounds what a generated max_tokens can ask for, so no case can run for long.
SMALL = SyntheticConfig(max_context=2048)
BODIES = [("POST", "/v1/chat/completions"), ("POST", "/v1/completions"), ("POST", "/v1/responses")]
# Routes with no documented input have nothing a negative case could break: positive mode only.
PROMPT_FIELDS = {"/v1/chat/completions": "messages", "/v1/completions": "prompt", "/v1/responses": "input"}
PROMPT_FIELDS_VALUES: dict[str, Any] = {"messages": [{"role": "user", "content": "hi"}], "prompt": "hi",
                                        "input": "hi"}
FUZZED = [(m, p, mode) for m, p in BODIES for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE)] + [
    ("POST", "/v1/disagg/release", GenerationMode.POSITIVE), ("GET", "/health", GenerationMode.POSITIVE),
    ("GET", "/v1/models", GenerationMode.POSITIVE)]


@pytest.fixture(scope="module")
def nodes() -> Iterator[dict[str, Node]]:
    with contextlib.ExitStack() as stack:
        ctx = start_worker(stack, "context", SMALL)
        gen = start_worker(stack, "generation", SMALL)
        worker = start_worker(stack, "both", SMALL)
        orchestrator = start_orchestrator(stack, [ctx.url], [gen.url])
        yield {"orchestrator": orchestrator, "worker": worker}


def _operations(node: Node) -> dict[tuple[str, str], Any]:
    schema = schemathesis.openapi.from_dict(node.app.openapi())
    operations = {}
    for result in schema.get_all_operations():
        assert isinstance(result, Ok), result
        operation = result.ok()
        operations[(operation.method.upper(), operation.path)] = operation
    return operations


CASES = [(which, *op) for which in ("orchestrator", "worker") for op in FUZZED
         if not (which == "orchestrator" and op[1] == "/v1/disagg/release")]  # a worker route only


@pytest.mark.parametrize(("which", "method", "path", "mode"), CASES,
                         ids=[f"{w}-{m} {p} {mode.value}" for w, m, p, mode in CASES])
def test_no_generated_request_gets_a_5xx_or_hangs(
    nodes: dict[str, Node], which: str, method: str, path: str, mode: GenerationMode
) -> None:
    node = nodes[which]
    operations = _operations(node)
    operation = operations[(method, path)]
    statuses: list[int] = []

    with requests.Session() as session:
        @settings(max_examples=MAX_EXAMPLES, suppress_health_check=list(HealthCheck))
        @given(case=operation.as_strategy(mode))
        def check(case: Any) -> None:
            if mode is GenerationMode.POSITIVE and isinstance(case.body, dict):
                # The served model and a prompt (optional in the schema: GEN may get none), so that valid cases
                # go all the way to the engine instead of stopping at the first check.
                case.body["model"] = MODEL
                prompt_field = PROMPT_FIELDS.get(path)
                if prompt_field is not None and case.body.get(prompt_field) is None:
                    case.body[prompt_field] = PROMPT_FIELDS_VALUES[prompt_field]
            try:
                response = case.call(base_url=node.url, session=session, timeout=REQUEST_TIMEOUT_S)
            except requests.Timeout as exc:
                raise AssertionError(f"{which} hung on {case.method} {case.path} body={case.body!r}") from exc
            statuses.append(response.status_code)
            assert response.status_code < 500, (case.body, response.text[:500])
            if response.status_code >= 400 and path.startswith("/v1/"):
                error = response.json()["error"]
                assert set(error) == {"message", "type", "param", "code"}, response.text[:500]

        check()
    assert statuses  # something was sent
    role = "orchestrator" if which == "orchestrator" else "both"
    assert eventually(lambda: sample(node.metrics, "disagg_engine_inflight_requests", role=role) == 0)


# -- hypothesis on the wire models --------------------------------------------------------------------------------
JSON: st.SearchStrategy[Any] = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False, allow_infinity=False) | st.text(),
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=12), children, max_size=4),
    max_leaves=12,
)
WIRE_MODELS = [ChatCompletionRequest, CompletionRequest, ResponsesRequest]


def _fields(model: Any) -> st.SearchStrategy[dict[str, Any]]:
    """Dicts whose keys are mostly the model's own field names (so validation goes deep), with arbitrary values."""
    names = st.sampled_from(sorted(model.model_fields)) | st.text(max_size=12)
    return st.dictionaries(names, JSON, max_size=8)


def _plausible(model: Any) -> st.SearchStrategy[dict[str, Any]]:
    """A valid-looking request with a few fields replaced by arbitrary JSON."""
    base: dict[str, Any] = {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "prompt": "x",
                            "input": "x"}
    base = {k: v for k, v in base.items() if k in model.model_fields or k == "model"}
    return st.fixed_dictionaries({}).flatmap(lambda _: st.dictionaries(
        st.sampled_from(sorted(model.model_fields)), JSON, max_size=3).map(lambda extra: {**base, **extra}))


@pytest.mark.parametrize("model", WIRE_MODELS, ids=[m.__name__ for m in WIRE_MODELS])
@settings(max_examples=300)
@given(data=st.data())
def test_wire_validation_raises_only_serving_errors(model: Any, data: st.DataObject) -> None:
    payload = data.draw(st.one_of(st.dictionaries(st.text(max_size=12), JSON, max_size=6), _fields(model),
                                  _plausible(model)))
    try:
        validate_wire(model, payload)
    except ServingError as exc:
        assert 400 <= exc.status_code < 500
        assert exc.message
        body = exc.to_dict()["error"]
        assert isinstance(body, dict)
        assert set(body) == {"message", "type", "param", "code"}
        assert body["param"] is None or isinstance(body["param"], str)
