"""Orchestrator configuration: one immutable object loaded from YAML at start-up (TensorRT-LLM-style names).

An unknown key or a bad value stops start-up with a message that names it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from frontend.http import DEFAULT_MAX_BODY_BYTES, DEFAULT_MAX_BODY_BYTES_READING, DEFAULT_MAX_BODY_READS_PER_TENANT
from frontend.trtllm.config import from_trtllm


class ConfigError(Exception):
    """The configuration cannot be used; the message names the offending key."""


class _Frozen(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class RouterConfig(_Frozen):
    # None: the pool's default (cache_aware for context_servers, round_robin for generation_servers).
    type: Literal["cache_aware", "round_robin", "least_loaded", "prefix_affinity"] | None = None
    load_metric: Literal["requests", "prompt_tokens"] = "requests"  # least_loaded: what "load" counts
    # prefix_affinity: how much of the prompt's start picks the worker, and how far above the mean load a
    # worker may go before its requests spill to the next one on the ring (bounded-load consistent hashing).
    prefix_chars: Annotated[int, Field(ge=1)] = 1024
    load_factor: Annotated[float, Field(ge=1.0)] = 1.25
    # cache_aware (docs/routing.md): the header that names a conversation (Responses turns are keyed by their
    # conversation's first response), and how long a request routed here counts as held by its worker before
    # the worker's own KV events say so.
    session_header: str = "x-session-id"
    pending_s: Annotated[float, Field(gt=0)] = 10.0
    # cache_aware: how fast the work a worker was given stops counting when a new conversation is placed (the
    # weight of a token halves every this many seconds).
    recent_half_s: Annotated[float, Field(gt=0)] = 5.0
    # cache_aware, for a worker that publishes no KV events and whose card says no capacity: the prompt KV
    # (tokens) its engine keeps for reuse, which bounds the model of its cache (None: 262,144).
    kv_capacity_tokens: Annotated[int, Field(gt=0)] | None = None


class DiscoveryConfig(_Frozen):
    """Workers found by re-resolving a DNS name, e.g. a Kubernetes headless service (one A record per pod)."""

    dns_name: str
    port: Annotated[int, Field(ge=1, le=65535)]
    scheme: Literal["http", "https"] = "http"
    interval_s: Annotated[float, Field(gt=0)] = 5.0


class ServerGroupConfig(_Frozen):
    urls: list[str] = []
    discovery: DiscoveryConfig | None = None
    registration: bool = False  # the pool may start empty: workers join with `disagg-serve worker --register`
    router: RouterConfig = RouterConfig()
    # The wire the group's workers speak: "detect" reads it from each worker's /v1/models card (our workers announce
    # theirs; trtllm-serve and vLLM servers are known by owned_by: orchestrator/protocols/registry.py), or name it:
    # "native" (our workers), "trtllm" (trtllm-serve), "vllm" (plain vLLM OpenAI servers started with
    # --kv-transfer-config; orchestrator/protocols/vllm.py).
    protocol: Literal["detect", "native", "trtllm", "vllm"] = "detect"
    # context_servers: prefills one worker is given at once (its running window; 0: no limit). More wait at the
    # orchestrator, by priority class, rather than in the engine's queue (orchestrator/flow/disagg_flow.py).
    max_running_prefills: Annotated[int, Field(ge=0)] = 0

    @model_validator(mode="after")
    def _has_members(self) -> ServerGroupConfig:
        if not self.urls and self.discovery is None and not self.registration:
            raise ValueError("give 'urls', a 'discovery' section, or 'registration: true'")
        return self

    @field_validator("urls")
    @classmethod
    def _http_urls(cls, urls: list[str]) -> list[str]:
        for url in urls:
            if not url.startswith(("http://", "https://")):
                raise ValueError(f"worker URL {url!r} must start with http:// or https://")
        return [url.rstrip("/") for url in urls]


class ResponseStoreConfig(_Frozen):
    """The orchestrator's store of Responses API answers, for ``previous_response_id`` and ``GET``/``DELETE``.

    ``memory``: this process's own (the default: one orchestrator process on one machine). ``redis``: a Redis or
    Valkey server at ``url`` that every process and replica shares (orchestrator/response_store_redis.py).
    Either way bounded by entries and by bytes (the JSON of each stored conversation), least recently used first
    out; an entry expires ``ttl_s`` after it was stored. ``max_entries: 0`` turns the store off.
    """

    backend: Literal["memory", "redis"] = "memory"
    # redis://[user:password@]host:port/db, rediss:// (TLS) or unix://path. It may carry a password: give it as
    # --response-store-url or DISAGG_RESPONSE_STORE_URL, not in this file.
    url: str | None = None
    key_prefix: Annotated[str, Field(min_length=1)] = "disagg:responses"
    # How long a request that needs the store waits for Redis before a 503 (connecting included).
    timeout_s: Annotated[float, Field(gt=0)] = 1.0
    max_entries: Annotated[int, Field(ge=0)] = 10_000
    max_bytes: Annotated[int, Field(ge=1)] = 256 * 1024 * 1024
    ttl_s: Annotated[float, Field(gt=0)] = 3600.0
    # OpenAI's default: a request that does not say ``store`` is stored, so SDK code written against OpenAI
    # (``previous_response_id=reply.id``) works unchanged.
    store_by_default: bool = True

    @model_validator(mode="after")
    def _url_for_redis(self) -> ResponseStoreConfig:
        if self.backend == "redis" and not self.url:
            raise ValueError("backend: redis needs a 'url' (or --response-store-url)")
        if self.backend == "memory" and self.url:
            raise ValueError("'url' is for backend: redis")
        if self.url and not self.url.startswith(("redis://", "rediss://", "unix://")):
            raise ValueError("the response store's url must start with redis://, rediss:// or unix://")
        return self

    @property
    def enabled(self) -> bool:
        return self.max_entries > 0

    @property
    def shared(self) -> bool:
        """Whether every process that names the same store sees the same entries."""
        return self.backend == "redis"


class AdmissionConfig(_Frozen):
    """Requests over ``max_concurrent_requests`` wait in a bounded queue by priority class
    (orchestrator/admission.py, docs/admission.md)."""

    max_queued: Annotated[int, Field(ge=0)] = 1024  # waiting, all classes together; past it a 429 at once
    queue_timeout_s: Annotated[float, Field(gt=0)] = 30.0  # the longest wait in the queue before a 429
    # Running slots only interactive requests may take (a share of max_concurrent_requests), and the share the
    # batch class may hold at most: lower-class bursts always leave interactive room.
    interactive_reserve: Annotated[float, Field(ge=0, lt=1)] = 0.1
    batch_share: Annotated[float, Field(gt=0, le=1)] = 0.5
    priority_header: str = "x-priority"
    # The share of every tenant limit this process enforces: 1 / (orchestrator processes in the deployment), so
    # that together they enforce the deployment's. --api-workers N divides it by N by itself.
    process_share: Annotated[float, Field(gt=0, le=1)] = 1.0


class CircuitBreakerConfig(_Frozen):
    """A worker that fails this many requests in a row gets none for ``cooldown_s``, then one to try it (twice as
    long again if that one fails): orchestrator/circuit_breaker.py."""

    failures: Annotated[int, Field(ge=1)] = 5
    cooldown_s: Annotated[float, Field(gt=0)] = 10.0


class TenantConfig(_Frozen):
    """One API key's identity and limits (orchestrator/tenants.py, docs/admission.md). Unset limits do not apply."""

    name: Annotated[str, Field(min_length=1)]
    api_key_env: Annotated[str, Field(min_length=1)]  # the environment variable that holds its key: not this file
    # Its requests' class when they name none; x-priority may ask for a lower one, never a higher one.
    priority: Literal["interactive", "default", "batch"] = "default"
    max_concurrent: Annotated[int, Field(ge=1)] | None = None
    requests_per_s: Annotated[float, Field(gt=0)] | None = None
    prompt_tokens_per_s: Annotated[float, Field(gt=0)] | None = None
    completion_tokens_per_s: Annotated[float, Field(gt=0)] | None = None
    burst_s: Annotated[float, Field(gt=0)] = 1.0  # each rate's bucket holds this many seconds of it


