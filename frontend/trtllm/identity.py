"""The attempt identity of TensorRT-LLM's lifecycle protocol v1, as it rides in ``disaggregated_params``.

Six fields minted by the orchestrator for each attempt (all or none), echoed by the CTX answer, and the GEN
endpoint's identity (a second all-or-none triple) that a generation grant returns; checked as TensorRT-LLM's
``_validate_lifecycle_identity_fields`` checks them, with its messages. The rest of v1's wire (advertisement,
negotiation, the control plane) is ``frontend.trtllm.lifecycle``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any
from uuid import UUID, uuid4

IDENTITY_FIELDS = ("logical_request_id", "prefill_artifact_id", "artifact_version", "handoff_attempt_uuid",
                   "consumer_grant_id", "transfer_session_id")
IDENTITY_UUID_FIELDS = ("prefill_artifact_id", "handoff_attempt_uuid", "consumer_grant_id", "transfer_session_id")
GENERATION_ENDPOINT_FIELDS = ("generation_endpoint_name", "generation_endpoint_rank",
                              "generation_endpoint_incarnation")
# Every lifecycle key of DisaggregatedParams: what a v0 worker refuses, what a CTX answer must echo.
LIFECYCLE_FIELDS = (*IDENTITY_FIELDS, *GENERATION_ENDPOINT_FIELDS, "context_control_endpoint",
                    "context_transceiver_lifecycle")


def parse_canonical_uuid(name: str, value: object) -> UUID:
    """A lowercase hyphenated non-nil UUID string, as TensorRT-LLM requires of identities (``str(UUID(v)) == v``)."""
    message = f"{name} must be a canonical non-nil UUID string"
    if not isinstance(value, str):
        raise ValueError(message)
    try:
        parsed = UUID(value)
    except ValueError as error:
        raise ValueError(message) from error
    if parsed.int == 0 or str(parsed) != value:
        raise ValueError(message)
    return parsed


def _non_negative_int(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"{name} must be a non-negative integer")


def _all_or_none(fields: Mapping[str, Any], names: tuple[str, ...], what: str) -> bool:
    """Whether ``names`` are all given; ``ValueError`` naming the missing ones when only some are."""
    present = [name for name in names if fields.get(name) is not None]
    if present and len(present) != len(names):
        missing = sorted(set(names) - set(present))
        raise ValueError(f"{what} must be provided together; missing: {', '.join(missing)}")
    return bool(present)


def validate_identity_fields(fields: Mapping[str, Any]) -> None:
    """TensorRT-LLM's ``_validate_lifecycle_identity_fields`` over a mapping of ``disaggregated_params`` values
    (absent and None alike): two all-or-none tuples, canonical distinct UUIDs, a non-empty control endpoint."""
    if _all_or_none(fields, IDENTITY_FIELDS, "Disaggregated lifecycle identity fields"):
        _non_negative_int("logical_request_id", fields["logical_request_id"])
        _non_negative_int("artifact_version", fields["artifact_version"])
        uuids = [parse_canonical_uuid(name, fields[name]) for name in IDENTITY_UUID_FIELDS]
        if len(set(uuids)) != len(uuids):
            raise ValueError("Disaggregated lifecycle UUID fields must be distinct")
    if _all_or_none(fields, GENERATION_ENDPOINT_FIELDS, "Generation endpoint identity fields"):
        name = fields["generation_endpoint_name"]
        if not isinstance(name, str) or not name.strip():
            raise ValueError("generation_endpoint_name must be a non-empty string")
        _non_negative_int("generation_endpoint_rank", fields["generation_endpoint_rank"])
        parse_canonical_uuid("generation_endpoint_incarnation", fields["generation_endpoint_incarnation"])
    control = fields.get("context_control_endpoint")
    if control is not None and (not isinstance(control, str) or not control.strip()):
        raise ValueError("context_control_endpoint must be a non-empty string")


def new_identity(logical_request_id: int) -> dict[str, Any]:
    """A fresh attempt identity, as TensorRT-LLM's orchestrator mints one per request (``_new_lifecycle_identity``):
    the logical id is the request's ``disagg_request_id``, version 0, four new uuid4s."""
    return {"logical_request_id": logical_request_id, "prefill_artifact_id": str(uuid4()), "artifact_version": 0,
            "handoff_attempt_uuid": str(uuid4()), "consumer_grant_id": str(uuid4()),
            "transfer_session_id": str(uuid4())}


def has_identity(fields: Mapping[str, Any]) -> bool:
    """Whether any lifecycle key is set: what makes a request "generation-safe" in TensorRT-LLM's checks."""
    return any(fields.get(name) is not None for name in LIFECYCLE_FIELDS)
