"""TensorRT-LLM's disaggregated lifecycle protocol v1: its wire models, as TensorRT-LLM defines them.

Written from TensorRT-LLM's source (snapshots 91c7f67 / 0e63c12 of ``tensorrt_llm/serve/disagg_lifecycle_control.py``,
``tensorrt_llm/disaggregated_params.py``, ``tensorrt_llm/_torch/disaggregation/{protocol,capability_negotiation,
lifecycle}.py``): facts, not code. Both sides of this project build on it: our orchestrator when it drives
trtllm-serve workers under v1 (direction A), our workers when TensorRT-LLM's orchestrator drives them (direction B).

What v1 adds to the v0 wire:
- an attempt identity minted by the orchestrator (six fields, all or none) that rides in ``disaggregated_params``
  of both legs and is echoed by the CTX answer, and the GEN endpoint's identity (a second all-or-none triple)
  returned by a *generation grant* (both in ``frontend.trtllm.identity``);
- each worker's ``context_transceiver_lifecycle`` advertisement (exactly ten keys) in ``GET /server_info``, which
  the orchestrator negotiates CTX against GEN (``negotiate``);
- the control plane: grant / renew / abort on GEN, context-artifact abort on CTX, bodies that refuse unknown fields
  and carry ``lifecycle_protocol_version: 1``.

Messages of the validators are TensorRT-LLM's own where its source states them, so a test can compare an error of
ours with one of theirs.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from enum import IntEnum, StrEnum
from typing import Any, Literal
from urllib.parse import urlsplit, urlunsplit
from uuid import UUID

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, model_validator

from frontend.trtllm.identity import parse_canonical_uuid

# -- switches (TensorRT-LLM reads them on every process; v1 is an explicit opt-in everywhere) ---------------------
PROTOCOL_VERSION_ENV = "TRTLLM_DISAGG_LIFECYCLE_PROTOCOL_VERSION"
GRANT_TTL_ENV = "TRTLLM_DISAGG_GEN_GRANT_TTL_S"
GRANT_RENEW_INTERVAL_ENV = "TRTLLM_DISAGG_GEN_GRANT_RENEW_INTERVAL_S"
ARTIFACT_TTL_ENV = "TRTLLM_DISAGG_ARTIFACT_TTL_S"
ADMISSION_TIMEOUT_ENV = "TRTLLM_DISAGG_LIFECYCLE_ADMISSION_TIMEOUT_S"

DEFAULT_GRANT_TTL_S = 600.0
DEFAULT_GRANT_RENEW_INTERVAL_S = 200.0
DEFAULT_ARTIFACT_TTL_S = 60.0

QUALIFIED_LEGACY = 0  # TensorRT-LLM's ProtocolVersion.QUALIFIED_LEGACY: today's v0 wire
GENERATION_SAFE = 1  # ProtocolVersion.GENERATION_SAFE: lifecycle v1


def protocol_version_from_env(environ: Mapping[str, str] | None = None) -> int:
    """The lifecycle protocol version this process runs, read as TensorRT-LLM reads it (unset is v0)."""
    raw = (os.environ if environ is None else environ).get(PROTOCOL_VERSION_ENV, "0").strip() or "0"
    try:
        version = int(raw)
    except ValueError:
        version = -1
    if version not in (QUALIFIED_LEGACY, GENERATION_SAFE):
        raise ValueError(f"{PROTOCOL_VERSION_ENV} must be 0 or 1, not {raw!r}")
    return version


# -- routes (registered by role: grants on GEN, artifact calls on CTX) ---------------------------------------
GENERATION_GRANT_PATH = "/_internal/disagg_lifecycle/generation_grant"
GENERATION_GRANT_RENEW_PATH = "/_internal/disagg_lifecycle/generation_grant/renew"
GENERATION_GRANT_ABORT_PATH = "/_internal/disagg_lifecycle/generation_grant/abort"
ARTIFACT_OBLIGATION_PATH = "/_internal/disagg_lifecycle/artifact_obligation"  # GEN worker -> CTX worker
CONTEXT_ARTIFACT_ABORT_PATH = "/_internal/disagg_lifecycle/context_artifact/abort"
SERVER_INFO_PATH = "/server_info"  # where a worker publishes its advertisement
CONTROL_UNAVAILABLE = "disaggregated lifecycle control is unavailable"  # the 404's detail with v1 off


def control_url(endpoint: str, path: str) -> str:
    """The URL of ``path`` on the worker a ``context_control_endpoint`` names (``host:port``, as TensorRT-LLM's router
    names a server, or an ``http(s)://`` base URL). The endpoint comes from whoever sent the grant, and the worker
    POSTs to it later: so only a plain http(s) origin is taken (no path, userinfo, query or fragment, no other
    scheme: a path prefix would let the caller aim the POST at any path of any host, e.g. a metadata service's),
    and the URL is rebuilt from its parsed parts, so nothing can move ``path`` out of the path.
    ``ValueError`` for anything else."""
    raw = endpoint
    if any(ch.isspace() or ord(ch) < 0x20 or ch == "\x7f" for ch in raw):
        raise ValueError("context_control_endpoint must not contain whitespace or control characters")
    parts = urlsplit(raw if "://" in raw else "http://" + raw)
    if parts.scheme not in ("http", "https"):
        raise ValueError("context_control_endpoint must be host:port or an http(s) URL")
    if parts.username is not None or parts.password is not None or "@" in parts.netloc:
        raise ValueError("context_control_endpoint must not carry credentials")
    if parts.query or parts.fragment or "?" in raw or "#" in raw:
        raise ValueError("context_control_endpoint must not carry a query or a fragment")
    if parts.path not in ("", "/"):
        raise ValueError("context_control_endpoint must be a server's address (host:port or an http(s) origin), "
                         "not a path")
    try:
        port = parts.port
    except ValueError as error:
        raise ValueError(f"context_control_endpoint has an invalid port: {error}") from None
    if not parts.hostname:
        raise ValueError("context_control_endpoint must name a host")
    host = f"[{parts.hostname}]" if ":" in parts.hostname else parts.hostname
    netloc = host if port is None else f"{host}:{port}"
    return urlunsplit((parts.scheme, netloc, path, "", ""))


class ScheduleStyle(IntEnum):
    """``DisaggScheduleStyle``: an int on the wire (``disaggregated_params.schedule_style``)."""

    CONTEXT_FIRST = 0
    GENERATION_FIRST = 1


class LifecycleCapability(StrEnum):
    ATTEMPT_IDENTITY = "ATTEMPT_IDENTITY"
    ENDPOINT_INCARNATION = "ENDPOINT_INCARNATION"
    ALLOCATION_GENERATION_LEASES = "ALLOCATION_GENERATION_LEASES"
    CANCEL_BEFORE_CREATE_TOMBSTONES = "CANCEL_BEFORE_CREATE_TOMBSTONES"
    PUBLICATION_GATE = "PUBLICATION_GATE"
    IN_FLIGHT_CANCELLATION = "IN_FLIGHT_CANCELLATION"
    EXACT_WRITER_TRACKING = "EXACT_WRITER_TRACKING"
    SUBMISSION_FENCE = "SUBMISSION_FENCE"
    PER_OPERATION_QUIESCENCE = "PER_OPERATION_QUIESCENCE"
    ENDPOINT_WIDE_QUIESCENCE = "ENDPOINT_WIDE_QUIESCENCE"
    DIRECT_TRANSFER = "DIRECT_TRANSFER"
    BOUNCE_TRANSFER = "BOUNCE_TRANSFER"
    MULTI_WRITER = "MULTI_WRITER"
    GENERATION_FIRST = "GENERATION_FIRST"
    PIPELINE_PARALLEL = "PIPELINE_PARALLEL"
    TENSOR_PARALLEL = "TENSOR_PARALLEL"
    ATTENTION_DATA_PARALLEL = "ATTENTION_DATA_PARALLEL"
    TERMINAL_RESULT_REPLAY = "TERMINAL_RESULT_REPLAY"


PROTOCOL_V1_REQUIRED_CAPABILITIES: frozenset[str] = frozenset(c.value for c in (
    LifecycleCapability.ALLOCATION_GENERATION_LEASES,
    LifecycleCapability.ATTEMPT_IDENTITY,
    LifecycleCapability.CANCEL_BEFORE_CREATE_TOMBSTONES,
    LifecycleCapability.ENDPOINT_INCARNATION,
    LifecycleCapability.EXACT_WRITER_TRACKING,
    LifecycleCapability.PER_OPERATION_QUIESCENCE,
    LifecycleCapability.PUBLICATION_GATE,
    LifecycleCapability.SUBMISSION_FENCE,
    LifecycleCapability.TERMINAL_RESULT_REPLAY,
))


class GrantState(StrEnum):
    """``ObligationResponse.state`` for a generation grant."""

    ACTIVE = "ACTIVE"
    REVOKED = "REVOKED"
    RELEASED = "RELEASED"


class ArtifactState(StrEnum):
    """``ObligationResponse.state`` for a context artifact."""

    ACTIVE = "ACTIVE"
    ABANDONED = "ABANDONED"
    RELEASED = "RELEASED"


# -- the advertisement ------------------------------------------------------------------------------------------
ADVERTISEMENT_KEYS = frozenset({"protocol_version", "capabilities", "qualified_legacy_mode", "backend",
                                "instance_id", "world_size", "tp_size", "pp_size", "cp_size", "attention_dp"})


class TransceiverLifecycleAdvertisement(BaseModel):
    """``context_transceiver_lifecycle``: one endpoint's immutable lifecycle contract, exactly these ten keys.

    ``instance_id`` is the endpoint's incarnation: a restarted worker advertises a new one, which is how a
    stale grant or artifact call is told from a current one."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    protocol_version: StrictInt = Field(ge=0)
    capabilities: tuple[str, ...]
    qualified_legacy_mode: StrictBool
    backend: Literal["python", "cpp"]
    instance_id: str
    world_size: StrictInt = Field(gt=0)
    tp_size: StrictInt = Field(gt=0)
    pp_size: StrictInt = Field(gt=0)
    cp_size: StrictInt = Field(gt=0)
    attention_dp: StrictBool

    @model_validator(mode="before")
    @classmethod
    def _exact_schema(cls, value: Any) -> Any:
        if isinstance(value, cls):
            return value
        if not isinstance(value, Mapping):
            raise ValueError("context_transceiver_lifecycle must be a dictionary")
        keys = frozenset(value)
        if keys != ADVERTISEMENT_KEYS:
            details = []
            if missing := sorted(ADVERTISEMENT_KEYS - keys):
                details.append(f"missing: {', '.join(missing)}")
            if extra := sorted(str(key) for key in keys - ADVERTISEMENT_KEYS):
                details.append(f"extra: {', '.join(extra)}")
            raise ValueError(f"context_transceiver_lifecycle has an invalid schema ({'; '.join(details)})")
        capabilities = value["capabilities"]
        if not isinstance(capabilities, (list, tuple)) or any(
                not isinstance(c, str) or not c for c in capabilities) or tuple(capabilities) != tuple(
                sorted(set(capabilities))):
            raise ValueError("transceiver lifecycle capabilities must be a sorted tuple of unique non-empty strings")
        parse_canonical_uuid("transceiver lifecycle instance_id", value["instance_id"])
        return value

    @property
    def incarnation(self) -> UUID:
        return UUID(self.instance_id)

    def to_dict(self) -> dict[str, Any]:
        """The wire form (``capabilities`` a list), as TensorRT-LLM's ``to_dict`` writes it."""
        return self.model_dump(mode="json")


def make_advertisement(*, protocol_version: int, capabilities: set[str] | frozenset[str], instance_id: str,
                       backend: Literal["python", "cpp"] = "python", world_size: int = 1, tp_size: int = 1,
                       pp_size: int = 1, cp_size: int = 1,
                       attention_dp: bool = False) -> TransceiverLifecycleAdvertisement:
    """An advertisement in canonical form (capabilities sorted), checked as a peer would check it."""
    advertisement = TransceiverLifecycleAdvertisement.model_validate({
        "protocol_version": protocol_version, "capabilities": sorted(capabilities),
        "qualified_legacy_mode": protocol_version == QUALIFIED_LEGACY, "backend": backend,
        "instance_id": instance_id, "world_size": world_size, "tp_size": tp_size, "pp_size": pp_size,
        "cp_size": cp_size, "attention_dp": attention_dp})
    validate_protocol_advertisement(advertisement)
    return advertisement


# -- negotiation ----------------------------------------------------------------------------------------------------
class LifecycleNegotiationError(RuntimeError):
    """An incompatible pair of endpoints, found before any cross-side obligation exists. A RuntimeError as in
    TensorRT-LLM, where a grant handler answers it with ``accepted: false`` and a worker's request check with 400."""


def validate_protocol_advertisement(advertisement: TransceiverLifecycleAdvertisement) -> None:
    """An endpoint never advertises half of v1: v0 qualifies legacy mode, v1 does not and has every required
    capability (TensorRT-LLM's ``validate_protocol_advertisement``; a ValueError)."""
    version = advertisement.protocol_version
    if version == QUALIFIED_LEGACY:
        if not advertisement.qualified_legacy_mode:
            raise ValueError("protocol-v0 advertisement must explicitly qualify legacy mode")
        return
    if version != GENERATION_SAFE:
        raise ValueError(f"unsupported protocol_version {version}")
    if advertisement.qualified_legacy_mode:
        raise ValueError("protocol-v1 advertisement cannot also select qualified legacy mode")
    if missing := PROTOCOL_V1_REQUIRED_CAPABILITIES - set(advertisement.capabilities):
        raise ValueError("protocol-v1 advertisement is missing required capabilities: " + ", ".join(sorted(missing)))


def validate_generation_safe_advertisement(advertisement: TransceiverLifecycleAdvertisement, *, role: str) -> None:
    if advertisement.protocol_version != GENERATION_SAFE:
        raise LifecycleNegotiationError(f"{role} transceiver does not advertise lifecycle protocol v1")
    if advertisement.backend != "python":
        raise LifecycleNegotiationError(
            f"{role} transceiver backend {advertisement.backend!r} is not qualified for lifecycle protocol v1")
    try:
        validate_protocol_advertisement(advertisement)
    except ValueError as error:
        raise LifecycleNegotiationError(
            f"{role} transceiver has an invalid lifecycle advertisement: {error}") from error


def negotiate(source: TransceiverLifecycleAdvertisement | Mapping[str, Any],
              destination: TransceiverLifecycleAdvertisement | Mapping[str, Any], *,
              schedule_style: int, ctx_dp_rank: int | None = None) -> frozenset[str]:
    """Check a CTX (source) advertisement against a GEN (destination) one for one schedule style, as TensorRT-LLM's
    ``negotiate_generation_safe_lifecycle`` does; returns the capabilities the pair needs, raises
    ``LifecycleNegotiationError`` (a bad mapping raises pydantic's ValidationError, a ValueError)."""
    ctx = TransceiverLifecycleAdvertisement.model_validate(source)
    gen = TransceiverLifecycleAdvertisement.model_validate(destination)
    for role, advertisement in (("context", ctx), ("generation", gen)):
        validate_generation_safe_advertisement(advertisement, role=role)
    required = set(PROTOCOL_V1_REQUIRED_CAPABILITIES) | {LifecycleCapability.DIRECT_TRANSFER.value}
    if ctx.tp_size > 1 or gen.tp_size > 1:
        required.add(LifecycleCapability.TENSOR_PARALLEL.value)
    if ctx.pp_size > 1 or gen.pp_size > 1:
        required.add(LifecycleCapability.PIPELINE_PARALLEL.value)
    if ctx.attention_dp or gen.attention_dp:
        required.add(LifecycleCapability.ATTENTION_DATA_PARALLEL.value)
    if schedule_style == ScheduleStyle.GENERATION_FIRST:
        required.add(LifecycleCapability.GENERATION_FIRST.value)
        if ctx.attention_dp and ctx_dp_rank is None:
            raise LifecycleNegotiationError("generation-first attention-DP requires an exact context writer rank "
                                            "before destination publication")
    elif schedule_style != ScheduleStyle.CONTEXT_FIRST:
        raise LifecycleNegotiationError(f"unsupported disaggregated schedule style {schedule_style!r}")
    for role, advertisement in (("context", ctx), ("generation", gen)):
        if missing := required - set(advertisement.capabilities):
            raise LifecycleNegotiationError(f"{role} transceiver is missing lifecycle capabilities: "
                                            + ", ".join(sorted(missing)))
    return frozenset(required)


# -- the control plane's bodies (JSON both ways, never msgpack) -----------------------------------------------------
# TensorRT-LLM types these with pydantic's lax ``int`` / ``UUID``: the same here, so a body its orchestrator sends
# validates exactly as it would on a trtllm-serve worker. Its orchestrator dumps with ``mode="json"``: UUIDs travel
# as canonical strings.
class _StrictControlModel(BaseModel):
    model_config = ConfigDict(extra="forbid")

    lifecycle_protocol_version: Literal[1]


class AttemptControlFields(_StrictControlModel):
    logical_request_id: int = Field(ge=0)
    prefill_artifact_id: UUID
    artifact_version: int = Field(ge=0)
    handoff_attempt_uuid: UUID
    consumer_grant_id: UUID
    transfer_session_id: UUID


class GenerationGrantRequest(AttemptControlFields):
    """Orchestrator -> GEN ``POST GENERATION_GRANT_PATH``: admit one attempt before anything is sent to GEN."""

    ttl_s: float = Field(gt=0)  # what the orchestrator asks; the worker applies its own TTL
    context_control_endpoint: str | None = Field(default=None, min_length=1)
    context_transceiver_lifecycle: TransceiverLifecycleAdvertisement
    schedule_style: ScheduleStyle
    ctx_dp_rank: int | None = Field(default=None, ge=0)


class GenerationGrantDecisionResponse(_StrictControlModel):
    """GEN's answer to a grant request (always 200 when the body was valid and not a conflict)."""

    accepted: bool
    reason: str = ""
    generation_endpoint_name: str | None = None
    generation_endpoint_rank: int | None = Field(default=None, ge=0)
    generation_endpoint_incarnation: UUID | None = None
    generation_transceiver_lifecycle: TransceiverLifecycleAdvertisement | None = None
    ttl_s: float | None = Field(default=None, gt=0)  # seconds left on the grant


class GenerationGrantIdentityFields(AttemptControlFields):
    generation_endpoint_name: str = Field(min_length=1)
    generation_endpoint_rank: int = Field(ge=0)
    generation_endpoint_incarnation: UUID


class GenerationGrantRenewRequest(GenerationGrantIdentityFields):
    ttl_s: float = Field(gt=0)
    sequence: int = Field(ge=0)  # a sequence at or below the last one seen is a no-op


class GenerationGrantAbortRequest(GenerationGrantIdentityFields):
    reason: str = Field(default="generation request abandoned", min_length=1)


class ContextArtifactAbortRequest(AttemptControlFields):
    """Orchestrator (or GEN) -> CTX ``POST CONTEXT_ARTIFACT_ABORT_PATH``: free what CTX holds for the attempt."""

    context_endpoint_incarnation: UUID
    reason: str = Field(default="context artifact abandoned", min_length=1)


class ArtifactControlAction(StrEnum):
    RENEW = "renew"
    RELEASE = "release"
    ABORT = "abort"


class ArtifactObligationRequest(GenerationGrantRenewRequest):
    """GEN worker -> CTX worker ``POST ARTIFACT_OBLIGATION_PATH`` (no orchestrator involved)."""

    action: ArtifactControlAction
    sequence: int = Field(default=0, ge=0)
    context_endpoint_incarnation: UUID


class ObligationResponse(_StrictControlModel):
    """The answer to renew, abort, artifact obligation and context-artifact abort. ``state`` is a plain string in
    TensorRT-LLM (``GrantState`` / ``ArtifactState`` values); its orchestrator reads only ``accepted``."""

    accepted: bool
    state: str
    reason: str = ""
    ttl_s: float | None = Field(default=None, gt=0)
    artifact_ready: bool | None = None
    context_endpoint_incarnation: UUID | None = None