class TrtllmConfig(_Frozen):
    """How our orchestrator speaks to trtllm-serve workers (orchestrator/protocols/trtllm*.py, docs/interop.md)."""

    # "auto": lifecycle v1 with a CTX/GEN pair whose GET /server_info advertises it, v0 otherwise; "v0": never v1.
    lifecycle_protocol: Literal["auto", "v0"] = "auto"
    # Generation grants (TensorRT-LLM's TRTLLM_DISAGG_GEN_GRANT_TTL_S / _RENEW_INTERVAL_S; renewed every
    # min(interval, remaining / 3)) and the bound on one grant call (TRTLLM_DISAGG_LIFECYCLE_ADMISSION_TIMEOUT_S).
    grant_ttl_s: Annotated[float, Field(gt=0)] = 600.0
    grant_renew_interval_s: Annotated[float, Field(gt=0)] = 200.0
    admission_timeout_s: Annotated[float, Field(gt=0)] = 30.0
    # generation_first: GEN is admitted and sent its request first, CTX right after (TensorRT-LLM's
    # DisaggScheduleStyle.GENERATION_FIRST), for trtllm-serve pairs: v1 ones that advertise GENERATION_FIRST, v0
    # ones on this setting alone. Other workers, and v1 pairs without the capability, stay context-first.
    schedule_style: Literal["context_first", "generation_first"] = "context_first"

    @model_validator(mode="after")
    def _renewed_within_the_ttl(self) -> TrtllmConfig:
        if self.grant_renew_interval_s >= self.grant_ttl_s:
            raise ValueError("trtllm.grant_renew_interval_s must be below grant_ttl_s")
        return self


