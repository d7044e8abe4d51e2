from __future__ import annotations

from typing import Any

import pytest

from frontend.errors import UnsupportedParameterError
from frontend.openai_parameters import drop_neutral_parameters


@pytest.mark.parametrize(("endpoint", "name", "value"), [
    ("responses", "include", None), ("responses", "include", []), ("responses", "reasoning", {}),
    ("chat", "functions", []), ("chat", "modalities", ["text"]), ("chat", "store", False),
    ("responses", "truncation", "disabled"),
    ("responses", "prompt", None), ("completions", "service_tier", "auto"),
])
def test_a_neutral_value_is_dropped(endpoint: Any, name: str, value: Any) -> None:
    assert drop_neutral_parameters(endpoint, {"model": "m", name: value}) == {"model": "m"}


@pytest.mark.parametrize(("endpoint", "name", "value"), [
    ("responses", "include", ["reasoning.encrypted_content"]), ("chat", "functions", [{"name": "f"}]),
    ("chat", "store", True), ("responses", "background", True), ("completions", "no_repeat_ngram_size", 2),
])
def test_any_other_value_is_a_400_naming_it(endpoint: Any, name: str, value: Any) -> None:
    with pytest.raises(UnsupportedParameterError) as caught:
        drop_neutral_parameters(endpoint, {"model": "m", name: value})
    assert caught.value.param == name


def test_the_tools_parameters_are_left_to_the_wire_model() -> None:
    body = {"tools": [{"type": "web_search"}], "tool_choice": {"type": "function", "name": "f"},
            "parallel_tool_calls": "no"}  # the wire model refuses each, naming it (frontend.responses_tools)
    assert drop_neutral_parameters("responses", body) == body
    # Chat's parallel_tool_calls says whether an answer may make several calls (frontend.tool_calls).
    assert drop_neutral_parameters("chat", {"parallel_tool_calls": False}) == {"parallel_tool_calls": False}


def test_a_name_of_another_endpoint_is_left_to_the_wire_model() -> None:
    # The completions prompt is not the Responses API's stored prompt template.
    assert drop_neutral_parameters("completions", {"prompt": "hi"}) == {"prompt": "hi"}
