"""The disaggregation extensions on the wire (frontend/disaggregated_params.py), validated where a request carries
them."""

from __future__ import annotations

from typing import Any

import pytest

from frontend.errors import InvalidRequestError
from frontend.http import validate_wire
from frontend.openai_models import ChatCompletionRequest

CHAT: dict[str, Any] = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}


def test_disaggregated_params_are_validated() -> None:
    with pytest.raises(InvalidRequestError) as caught:
        validate_wire(ChatCompletionRequest, {**CHAT, "disaggregated_params": {"request_type": "both"}})
    assert caught.value.param == "disaggregated_params.request_type"
    with pytest.raises(InvalidRequestError) as bad_len:
        validate_wire(ChatCompletionRequest, {**CHAT, "disaggregated_params": {"request_type": "generation_only",
                                                                                "prompt_len": 0}})
    assert bad_len.value.param == "disaggregated_params.prompt_len"
