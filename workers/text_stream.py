"""From engine outputs to text: incremental detokenization, stop strings, and early abort; and a whole answer's text
collected, sequence by sequence (``CollectedOutput``).

``stream_text`` owns the engine iterator: whatever ends the stream (a stop string, the client going away, an
error), the iterator is closed, which aborts the request inside the engine. A request for n > 1 sequences has one
detokenizer and stop-string matcher per sequence; a stop string ends its own sequence only.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field

from frontend.errors import UnsupportedParameterError
from frontend.token_codec import TokenArray
from workers.engines.base import Detokenizer, Engine, StopsSequences
from workers.engines.outputs import EngineOutput, FinishReason, TokenLogprob
from workers.engines.request import GenerationRequest, Phase


@dataclass(frozen=True, slots=True)
class TextStep:
    text: str
    token_ids: tuple[int, ...]
    logprobs: tuple[TokenLogprob, ...] = ()
    finish_reason: FinishReason | None = None
    handoff_state: bytes | None = None
    prompt_logprobs: tuple[TokenLogprob | None, ...] | None = None
    prompt_token_ids: TokenArray | None = None
    index: int = 0  # which of the request's n sequences
    cached_tokens: int = 0
    recomputed_tokens: int = 0  # GEN's first step: prompt tokens its engine computed itself (EngineOutput's)


@dataclass(slots=True)
class CollectedChoice:
    """One sequence's whole output."""

    text_parts: list[str] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    finish_reason: FinishReason | None = None


@dataclass(slots=True)
class CollectedOutput:
    """A request's whole output, its text steps added as they come."""

    choices: list[CollectedChoice]  # one per sequence, by index
    handoff_state: bytes | None = None
    prompt_logprobs: tuple[TokenLogprob | None, ...] | None = None
    real_prompt: TokenArray | None = None  # from the engine, when this request had a placeholder prompt
    cached_tokens: int = 0

    @classmethod
    def of(cls, n: int) -> CollectedOutput:
        return cls([CollectedChoice() for _ in range(n)])

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

    @property
    def finished(self) -> bool:
        """Every sequence has finished: no GEN continues any of them."""
        return all(choice.finish_reason is not None for choice in self.choices)


class StopStringMatcher:
    """Finds stop strings across token boundaries, holding back text that could be the start of one."""

    def __init__(self, stops: Sequence[str]) -> None:
        self._stops = tuple(s for s in stops if s)
        self._pending = ""

    def push(self, text: str) -> tuple[str, bool]:
        """Return (text safe to emit now, whether a stop string was reached)."""
        if not self._stops:
            return text, False
        buffer = self._pending + text
        cut = min((i for i in (buffer.find(s) for s in self._stops) if i >= 0), default=-1)
        if cut >= 0:
            self._pending = ""
            return buffer[:cut], True
        hold = self._longest_partial_suffix(buffer)
        self._pending = buffer[len(buffer) - hold :]
        return buffer[: len(buffer) - hold], False

    def flush(self) -> str:
        text, self._pending = self._pending, ""
        return text

    def _longest_partial_suffix(self, buffer: str) -> int:
        longest = 0
        for stop in self._stops:
            for size in range(min(len(stop) - 1, len(buffer)), longest, -1):
                if buffer.endswith(stop[:size]):
                    longest = size
                    break
        return longest


class SequenceText:
    """One sequence's text: its own detokenizer and stop-string matcher, and whether it has finished."""

    def __init__(self, detokenizer: Detokenizer, stops: Sequence[str]) -> None:
        self.detokenizer = detokenizer
        self.matcher = StopStringMatcher(stops)
        self.finished = False

    def step(self, output: EngineOutput) -> tuple[TextStep, bool]:
        """``output`` as text; and whether a stop string ended the sequence here."""
        text, stopped = self.matcher.push(self.detokenizer.add(output.token_ids))
        finish = output.finish_reason
        if stopped:
            finish = "stop"
        elif finish is not None:
            text += self.matcher.flush()
        self.finished = finish is not None
        step = TextStep(text, output.token_ids, output.logprobs, finish, output.handoff_state, output.prompt_logprobs,
                        output.prompt_token_ids, output.index, output.cached_tokens, output.recomputed_tokens)
        return step, stopped