class PairProbeConfig(_Frozen):
    """The pair probe (orchestrator/pair_probe.py): a tiny disaggregated request through each CTX/GEN pair, checking
    that GEN took the KV from CTX rather than computing the prompt again; a pair that fails is kept out of routing
    until it passes. Off by default: every probe is a prefill and a decode step on each pair's workers (GPU time on
    a real fleet). ``POST /admin/pair-probe`` runs one on demand whatever this says."""

    enabled: bool = False  # at start-up (once the pools' first health check is in), then every interval_s
    interval_s: Annotated[float, Field(gt=0)] = 300.0
    timeout_s: Annotated[float, Field(gt=0)] = 30.0  # one pair's CTX call and GEN call, each
    concurrency: Annotated[int, Field(ge=1)] = 4  # pairs probed at once


class OrchestratorConfig(_Frozen):
    hostname: str = "127.0.0.1"
    port: Annotated[int, Field(ge=0, le=65535)] = 8000
    context_servers: ServerGroupConfig
    generation_servers: ServerGroupConfig
    gen_tokids_ctxbytes: bool = True  # relay CTX's prompt_token_ids_b64 to GEN (the array path)
    gen_tokids_metadata_only: bool = False  # send GEN only prompt_len, behind the guardrail
    # TensorRT-LLM GEN workers: keep only the last chat message (the relayed token ids carry the whole prompt).
    gen_strip_message_history: bool = False
    request_timeout_s: Annotated[float, Field(gt=0)] = 600.0
    connect_timeout_s: Annotated[float, Field(gt=0)] = 5.0
    max_retries: Annotated[int, Field(ge=0, le=10)] = 1
    # A GEN stream that breaks after the client has part of the answer continues on another GEN worker, at most
    # this many times per request (0: never; the stream then ends with an error event).
    migration_limit: Annotated[int, Field(ge=0, le=10)] = 2
    # The HTTP client of the calls to workers (orchestrator/upstream/choice.py: make_transport).
    upstream_client: Literal["httptools", "aiohttp"] = "httptools"
    health_check_interval_s: Annotated[float, Field(gt=0)] = 2.0
    max_body_bytes: Annotated[int, Field(ge=1024)] = DEFAULT_MAX_BODY_BYTES
    max_concurrent_requests: Annotated[int, Field(ge=1)] = 1024  # running at once; more wait (admission)
    admission: AdmissionConfig = AdmissionConfig()
    tenants: list[TenantConfig] = []
    circuit_breaker: CircuitBreakerConfig = CircuitBreakerConfig()
    # Bytes received of request bodies not yet whole (frontend/http.py: BodyBudget); past it, a 429 for the body
    # whose bytes do not fit. A declared length counts for nothing.
    max_body_bytes_reading: Annotated[int, Field(ge=1024)] = DEFAULT_MAX_BODY_BYTES_READING
    # Request bodies one tenant may have being read at once (frontend/http.py: BodyReads; 0: no cap).
    max_body_reads_per_tenant: Annotated[int, Field(ge=0)] = DEFAULT_MAX_BODY_READS_PER_TENANT
    # Health: a worker leaves its pool after this many failed checks in a row, and returns after this many good.
    health_failure_threshold: Annotated[int, Field(ge=1)] = 2
    health_recovery_threshold: Annotated[int, Field(ge=1)] = 1
    # Conditional disaggregation: prompts estimated under this many tokens go to GEN alone (0 = always split).
    max_local_prefill_length: Annotated[int, Field(ge=0)] = 0
    response_store: ResponseStoreConfig = ResponseStoreConfig()
    trtllm: TrtllmConfig = TrtllmConfig()
    pair_probe: PairProbeConfig = PairProbeConfig()
    # Secrets come from the environment (DISAGG_API_KEY, DISAGG_ADMIN_KEY) or the command line, not this file.

    @field_validator("upstream_client", mode="before")
    @classmethod
    def _httpx_is_gone(cls, value: object) -> object:
        if value == "httpx":
            raise ValueError("the httpx client was removed: use httptools (the default) or aiohttp")
        return value

    @model_validator(mode="after")
    def _prefill_window_on_ctx(self) -> OrchestratorConfig:
        if self.generation_servers.max_running_prefills:
            raise ValueError("max_running_prefills is a context_servers setting: GEN workers prefill nothing "
                             "the orchestrator sends them through CTX")
        return self

    @model_validator(mode="after")
    def _tenants_apart(self) -> OrchestratorConfig:
        names = [tenant.name for tenant in self.tenants]
        if len(set(names)) != len(names):
            raise ValueError("each tenant needs a name of its own")
        return self

    @model_validator(mode="after")
    def _one_protocol(self) -> OrchestratorConfig:
        # vLLM's P/D wire pairs a vLLM prefill server with a vLLM decode server (D reads P's kv_transfer_params);
        # vLLM servers take no length-only prompt.
        vllm = [group.protocol == "vllm" for group in (self.context_servers, self.generation_servers)]
        if any(vllm) and not all(vllm):
            raise ValueError("protocol: vllm must be set on both context_servers and generation_servers")
        if all(vllm) and self.gen_tokids_metadata_only:
            raise ValueError("gen_tokids_metadata_only needs the native protocol: vLLM servers need the prompt")
        return self


