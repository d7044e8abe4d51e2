from __future__ import annotations

from typing import Any

import pytest

from frontend.errors import UnsupportedParameterError
from frontend.openai_parameters import drop_neutral_parameters


@pytest.mark.parametrize(("endpoint", "name", "value"), [
    ("responses", "tools", None), ("responses", "tools", []), ("responses", "tool_choice", "none"),
    ("chat", "functions", []), ("chat", "modalities", ["text"]), ("chat", "store", False),
    ("responses", "truncation", "disabled"),
    ("responses", "prompt", None), ("completions", "service_tier", "auto"),
])
def test_a_neutral_value_is_dropped(endpoint: Any, name: str, value: Any) -> None:
    assert drop_neutral_parameters(endpoint, {"model": "m", name: value}) == {"model": "m"}


@pytest.mark.parametrize(("endpoint", "name", "value"), [
    ("responses", "tools", [{"type": "function"}]), ("chat", "functions", [{"name": "f"}]),
    ("chat", "store", True), ("responses", "background", True), ("completions", "no_repeat_ngram_size", 2),
])
def test_any_other_value_is_a_400_naming_it(endpoint: Any, name: str, value: Any) -> None:
    with pytest.raises(UnsupportedParameterError) as caught:
        drop_neutral_parameters(endpoint, {"model": "m", name: value})
    assert caught.value.param == name


def test_a_name_of_another_endpoint_is_left_to_the_wire_model() -> None:
    # The completions prompt is not the Responses API's stored prompt template.
    assert drop_neutral_parameters("completions", {"prompt": "hi"}) == {"prompt": "hi"}
