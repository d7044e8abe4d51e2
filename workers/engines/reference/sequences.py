"""What the scheduler (``workers.engines.reference.scheduler``) runs: a request as submitted to the core, and each
of its n sequences while it prefills and decodes."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from frontend.sampling import SamplingParams
from frontend.token_codec import TokenArray
from workers.engines.reference.grammar import TokenConstraint
from workers.engines.reference.sampler import Sampler
from workers.engines.reference.transformer import KVCache


@dataclass(slots=True)
class SubmitSpec:
    request_id: str
    phase: str  # "aggregated" | "context_only" | "generation_only"
    prompt: TokenArray
    placeholder: bool
    max_tokens: int  # the request's output budget, resolved by the worker
    sampling: SamplingParams
    first_gen_tokens: tuple[int, ...] = ()
    handoff_state: bytes | None = None
    more_first_gen_tokens: tuple[tuple[int, ...], ...] = ()  # sequences 1..n-1 of a hand-off

    @property
    def starts(self) -> tuple[tuple[int, ...], ...]:
        """Each sequence's first token(s) from the hand-off, by index."""
        return (self.first_gen_tokens, *self.more_first_gen_tokens)


@dataclass(slots=True)
class Sequence:
    spec: SubmitSpec
    cache: KVCache
    index: int = 0  # which of the request's n sequences
    cached_tokens: int = 0  # prompt tokens loaded from the prefix cache instead of prefilled
    sampler: Sampler | None = None
    prefilled: int = 0
    produced: int = 0
    last_token: int = -1
    prompt_logprobs: list[Any] = field(default_factory=list)
    constraint: TokenConstraint | None = None  # structured output: the grammar's state over this sequence's output