def for_one_of_several_front_ends(config: OrchestratorConfig, processes: int = 1) -> OrchestratorConfig:
    """``config`` for one of ``processes`` sharing a port (``--api-workers N``): a memory store is turned off,
    since a follow-up answered by another process would not find its turn, while a shared (Redis) store stays; and
    each process enforces its share of every tenant limit."""
    admission = config.admission.model_copy(update={"process_share": config.admission.process_share / processes})
    config = config.model_copy(update={"admission": admission})
    if config.response_store.shared:
        return config
    store = config.response_store.model_copy(update={"max_entries": 0})
    return config.model_copy(update={"response_store": store})


def parse_config(raw: Any, source: str = "config") -> OrchestratorConfig:
    if not isinstance(raw, dict):
        raise ConfigError(f"{source}: the configuration must be a mapping of keys to values")
    try:
        raw = from_trtllm(raw)  # a trtllm-serve disaggregated config is accepted as written
    except ValueError as exc:
        raise ConfigError(f"{source}: {exc}") from exc
    try:
        return OrchestratorConfig.model_validate(raw)
    except ValidationError as exc:
        problems = []
        for error in exc.errors(include_url=False):
            key = ".".join(str(p) for p in error["loc"])
            if error["type"] == "extra_forbidden":
                problems.append(f"unknown key '{key}'")
            elif error["type"] == "missing":
                problems.append(f"missing key '{key}'")
            else:
                problems.append(f"bad value for '{key}': {error['msg']}")
        raise ConfigError(f"{source}: " + "; ".join(problems)) from exc


def load_config(path: str | Path, *, response_store_url: str | None = None, **overrides: Any) -> OrchestratorConfig:
    """The file's configuration; top-level keys in ``overrides`` (None: not given) and ``response_store_url``
    (``--response-store-url``: the Redis store at that URL) win over the file's."""
    path = Path(path)
    try:
        raw = yaml.safe_load(path.read_text()) or {}
    except OSError as exc:
        raise ConfigError(f"cannot read config file {path}: {exc.strerror}") from exc
    except yaml.YAMLError as exc:
        raise ConfigError(f"{path}: not valid YAML: {exc}") from exc
    if isinstance(raw, dict):
        raw.update({k: v for k, v in overrides.items() if v is not None})
        if response_store_url:
            store = raw.get("response_store")
            raw["response_store"] = {**(store if isinstance(store, dict) else {}), "backend": "redis",
                                     "url": response_store_url}
    return parse_config(raw, str(path))
