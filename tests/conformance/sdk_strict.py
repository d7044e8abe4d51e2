"""Reading our answers as an official SDK's own types, strictly: no field its types do not define, and each SSE
frame's ``event:`` name the ``type`` of its data."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import orjson
import pydantic


def assert_strict(model: pydantic.BaseModel) -> None:
    """No field the SDK's type does not define, at any depth (its models keep unknown fields as extras)."""
    assert not model.model_extra, f"{type(model).__name__} has fields the SDK does not know: {model.model_extra}"
    for name in type(model).model_fields:
        value = getattr(model, name)
        for item in value if isinstance(value, list) else [value]:
            if isinstance(item, pydantic.BaseModel):
                assert_strict(item)


def named_events(reply: httpx.Response) -> Iterator[dict[str, Any]]:
    """The payloads of a whole SSE answer, each frame's ``event:`` name checked against its ``type``."""
    for frame in reply.read().decode().split("\n\n"):
        if not frame.strip():
            continue
        name, data = frame.split("\n")
        payload: dict[str, Any] = orjson.loads(data.removeprefix("data: "))
        assert name == f"event: {payload['type']}"
        yield payload
