"""A request on its way through the worker: prepared (every check passed), then its output collected."""

from __future__ import annotations

from dataclasses import dataclass, field
from uuid import UUID

from frontend.disaggregated_params import DisaggregatedParams
from frontend.openai_models import GenerationWireRequest
from frontend.openai_output import ResponseIdentity
from frontend.prefix_chain import PrefixChain
from frontend.token_codec import TokenArray
from workers.engines.outputs import FinishReason, TokenLogprob
from workers.engines.request import GenerationRequest
from workers.text_stream import TextStep


@dataclass(slots=True)
class PreparedGeneration:
    """A request that passed every check and is ready to run."""

    wire: GenerationWireRequest
    request: GenerationRequest
    ident: ResponseIdentity
    disagg: DisaggregatedParams | None
    tool_call: bool = False  # the output is a forced tool call, answered as message.tool_calls
    answered_at_context: bool = False  # CTX's first tokens used up max_tokens: they are the whole answer
    chain: PrefixChain | None = None  # the prompt's prefix chain, recorded once the engine holds its KV
    grant: UUID | None = None  # lifecycle v1: the generation grant this GEN request runs under


@dataclass(slots=True)
class CollectedChoice:
    """One sequence's whole output."""

    text_parts: list[str] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    finish_reason: FinishReason | None = None


@dataclass(slots=True)
class CollectedOutput:
    choices: list[CollectedChoice]  # one per sequence, by index
    handoff_state: bytes | None = None
    prompt_logprobs: tuple[TokenLogprob | None, ...] | None = None
    real_prompt: TokenArray | None = None  # from the engine, when this request had a placeholder prompt
    cached_tokens: int = 0

    def add(self, step: TextStep) -> None:
        choice = self.choices[step.index]
        choice.text_parts.append(step.text)
        choice.token_ids.extend(step.token_ids)
        choice.logprobs.extend(step.logprobs)
        choice.finish_reason = step.finish_reason or choice.finish_reason
        self.handoff_state = step.handoff_state or self.handoff_state
        self.cached_tokens = step.cached_tokens or self.cached_tokens
        if step.prompt_logprobs is not None:
            self.prompt_logprobs = step.prompt_logprobs
        if step.prompt_token_ids is not None:
            self.real_prompt = step.prompt_token_ids

    @property
    def completion_tokens(self) -> int:
        return sum(len(choice.token_ids) for choice in self.choices)
