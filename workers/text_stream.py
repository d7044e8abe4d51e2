"""From engine outputs to text: incremental detokenization, stop strings, and early abort.

``stream_text`` owns the engine iterator: whatever ends the stream (a stop string, the client going away, an
error), the iterator is closed, which aborts the request inside the engine.
"""

from __future__ import annotations

import dataclasses
from collections.abc import AsyncGenerator, Sequence
from dataclasses import dataclass

from frontend.token_codec import TokenArray
from workers.engines.base import Detokenizer, Engine
from workers.engines.outputs import EngineOutput, FinishReason, TokenLogprob
from workers.engines.request import GenerationRequest


@dataclass(frozen=True, slots=True)
class TextStep:
    text: str
    token_ids: tuple[int, ...]
    logprobs: tuple[TokenLogprob, ...] = ()
    finish_reason: FinishReason | None = None
    handoff_state: bytes | None = None
    prompt_logprobs: tuple[TokenLogprob | None, ...] | None = None
    prompt_token_ids: TokenArray | None = None


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


async def stream_text(
    engine: Engine, detokenizer: Detokenizer, request: GenerationRequest
) -> AsyncGenerator[TextStep, None]:
    matcher = StopStringMatcher(request.sampling.stop)
    outputs = engine.generate(request)
    try:
        if request.handoff is not None and request.handoff.first_gen_tokens:
            # GEN: the engine's first output confirms it accepted the hand-off, so a bad one fails the request
            # before any byte is sent (a 400 the orchestrator can act on, not an error in the middle of a 200).
            accepted = await anext(outputs)
            # The first token(s) were chosen by CTX; they open this response's text.
            first = request.handoff.first_gen_tokens
            text, stopped = matcher.push(detokenizer.add(first))
            yield TextStep(text, first, request.handoff.first_gen_logprobs, "stop" if stopped else None,
                           prompt_logprobs=accepted.prompt_logprobs, prompt_token_ids=accepted.prompt_token_ids)
            if stopped:
                return
            if accepted.token_ids or accepted.finish_reason is not None:
                step, stopped = _to_text_step(accepted, detokenizer.add(accepted.token_ids), matcher)
                yield step
                if step.finish_reason is not None:
                    return
        async for output in outputs:
            step, stopped = _to_text_step(output, detokenizer.add(output.token_ids), matcher)
            if stopped and output.handoff_state is not None:
                # CTX parked a KV hand-off that no GEN will fetch now: free it at once.
                await engine.abort(request.request_id)
                step = dataclasses.replace(step, finish_reason="stop", handoff_state=None)
            yield step
            if step.finish_reason is not None:
                return
    finally:
        await outputs.aclose()


def _to_text_step(output: EngineOutput, new_text: str, matcher: StopStringMatcher) -> tuple[TextStep, bool]:
    text, stopped = matcher.push(new_text)
    finish = output.finish_reason
    if stopped:
        finish = "stop"
    elif finish is not None:
        text += matcher.flush()
    step = TextStep(text, output.token_ids, output.logprobs, finish, output.handoff_state, output.prompt_logprobs,
                    output.prompt_token_ids)
    return step, stopped
