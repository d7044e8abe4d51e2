"""The synthetic engine: computes nothing, emits deterministic text with a configured TTFT and inter-token latency.

For load tests of the front end alone, where a real model would hide the front end's own cost. It never reads
prompt token values (only the prompt length), so it is also the cleanest witness that the array path builds no
list. Output token i is byte i (mod the length) of a fixed text, so aggregated and disaggregated runs agree.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator
from dataclasses import replace

import orjson

from frontend.errors import HandoffError
from workers.engines.base import Tokenizer
from workers.engines.byte_tokenizer import BYTE_TOKENS, ByteTokenizer
from workers.engines.options import EngineOptions, SyntheticConfig
from workers.engines.outputs import EngineInfo, EngineOutput, FinishReason, TokenLogprob
from workers.engines.request import GenerationRequest, Phase

__all__ = ["EOS_TOKEN_ID", "SYNTHETIC_TEXT", "SyntheticConfig", "SyntheticEngine", "create", "synthetic_text"]

SYNTHETIC_TEXT = b"The quick brown fox jumps over the lazy dog. "
EOS_TOKEN_ID = BYTE_TOKENS  # 256


def create(options: EngineOptions) -> SyntheticEngine:
    """The factory ``workers.engines.factory`` calls for ``--engine synthetic``."""
    config = options.synthetic
    if options.served_model_name:
        config = replace(config, model=options.served_model_name)
    return SyntheticEngine(config)


# The output rules, shared with the simulated engine (workers/engines/simulated.py), which answers alike.
def token_at(position: int, output_tokens: int | None) -> int:
    """Output token ``position``: byte ``position`` (mod its length) of a fixed text, EOS from ``output_tokens``."""
    if output_tokens is not None and position >= output_tokens:
        return EOS_TOKEN_ID
    return SYNTHETIC_TEXT[position % len(SYNTHETIC_TEXT)]


def synthetic_text(tokens: int) -> str:
    """The text of an answer ``tokens`` long: what a client that checks the relay expects, byte for byte."""
    return bytes(SYNTHETIC_TEXT[i % len(SYNTHETIC_TEXT)] for i in range(tokens)).decode()


def certain_logprobs(token: int, top: int | None) -> tuple[TokenLogprob, ...]:
    """The engine is certain of every token: probability 1, alternatives effectively impossible."""
    if top is None:
        return ()
    alternatives = tuple((token + i, -100.0) for i in range(1, top))
    return (TokenLogprob(token, 0.0, ((token, 0.0), *alternatives)),)


def first_output(request: GenerationRequest, engine: str, output_tokens: int | None,
                 cached_tokens: int = 0) -> EngineOutput:
    """A context-only or whole request's first output, its prefill done: the first token and, when a
    context-only request goes on, the hand-off ``handoff_position`` reads (from a CTX ``engine``)."""
    sampling = request.sampling
    prompt_logprobs = None
    if sampling.prompt_logprobs is not None:
        prompt_logprobs = (None, *(TokenLogprob(t, 0.0) for t in request.prompt_token_ids[1:]))
    token = token_at(0, output_tokens)
    finish = finish_reason(token, 1, request.max_tokens, sampling.ignore_eos)
    handoff = None
    if request.phase is Phase.CONTEXT_ONLY and finish is None:
        handoff = orjson.dumps({"engine": engine, "prompt_len": request.prompt_len, "position": 1})
    return EngineOutput((token,), certain_logprobs(token, sampling.logprobs), finish, handoff, prompt_logprobs,
                        cached_tokens=cached_tokens)


def finish_reason(token: int, produced: int, max_tokens: int, ignore_eos: bool) -> FinishReason | None:
    """Why a sequence that just produced ``token`` (its ``produced``-th) ends, if it does."""
    if token == EOS_TOKEN_ID and not ignore_eos:
        return "stop"
    if produced >= max_tokens:
        return "length"
    return None


def handoff_position(request: GenerationRequest, engine: str) -> int:
    """The position a generation-only request's hand-off from a CTX ``engine`` (this one, or the simulated one,
    which shares its hand-off) resumes at; ``HandoffError`` naming the field if it is not one."""
    assert request.handoff is not None
    try:
        state = orjson.loads(request.handoff.opaque_state)
        sender, prompt_len, position = state["engine"], state["prompt_len"], state["position"]
    except (orjson.JSONDecodeError, KeyError, TypeError) as exc:
        raise HandoffError(f"encoded_opaque_state is not a {engine}-engine hand-off",
                           param="disaggregated_params") from exc
    if sender != engine:
        raise HandoffError(f"hand-off from engine {sender!r}, this is {engine!r}", param="disaggregated_params")
    if prompt_len != request.prompt_len:
        raise HandoffError(f"hand-off is for a {prompt_len}-token prompt, the request has {request.prompt_len}",
                           param="disaggregated_params.prompt_len")
    return int(position)


class SyntheticEngine:
    """A typed engine (``workers.engines.base.Engine``) that also provides its byte tokenizer."""

    def __init__(self, config: SyntheticConfig | None = None) -> None:
        self.config = config or SyntheticConfig()
        self.info = EngineInfo(
            engine="synthetic",
            model=self.config.model,
            vocab_size=self.config.vocab_size,
            max_context=self.config.max_context,
            model_hash="synthetic-v1",
            supports_structured_output=False,  # it computes no logits to constrain: response_format / tools -> 400
        )
        self._tokenizer = ByteTokenizer(self.config.vocab_size)
        self._running: set[str] = set()
        self._aborted: set[str] = set()

    async def start(self) -> None:
        pass  # nothing to load

    async def aclose(self) -> None:
        pass  # nothing held between requests

    def get_tokenizer(self) -> Tokenizer:
        return self._tokenizer

    def generate(self, request: GenerationRequest) -> AsyncGenerator[EngineOutput, None]:
        return self._tracked(request)

    async def _tracked(self, request: GenerationRequest) -> AsyncGenerator[EngineOutput, None]:
        self._running.add(request.request_id)
        try:
            async for output in self._generate(request):
                yield output
        finally:
            self._running.discard(request.request_id)
            self._aborted.discard(request.request_id)

    async def _generate(self, request: GenerationRequest) -> AsyncGenerator[EngineOutput, None]:
        sampling = request.sampling
        max_tokens = request.max_tokens
        position = 0
        if request.phase is Phase.GENERATION_ONLY:
            assert request.handoff is not None
            position = handoff_position(request, "synthetic")
            if position >= max_tokens:  # CTX's token(s) already used the whole budget
                yield EngineOutput((), finish_reason="length")
                return
            yield EngineOutput(())  # the hand-off is accepted
        else:
            if self.config.time_to_first_token_s:
                await asyncio.sleep(self.config.time_to_first_token_s)
            first = first_output(request, "synthetic", self.config.output_tokens)
            position = 1
            yield first
            if first.finish_reason is not None or request.phase is Phase.CONTEXT_ONLY:
                return
        while True:
            if request.request_id in self._aborted:
                yield EngineOutput((), finish_reason="abort")
                return
            if self.config.inter_token_latency_s:
                await asyncio.sleep(self.config.inter_token_latency_s)
            else:
                await asyncio.sleep(0)  # stay a good citizen of the event loop
            token = token_at(position, self.config.output_tokens)
            position += 1
            finish = finish_reason(token, position, max_tokens, sampling.ignore_eos)
            yield EngineOutput((token,), certain_logprobs(token, sampling.logprobs), finish)
            if finish is not None:
                return

    async def abort(self, request_id: str) -> None:
        if request_id in self._running:
            self._aborted.add(request_id)
