"""A worker's settings: one immutable value, built once at start-up (``entrypoints/cli.py``) and passed in."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from frontend.http import DEFAULT_MAX_BODY_BYTES_READING
from frontend.internal_secret import InternalSecret
from workers.drain import DEFAULT_DRAIN_TIMEOUT_S
from workers.trtllm.settings import LifecycleSettings

Role = Literal["context", "generation", "both"]  # what a worker serves: CTX, GEN, or both (aggregated)


@dataclass(frozen=True, slots=True)
class WorkerSettings:
    role: Role = "both"
    max_body_bytes: int = 64 * 1024 * 1024
    max_concurrent_requests: int = 512
    max_body_bytes_reading: int = DEFAULT_MAX_BODY_BYTES_READING  # frontend/http.py: BodyBudget
    admin_key: str | None = None  # guards the worker's admin endpoints (the hand-off ledger); None: they answer 403
    # KV events (workers/prefix_holdings.py): where the publisher binds (ZMQ; port 0: any) and its replay socket.
    # None: no events / no replay. Published only by an engine that reuses KV (``ReportsKvCapacity``).
    kv_events_endpoint: str | None = "tcp://127.0.0.1:0"
    kv_events_replay_endpoint: str | None = "tcp://127.0.0.1:0"
    # TensorRT-LLM's lifecycle protocol (workers/trtllm/lifecycle.py): v0 unless turned on, as in TensorRT-LLM.
    lifecycle: LifecycleSettings = field(default_factory=LifecycleSettings)
    # The deployment secret (frontend/internal_secret.py): with one, the internal routes (workers/trtllm/routes.py)
    # answer its holders only, and this worker's own calls to its peers carry it. None: open, as on a laptop.
    internal_secret: InternalSecret | None = None
    # TensorRT-LLM's own internal authentication key (``internal_request_auth_key``; frontend/trtllm/auth.py), for a
    # worker behind TensorRT-LLM's orchestrator: its signatures are checked when one is set.
    trtllm_auth_key: str | None = None
    # Where this worker's peers reach it (``--advertise-url``): what /server_info and a grant name, never the
    # caller's Host header. None: the address the connection came in on.
    advertise_url: str | None = None
    # The tool-call format of ``tool_choice: "auto"`` answers (``--tool-call-parser``; frontend/tool_parsers/).
    # None: the one the model's chat template declares.
    tool_call_parser: str | None = None
    # SIGTERM's drain (workers/drain.py): how long the requests in flight may take to finish before they are cut.
    drain_timeout_s: float = DEFAULT_DRAIN_TIMEOUT_S
