"""Conversation ids read as TensorRT-LLM reads them (tensorrt_llm/serve/conversation_id.py): body first, then its
headers in its order, sub-agent affinity ahead as the routing id."""

from __future__ import annotations

import pytest

from orchestrator.conversation import (
    CONVERSATION_ID_HEADERS,
    SUBAGENT_AFFINITY_HEADER,
    header_order,
    read_conversation,
)


def read(body: dict[str, object], **headers: str) -> tuple[str | None, str | None]:
    raw = {name.replace("_", "-").encode(): value for name, value in headers.items()}
    conversation = read_conversation(body, raw.get)
    return conversation.conversation_id, conversation.routing_id


def test_the_body_wins_over_every_header() -> None:
    assert read({"conversation_params": {"conversation_id": " c1 "}}, x_session_id="s") == ("c1", "c1")


@pytest.mark.parametrize("winner", range(len(CONVERSATION_ID_HEADERS)))
def test_headers_in_trtllm_order(winner: int) -> None:
    later = {name.decode().replace("-", "_"): f"v{i}" for i, name in enumerate(CONVERSATION_ID_HEADERS)
             if i >= winner}
    assert read({}, **later) == (f"v{winner}", f"v{winner}")


def test_empty_values_fall_through_and_all_empty_is_none() -> None:
    assert read({"conversation_params": {"conversation_id": "  "}}, x_session_id=" ",
                x_correlation_id="corr") == ("corr", "corr")
    assert read({}, x_session_id="", x_correlation_id=" ") == (None, None)


def test_subagent_affinity_is_the_routing_id_not_the_conversation() -> None:
    affinity = SUBAGENT_AFFINITY_HEADER.decode().replace("-", "_")
    assert read({"conversation_params": {"conversation_id": "child"}}, **{affinity: "parent"}) == ("child", "parent")
    assert read({}, **{affinity: "parent"}) == (None, "parent")


def test_a_configured_session_header_is_read_first() -> None:
    order = header_order(b"x-tenant-session")
    assert order == (b"x-tenant-session", *CONVERSATION_ID_HEADERS)
    assert header_order(b"x-correlation-id")[0] == b"x-correlation-id" and len(header_order(b"x-session-id")) == 4
    headers = {b"x-tenant-session": "mine", b"x-session-id": "theirs"}
    assert read_conversation({}, headers.get, order).conversation_id == "mine"
