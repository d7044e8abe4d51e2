"""Validated sampling parameters: what the engine is allowed to see of a request's sampling fields."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class SamplingParams:
    max_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: tuple[tuple[int, float], ...] = ()
    logprobs: int | None = None  # None: none; 0: the chosen token only; k: plus the top k alternatives
    prompt_logprobs: int | None = None
    echo: bool = False
    ignore_eos: bool = False

    @property
    def reads_prompt_token_values(self) -> tuple[str, ...]:
        """The sampling features that read prompt token *values* (not just the prompt length), by name."""
        reasons = []
        if self.frequency_penalty:
            reasons.append("frequency_penalty")
        if self.presence_penalty:
            reasons.append("presence_penalty")
        if self.repetition_penalty != 1.0:
            reasons.append("repetition_penalty")
        if self.echo:
            reasons.append("echo")
        if self.prompt_logprobs is not None:
            reasons.append("prompt_logprobs")
        if self.logit_bias:
            reasons.append("logit_bias")
        return tuple(reasons)
