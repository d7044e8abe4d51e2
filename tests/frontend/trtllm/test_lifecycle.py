"""TensorRT-LLM's lifecycle v1 wire models (frontend/trtllm/lifecycle.py): each valid body validates, and each one
fails once any of its required fields is dropped or any field is renamed (the strictness both directions rely on)."""

from __future__ import annotations

import uuid
from typing import Any

import pytest
from pydantic import BaseModel, ValidationError

from frontend.disaggregated_params import DisaggregatedParams
from frontend.trtllm.lifecycle import (
    PROTOCOL_V1_REQUIRED_CAPABILITIES,
    ContextArtifactAbortRequest,
    GenerationGrantAbortRequest,
    GenerationGrantDecisionResponse,
    GenerationGrantRenewRequest,
    GenerationGrantRequest,
    LifecycleNegotiationError,
    ObligationResponse,
    TransceiverLifecycleAdvertisement,
    negotiate,
    protocol_version_from_env,
)
from tests import trtllm_wire


def uid() -> str:
    return str(uuid.uuid4())


def advertisement(**changes: Any) -> dict[str, Any]:
    base = {"protocol_version": 1,
            "capabilities": sorted(PROTOCOL_V1_REQUIRED_CAPABILITIES | {"DIRECT_TRANSFER", "GENERATION_FIRST"}),
            "qualified_legacy_mode": False, "backend": "python", "instance_id": uid(), "world_size": 1,
            "tp_size": 1, "pp_size": 1, "cp_size": 1, "attention_dp": False}
    return {**base, **changes}


def identity() -> dict[str, Any]:
    return {"logical_request_id": 7, "prefill_artifact_id": uid(), "artifact_version": 0,
            "handoff_attempt_uuid": uid(), "consumer_grant_id": uid(), "transfer_session_id": uid()}


def endpoint() -> dict[str, Any]:
    return {"generation_endpoint_name": "gen:8000", "generation_endpoint_rank": 0,
            "generation_endpoint_incarnation": uid()}


V1 = {"lifecycle_protocol_version": 1}
BODIES: dict[str, tuple[type[BaseModel], dict[str, Any], tuple[str, ...]]] = {
    # model, a valid body, the fields whose absence must fail it
    "grant": (GenerationGrantRequest,
              {**V1, **identity(), "ttl_s": 600.0, "context_control_endpoint": "ctx:8000",
               "context_transceiver_lifecycle": advertisement(), "schedule_style": 0, "ctx_dp_rank": 0},
              ("lifecycle_protocol_version", *identity(), "ttl_s", "context_transceiver_lifecycle",
               "schedule_style")),
    "decision": (GenerationGrantDecisionResponse,
                 {**V1, "accepted": True, "reason": "", **endpoint(),
                  "generation_transceiver_lifecycle": advertisement(), "ttl_s": 600.0},
                 ("lifecycle_protocol_version", "accepted")),
    "renew": (GenerationGrantRenewRequest, {**V1, **identity(), **endpoint(), "ttl_s": 600.0, "sequence": 0},
              ("lifecycle_protocol_version", *identity(), *endpoint(), "ttl_s", "sequence")),
    "abort": (GenerationGrantAbortRequest, {**V1, **identity(), **endpoint(), "reason": "client gone"},
              ("lifecycle_protocol_version", *identity(), *endpoint())),
    "artifact-abort": (ContextArtifactAbortRequest,
                       {**V1, **identity(), "context_endpoint_incarnation": uid(), "reason": "gone"},
                       ("lifecycle_protocol_version", *identity(), "context_endpoint_incarnation")),
    "obligation": (ObligationResponse, {**V1, "accepted": True, "state": "ACTIVE", "reason": "", "ttl_s": 5.0,
                                        "artifact_ready": True, "context_endpoint_incarnation": uid()},
                   ("lifecycle_protocol_version", "accepted", "state")),
    "advertisement": (TransceiverLifecycleAdvertisement, advertisement(), tuple(advertisement())),
    # in disaggregated_params the two tuples are all or nothing: dropping any one member fails
    "disaggregated-params": (DisaggregatedParams,
                             {"request_type": "generation_only", **identity(), **endpoint(),
                              "context_control_endpoint": "ctx:1", "context_transceiver_lifecycle": advertisement()},
                             ("request_type", *identity(), *endpoint())),
    "test-wire-disaggregated-params": (trtllm_wire.DisaggregatedParams,
                                       {"request_type": "context_only", **identity(),
                                        "context_transceiver_lifecycle": advertisement()},
                                       ("request_type", *identity())),
    "conversation-params": (trtllm_wire.ConversationParams, {"conversation_id": "c-1"}, ("conversation_id",)),
}
CASES = [pytest.param(name, field, id=f"{name}-drop-{field}") for name, (_, _, required) in BODIES.items()
         for field in required]
RENAMES = [pytest.param(name, field, id=f"{name}-rename-{field}") for name, (_, body, _) in BODIES.items()
           for field in body]


@pytest.mark.parametrize("name", BODIES)
def test_the_valid_body_validates(name: str) -> None:
    model, body, _ = BODIES[name]
    model.model_validate(body)


