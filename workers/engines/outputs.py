"""What an engine says about itself and what it yields: ``EngineInfo``, ``EngineOutput``, ``TokenLogprob``."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from frontend.token_codec import TokenArray

FinishReason = Literal["stop", "length", "abort"]


@dataclass(frozen=True, slots=True)
class EngineInfo:
    """Facts about an engine that the front end and the orchestrator's guardrail rely on."""

    engine: str  # "synthetic", "reference", ...
    model: str  # the served model name
    vocab_size: int
    max_context: int  # prompt + output tokens
    model_hash: str = ""
    kv_block_reuse: bool = False  # blocks keyed by token-value hashes: placeholders would collide
    prompt_tokens_in_handoff: bool = False  # the KV hand-off carries the prompt's real int32 ids
    supports_logprobs: bool = True
    supports_structured_output: bool = False  # JSON schema constrained decoding (response_format, forced tools)
    supports_n: bool = False  # n > 1 sequences per request, from one prefill


@dataclass(frozen=True, slots=True)
class TokenLogprob:
    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


@dataclass(frozen=True, slots=True)
class EngineOutput:
    """New tokens of one step of sequence ``index`` (0 unless the request asked for n > 1). Each sequence's
    last output carries its ``finish_reason``; the request ends when every sequence has finished.

    A CONTEXT_ONLY request yields one output per sequence: its first token; the last one carries
    ``handoff_state`` (the opaque bytes GEN needs to continue every unfinished sequence) unless all finished, in
    which case the engine has freed its KV. A GENERATION_ONLY request's first output confirms that the hand-off
    was accepted (it may hold no tokens); a hand-off the engine cannot use raises before it. The front end opens
    each sequence of a GENERATION_ONLY answer with the hand-off's first token(s), CTX's, unless that first output
    says ``chose_first_tokens``: the engine chose every sequence's first token(s) again (vLLM's P/D: the decode
    side's choice is the answer's) and its outputs carry them, so CTX's are not part of the answer.
    """

    token_ids: tuple[int, ...]
    logprobs: tuple[TokenLogprob, ...] = ()
    finish_reason: FinishReason | None = None
    handoff_state: bytes | None = None
    prompt_logprobs: tuple[TokenLogprob | None, ...] | None = None  # first output only, when asked for
    prompt_token_ids: TokenArray | None = None  # the real prompt, when the request had a placeholder (echo)
    index: int = 0  # which of the request's n sequences
    cached_tokens: int = 0  # first output only: prompt tokens whose KV was reused (block reuse), not computed
    chose_first_tokens: bool = False  # GENERATION_ONLY, first output only: see above
    # GENERATION_ONLY, first output only: prompt tokens this engine prefilled itself because their KV did not come
    # through the hand-off (a failed transfer it recovered from by computing them: frontend/prompt_report.py)
    recomputed_tokens: int = 0
