"""vLLM's P/D protocol, unit by unit: the prefill request, reading P's answer, and the decode request."""

from __future__ import annotations

from typing import Any

import orjson
import pytest

from frontend.config import ConfigError, parse_config
from frontend.errors import UpstreamError
from orchestrator.protocols.base import PromptCarriage, WorkerProtocol
from orchestrator.protocols.registry import detect_protocol
from orchestrator.protocols.vllm import PREFILL_KV_TRANSFER_PARAMS, VllmProtocol
from orchestrator.upstream.base import Reply, body_bytes

PROTOCOL: WorkerProtocol = VllmProtocol()
NIXL_ANSWER = {"do_remote_prefill": True, "do_remote_decode": False, "remote_engine_id": "e1",
               "remote_block_ids": [3, 4], "remote_host": "10.0.0.1", "remote_port": 5600}


def chat_body(**extra: Any) -> dict[str, Any]:
    return {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 50, **extra}


def p_answer(finish: str = "length", kv: Any = NIXL_ANSWER) -> bytes:
    return orjson.dumps({"id": "cmpl-1", "choices": [{"index": 0, "text": "T", "finish_reason": finish}],
                         "usage": {"prompt_tokens": 300, "completion_tokens": 1}, "kv_transfer_params": kv})


def test_the_prefill_request_is_one_token_whole_and_asks_to_keep_the_kv() -> None:
    body = chat_body(stream=True, stream_options={"include_usage": True}, max_completion_tokens=50)
    sent = orjson.loads(body_bytes(PROTOCOL.context_request(body, return_prompt_tokens=True)))
    assert sent["max_tokens"] == 1 and sent["max_completion_tokens"] == 1
    assert sent["stream"] is False and "stream_options" not in sent
    assert sent["kv_transfer_params"] == PREFILL_KV_TRANSFER_PARAMS
    assert sent["kv_transfer_params"]["do_remote_decode"] is True
    assert "prompt_token_ids_b64" not in sent and "disaggregated_params" not in sent
    assert body["max_tokens"] == 50 and body["stream"] is True  # the client's body is left alone


def test_p_stopped_by_its_one_token_cap_continues_at_d() -> None:
    ctx = PROTOCOL.read_context_answer(p_answer("length"))
    assert not ctx.finished and ctx.handoff == NIXL_ANSWER
    assert ctx.prompt_len == 300 and ctx.prompt_b64 is None


@pytest.mark.parametrize("finish", ["stop", "abort"])
def test_p_that_ended_the_request_finishes_it_and_the_client_sees_no_transfer_fields(finish: str) -> None:
    ctx = PROTOCOL.read_context_answer(p_answer(finish))
    assert ctx.finished
    assert "kv_transfer_params" not in PROTOCOL.finished_response(ctx)


@pytest.mark.parametrize("content", [b"not json", b"{}", orjson.dumps({"choices": []}),
                                     p_answer(kv=[1, 2])])
def test_a_p_answer_that_is_not_a_completion_is_an_upstream_error(content: bytes) -> None:
    with pytest.raises(UpstreamError):
        PROTOCOL.read_context_answer(content)


def test_the_decode_request_is_the_client_body_with_what_p_answered() -> None:
    body = chat_body(stream=True)
    sent = orjson.loads(body_bytes(PROTOCOL.generation_request(body, PROTOCOL.read_context_answer(p_answer()),
                                                    PromptCarriage.CLIENT_PROMPT)))
    assert sent == {**body, "kv_transfer_params": NIXL_ANSWER}


def test_a_connector_that_answers_nothing_still_tells_d_the_prefill_was_remote() -> None:
    ctx = PROTOCOL.read_context_answer(p_answer(kv=None))
    sent = orjson.loads(body_bytes(PROTOCOL.generation_request(chat_body(), ctx, PromptCarriage.CLIENT_PROMPT)))
    assert sent["kv_transfer_params"]["do_remote_prefill"] is True
    assert sent["kv_transfer_params"]["do_remote_decode"] is False


def test_the_prompt_always_travels_as_the_client_sent_it() -> None:
    ctx = PROTOCOL.read_context_answer(p_answer())
    for carriage in (PromptCarriage.CTX_TOKENS, PromptCarriage.LENGTH_ONLY, PromptCarriage.NOTHING):
        with pytest.raises(UpstreamError):
            PROTOCOL.generation_request(chat_body(), ctx, carriage)


def test_no_hand_off_is_ever_lost_or_released() -> None:
    ctx = PROTOCOL.read_context_answer(p_answer())
    assert PROTOCOL.release_request(ctx) is None
    assert not PROTOCOL.handoff_lost(Reply(400, b'{"error": {"code": "invalid_handoff"}}'))


def test_the_config_names_the_protocol_of_both_groups() -> None:
    groups = {"context_servers": {"urls": ["http://p:8000"], "protocol": "vllm"},
              "generation_servers": {"urls": ["http://d:8000"], "protocol": "vllm"}}
    config = parse_config(groups)
    assert config.context_servers.protocol == config.generation_servers.protocol == "vllm"
    assert parse_config({"context_servers": {"urls": ["http://p:8000"]},
                         "generation_servers": {"urls": ["http://d:8000"]}}).context_servers.protocol == "detect"
    with pytest.raises(ConfigError, match="must be set on both"):
        parse_config({**groups, "generation_servers": {"urls": ["http://d:8000"]}})
    with pytest.raises(ConfigError, match="metadata_only"):
        parse_config({**groups, "gen_tokids_metadata_only": True})
    with pytest.raises(ConfigError, match="protocol"):
        parse_config({**groups, "context_servers": {"urls": ["http://p:8000"], "protocol": "sglang"}})


def test_a_vllm_server_is_detected_by_its_model_card() -> None:
    """An unmodified vLLM OpenAI server says nothing of disaggregation; its ``owned_by`` names it."""
    assert detect_protocol({"id": "m", "object": "model", "owned_by": "vllm"}) == "vllm"
