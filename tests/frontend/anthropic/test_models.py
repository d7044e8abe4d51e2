"""The Messages wire models and their refusals, fuzzed: whatever a client sends, the translation answers a
request or raises a ``ServingError`` (a 4xx in Anthropic's shape), never anything else."""

from __future__ import annotations

from typing import Any

import hypothesis.strategies as st
import pytest
from hypothesis import given, settings

from frontend.anthropic.models import CountTokensRequest, MessagesRequest
from frontend.anthropic.translate import count_tokens_request, messages_request
from frontend.errors import ServingError

JSON: st.SearchStrategy[Any] = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False, allow_infinity=False) | st.text(max_size=8)
    | st.sampled_from(["text", "tool_use", "tool_result", "image", "user", "assistant", "any", "tool", "custom"]),
    lambda children: st.lists(children, max_size=3) | st.dictionaries(
        st.sampled_from(["type", "text", "content", "role", "name", "id", "input", "tool_use_id", "schema"])
        | st.text(max_size=6), children, max_size=4),
    max_leaves=16,
)
BASE: dict[str, Any] = {"model": "m", "max_tokens": 3, "messages": [{"role": "user", "content": "x"}]}


@pytest.mark.parametrize("translate", [messages_request, count_tokens_request])
@settings(max_examples=300, deadline=None)
@given(data=st.data())
def test_any_body_is_translated_or_refused_with_a_serving_error(translate: Any, data: st.DataObject) -> None:
    model = MessagesRequest if translate is messages_request else CountTokensRequest
    fields = data.draw(st.dictionaries(st.sampled_from(sorted(model.model_fields)), JSON, max_size=3))
    try:
        translate({**BASE, **fields})
    except ServingError as exc:
        assert exc.status_code == 400


def test_unknown_fields_are_refused_by_name() -> None:
    with pytest.raises(ServingError) as refused:
        messages_request({**BASE, "temprature": 1})
    assert refused.value.param == "temprature"
    assert refused.value.message == "temprature: Extra inputs are not permitted"  # Anthropic's words
