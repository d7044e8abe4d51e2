"""The checks a cross-side request meets before it reaches the engine, for this worker's lifecycle protocol version."""

from __future__ import annotations

from frontend.disaggregated_params import DisaggregatedParams
from frontend.errors import InvalidRequestError
from frontend.trtllm.identity import IDENTITY_FIELDS, has_identity
from frontend.trtllm.lifecycle import ScheduleStyle
from workers.settings import Role
from workers.trtllm.lifecycle import LifecycleControl


def check_request(params: DisaggregatedParams | None, role: Role, control: LifecycleControl) -> None:
    """TensorRT-LLM's ``_validate_disagg_before_submit``: what a cross-side request must carry for this worker's
    protocol version. Local-only requests (no params, ``context_and_generation``) always pass."""
    if params is None or params.request_type not in ("context_only", "generation_only"):
        return
    fields = params.model_dump()
    if not control.enabled:
        if has_identity(fields):
            raise InvalidRequestError("generation-safe request reached a qualified-legacy transceiver without "
                                      "protocol-v1 support", param="disaggregated_params")
        return
    if any(fields.get(name) is None for name in IDENTITY_FIELDS):
        raise InvalidRequestError("protocol-v1 cross-side request is missing its negotiated attempt identity",
                                  param="disaggregated_params")
    if params.context_transceiver_lifecycle is None:
        raise InvalidRequestError("protocol-v1 cross-side request is missing the selected context transceiver "
                                  "lifecycle", param="disaggregated_params.context_transceiver_lifecycle")
    if params.context_control_endpoint is None:
        raise InvalidRequestError("protocol-v1 cross-side request is missing the selected context lifecycle-control "
                                  "endpoint", param="disaggregated_params.context_control_endpoint")
    expected = {"context_only": "CONTEXT", "generation_only": "GENERATION"}[params.request_type]
    actual = {"context": "CONTEXT", "generation": "GENERATION", "both": "CONTEXT_AND_GENERATION"}[role]
    if expected != actual:
        raise InvalidRequestError(f"protocol-v1 {params.request_type} request reached {actual} server; expected "
                                  f"{expected}", param="disaggregated_params.request_type")
    if params.request_type == "context_only":
        if params.context_transceiver_lifecycle != control.advertisement:
            raise InvalidRequestError("selected context transceiver lifecycle does not match the current context "
                                      "endpoint incarnation",
                                      param="disaggregated_params.context_transceiver_lifecycle")
        control.artifacts.check(params)
    else:
        control.live_grant(params)  # unknown, expired or aborted grants stop here, before the engine
    if params.schedule_style not in (None, ScheduleStyle.CONTEXT_FIRST, ScheduleStyle.GENERATION_FIRST):
        raise InvalidRequestError(f"unsupported disaggregated schedule style {params.schedule_style!r}",
                                  param="disaggregated_params.schedule_style")