async def stream_text(
    engine: Engine, new_detokenizer: Callable[[], Detokenizer], request: GenerationRequest
) -> AsyncGenerator[TextStep, None]:
    """The request's text, step by step, each step naming its sequence; it ends when every sequence has."""
    sequences = [SequenceText(new_detokenizer(), request.sampling.stop) for _ in range(request.sampling.n)]
    outputs = engine.generate(request)
    try:
        handoff = request.handoff
        if handoff is not None and handoff.first_gen_tokens:
            # GEN: the engine's first output confirms it accepted the hand-off, so a bad one fails the request
            # before any byte is sent (a 400 the orchestrator can act on, not an error in the middle of a 200).
            accepted = await anext(outputs)
            if accepted.chose_first_tokens:
                if handoff.first_gen_steps:
                    # A stream continued here after another worker broke: the client has these tokens already, and
                    # an engine that chooses them again (vLLM's P/D) would not choose them again alike.
                    raise UnsupportedParameterError(
                        "this engine chooses an answer's first tokens itself and cannot continue a stream from the "
                        "tokens a client already has", param="disaggregated_params.first_gen_steps")
                # The engine chose each sequence's first token(s) again and they are the answer's (nothing of
                # CTX's has reached the client: this answer is the first it sees), so its outputs go as they come.
                first = dataclasses.replace(accepted, cached_tokens=handoff.cached_tokens)
                async with contextlib.aclosing(_steps(engine, request, sequences, _prepended(first, outputs))) as steps:
                    async for step in steps:
                        yield step
                return
            # The first token(s) of each sequence were chosen by CTX; they open that sequence's text.
            for index, start in enumerate(handoff.sequences):
                opening = EngineOutput(start.first_gen_tokens, start.first_gen_logprobs, index=index)
                if index == 0:
                    opening = dataclasses.replace(opening, prompt_logprobs=accepted.prompt_logprobs,
                                                  prompt_token_ids=accepted.prompt_token_ids,
                                                  cached_tokens=handoff.cached_tokens,
                                                  recomputed_tokens=accepted.recomputed_tokens)
                for part in _opening_parts(opening, handoff.first_gen_steps if index == 0 else ()):
                    step, stopped = sequences[index].step(part)
                    yield step
                    if stopped:
                        await _stop_sequence(engine, request, index)
                        break
            if all(s.finished for s in sequences):
                return
            if accepted.token_ids or accepted.finish_reason is not None:
                step, _ = sequences[accepted.index].step(dataclasses.replace(accepted, prompt_logprobs=None,
                                                                             prompt_token_ids=None))
                yield step
        async with contextlib.aclosing(_steps(engine, request, sequences, outputs)) as steps:
            async for step in steps:
                yield step
    finally:
        await outputs.aclose()


async def _steps(engine: Engine, request: GenerationRequest, sequences: list[SequenceText],
                 outputs: AsyncIterator[EngineOutput]) -> AsyncGenerator[TextStep, None]:
    """Each output as its sequence's text, until every sequence has finished."""
    parked = False  # the engine handed out a KV hand-off (CTX)
    async for output in outputs:
        parked = parked or output.handoff_state is not None
        sequence = sequences[output.index]
        if sequence.finished:
            continue  # stopped here by a stop string; an engine that cannot stop one sequence decodes on
        step, stopped = sequence.step(output)
        done = all(s.finished for s in sequences)
        if parked and done:
            # The engine parked the KV for a sequence it saw unfinished, but a stop string ended it here (this
            # sequence or another: n > 1 sequences end in any order, and the hand-off comes with the last output).
            # Every sequence has ended, so no GEN will fetch it and the answer will not carry it: only this worker
            # can free it, and left parked it would hold KV store bytes until its time to live.
            await engine.abort(request.request_id)
            step = dataclasses.replace(step, handoff_state=None)
        yield step
        if done:
            return
        if stopped and request.phase is not Phase.CONTEXT_ONLY:  # CTX decodes nothing after the first token
            await _stop_sequence(engine, request, output.index)


async def _prepended(first: EngineOutput, rest: AsyncIterator[EngineOutput]) -> AsyncGenerator[EngineOutput, None]:
    yield first
    async for output in rest:
        yield output


def _opening_parts(opening: EngineOutput, steps: Sequence[int]) -> list[EngineOutput]:
    """A sequence's first tokens as one output; or, where they are a broken stream's that this worker continues
    (``Handoff.first_gen_steps``), as the steps that stream wrote them in: what the detokenizer and the stop-string
    matcher have written depends on how the tokens came, and only the same steps write the same text."""
    if len(steps) < 2:
        return [opening]
    parts, start = [], 0
    for size in steps:
        tokens, logprobs = opening.token_ids[start:start + size], opening.logprobs[start:start + size]
        parts.append(dataclasses.replace(opening, token_ids=tokens, logprobs=logprobs) if not start
                     else EngineOutput(tokens, logprobs, index=opening.index))
        start += size
    return parts


async def _stop_sequence(engine: Engine, request: GenerationRequest, index: int) -> None:
    """A stop string finished one sequence of several: the engine need not decode it further."""
    if request.sampling.n > 1 and isinstance(engine, StopsSequences):
        await engine.stop_sequence(request.request_id, index)