@pytest.mark.parametrize(("name", "field"), CASES)
def test_dropping_a_required_field_fails(name: str, field: str) -> None:
    model, body, _ = BODIES[name]
    with pytest.raises(ValidationError):
        model.model_validate({k: v for k, v in body.items() if k != field})


@pytest.mark.parametrize(("name", "field"), RENAMES)
def test_renaming_a_field_fails(name: str, field: str) -> None:
    model, body, _ = BODIES[name]
    renamed = {(k + "_x" if k == field else k): v for k, v in body.items()}
    with pytest.raises(ValidationError):
        model.model_validate(renamed)


@pytest.mark.parametrize(("change", "message"), [
    ({"capabilities": ["B", "A"]}, "sorted tuple of unique"),
    ({"instance_id": uid().upper()}, "canonical non-nil UUID"),
    ({"backend": "rust"}, "backend"),
    ({"tp_size": 0}, "tp_size"),
    ({"attention_dp": 1}, "attention_dp"),
])
def test_an_advertisement_is_checked_key_by_key(change: dict[str, Any], message: str) -> None:
    with pytest.raises(ValidationError, match=message):
        TransceiverLifecycleAdvertisement.model_validate(advertisement(**change))


def test_an_advertisement_has_exactly_ten_keys() -> None:
    with pytest.raises(ValidationError, match=r"invalid schema \(missing: backend; extra: engine\)"):
        TransceiverLifecycleAdvertisement.model_validate(
            {**{k: v for k, v in advertisement().items() if k != "backend"}, "engine": "x"})


def test_negotiation_requires_v1_python_and_the_capabilities_of_the_schedule() -> None:
    ctx, gen = advertisement(), advertisement()
    assert "GENERATION_FIRST" in negotiate(ctx, gen, schedule_style=1)
    assert "GENERATION_FIRST" not in negotiate(ctx, gen, schedule_style=0)
    no_gen_first = advertisement(capabilities=sorted(PROTOCOL_V1_REQUIRED_CAPABILITIES | {"DIRECT_TRANSFER"}))
    negotiate(ctx, no_gen_first, schedule_style=0)
    with pytest.raises(LifecycleNegotiationError, match="generation transceiver is missing lifecycle capabilities: "
                                                        "GENERATION_FIRST"):
        negotiate(ctx, no_gen_first, schedule_style=1)
    with pytest.raises(LifecycleNegotiationError, match="context transceiver backend 'cpp'"):
        negotiate(advertisement(backend="cpp"), gen, schedule_style=0)
    with pytest.raises(LifecycleNegotiationError, match="does not advertise lifecycle protocol v1"):
        negotiate(advertisement(protocol_version=0, qualified_legacy_mode=True), gen, schedule_style=0)
    with pytest.raises(LifecycleNegotiationError, match="TENSOR_PARALLEL"):
        negotiate(advertisement(tp_size=2, world_size=2), gen, schedule_style=0)
    with pytest.raises(LifecycleNegotiationError, match="exact context writer rank"):
        negotiate(advertisement(attention_dp=True, capabilities=sorted(
            {*advertisement()["capabilities"], "ATTENTION_DATA_PARALLEL"})), gen, schedule_style=1)


@pytest.mark.parametrize(("value", "version"), [(None, 0), ("0", 0), ("1", 1)])
def test_the_protocol_version_is_read_as_tensorrt_llm_reads_it(value: str | None, version: int) -> None:
    env = {} if value is None else {"TRTLLM_DISAGG_LIFECYCLE_PROTOCOL_VERSION": value}
    assert protocol_version_from_env(env) == version


def test_any_other_protocol_version_stops_start_up() -> None:
    with pytest.raises(ValueError, match="must be 0 or 1"):
        protocol_version_from_env({"TRTLLM_DISAGG_LIFECYCLE_PROTOCOL_VERSION": "latest"})


# -- where a worker may send a control call (issue 44, item 2) ----------------------------------------------------
@pytest.mark.parametrize(("endpoint", "url"), [
    ("10.0.0.7:8001", "http://10.0.0.7:8001/_internal/x"),  # TensorRT-LLM's form: host:port
    ("http://ctx.svc:8001/", "http://ctx.svc:8001/_internal/x"),
    ("https://ctx.svc", "https://ctx.svc/_internal/x"),
    ("[::1]:9", "http://[::1]:9/_internal/x"),
])
def test_a_control_endpoint_becomes_a_url_built_from_its_parts(endpoint: str, url: str) -> None:
    from frontend.trtllm.lifecycle import control_url

    assert control_url(endpoint, "/_internal/x") == url


@pytest.mark.parametrize("endpoint", [
    "evil.example/steal?x=",  # a '?' pushed the fixed path into the query on bb7e60b
    "evil.example/steal#",
    "user:pw@ctx:1", "file:///etc/passwd", "gopher://ctx:70", "ctx: 1", "ctx:1/\n", "ctx:99999", "http://",
    # a path prefix aims the POST at any path of the host: a cloud metadata service's, for one
    "169.254.169.254/latest/meta-data", "https://ctx.svc/base",
])
def test_a_control_endpoint_that_could_aim_the_call_elsewhere_is_refused(endpoint: str) -> None:
    from frontend.trtllm.lifecycle import control_url

    with pytest.raises(ValueError):
        control_url(endpoint, "/_internal/x")
