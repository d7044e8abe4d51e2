"""How a worker writes its answers: the engine's text as one OpenAI body or as SSE frames, with echo, logprobs (as
clients read them: each token's text and bytes, vLLM's ``prompt_logprobs``) and tool calls, read out of the text
as it comes by the request's parser (``frontend.tool_parsers``; one per choice). The context fields and the field
set are the request's dialect's (``workers.dialects``).

The engine scores the prompt during prefill (on CTX in the disaggregated flow; the hand-off carries the scores to
GEN), one entry per prompt token, ``None`` for the first, which has no context to be scored in.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Sequence
from typing import Any

from frontend import stream_token_ids
from frontend.errors import EngineError, InvalidRequestError, ServingError
from frontend.openai_output import (
    ChoiceOutput,
    StreamRenderer,
    TokenLogprobInfo,
    Usage,
    as_function_call_output,
    render_choices,
)
from frontend.token_codec import TokenArray
from frontend.tool_calls import as_tool_call_message, call_id_of, openai_tool_calls
from frontend.tool_parsers.base import CallOpened, TextPiece, ToolCallParser, ToolEvent, parse_whole
from workers.engines.base import ProvidesTokenBytes, ProvidesTokenizer, Tokenizer
from workers.engines.outputs import FinishReason, TokenLogprob
from workers.engines.request import GenerationRequest, Phase
from workers.prepared_generation import PreparedGeneration
from workers.text_stream import CollectedOutput, TextStep

logger = logging.getLogger("disagg_serve.worker")

PromptLogprobs = Sequence[TokenLogprob | None]


class Renderer:
    """Writes prepared requests' answers with the engine's tokenizer (asked each time: an engine has one only once it
    has started)."""

    def __init__(self, tokenizers: ProvidesTokenizer) -> None:
        self._tokenizers = tokenizers

    @property
    def tokenizer(self) -> Tokenizer:
        return self._tokenizers.get_tokenizer()

    def whole(self, prepared: PreparedGeneration, out: CollectedOutput) -> dict[str, Any]:
        """The whole answer's body (CTX's with its hand-off fields)."""
        request = prepared.request
        sampling = request.sampling
        echoed_text, echoed_logprobs = "", []
        if sampling.echo:  # every choice opens with the prompt
            echoed_text = self._prompt_text(request, out.real_prompt)
            if sampling.logprobs is not None:
                echoed_logprobs = self._echo_infos(request, out.real_prompt, out.prompt_logprobs)
        choices = []
        for choice in out.choices:
            logprob_entries: list[TokenLogprobInfo | None] | None = None
            if sampling.logprobs is not None:
                logprob_entries = [*echoed_logprobs, *self._logprob_infos(choice.logprobs)]
            choices.append(ChoiceOutput(echoed_text + "".join(choice.text_parts), choice.finish_reason,
                                        logprob_entries))
        usage = Usage(request.prompt_len, out.completion_tokens, out.cached_tokens)
        body = render_choices(prepared.ident, choices, usage, self._prompt_logprobs(prepared, out.prompt_logprobs))
        tool_calling = prepared.tool_calling
        for index, choice in enumerate(out.choices):
            if tool_calling is None:
                break
            parsed = parse_whole(tool_calling.parser(), "".join(choice.text_parts))
            if parsed is None:
                continue
            calls = openai_tool_calls(parsed.calls, _call_id(prepared, index))
            if prepared.ident.endpoint == "responses":
                as_function_call_output(body, calls, parsed.content)
            else:
                as_tool_call_message(body, calls, parsed.content, index)
                if choice.finish_reason != "stop":  # cut short after its calls: as the stream ends it
                    body["choices"][index]["finish_reason"] = choice.finish_reason
        if request.phase is Phase.CONTEXT_ONLY:
            assert prepared.disagg is not None
            prepared.dialect.add_context_fields(body, request, prepared.disagg, out, prepared.ident.endpoint)
        prepared.dialect.finish_whole(body)
        return body

    async def frames(self, prepared: PreparedGeneration, steps: AsyncGenerator[TextStep, None],
                     first: TextStep | None, ended: Callable[[PreparedGeneration, bool], None]
                     ) -> AsyncIterator[bytes]:
        """The stream's SSE frames, from its ``first`` step on; ``ended(prepared, ok)`` once it ends, however."""
        request = prepared.request
        options = prepared.wire.stream_options
        renderer = StreamRenderer(prepared.ident, bool(options and options.include_usage),
                                  bool(options and options.continuous_usage_stats),
                                  tool_call=prepared.tool_calling is not None)
        n = request.sampling.n
        per_choice = prepared.ident.endpoint != "responses"  # chat and completions end each choice apart
        completion_tokens = cached_tokens = 0
        finishes: dict[int, FinishReason | None] = {}
        ok = False
        try:
            if renderer.continuous_usage:  # the prompt's counts from the first chunk on
                renderer.usage = Usage(request.prompt_len, 0, first.cached_tokens if first is not None else 0)
            for frame in renderer.begin(n):
                yield frame
            scores = first.prompt_logprobs if first is not None else None
            prompt_logprobs = self._prompt_logprobs(prepared, scores)  # sent once, with the first delta
            if request.sampling.echo:
                for frame in self._echo_frames(request, renderer, first, prompt_logprobs):
                    yield frame
                prompt_logprobs = None
            # Each choice's reader, where the answer may be tool calls, and how many calls it has made.
            tool_calling = prepared.tool_calling
            parsers = [tool_calling.parser() for _ in range(n)] if tool_calling is not None else None
            calls = [0] * n
            step = first
            while step is not None:
                completion_tokens += len(step.token_ids)
                cached_tokens = step.cached_tokens or cached_tokens
                if renderer.continuous_usage:
                    renderer.usage = Usage(request.prompt_len, completion_tokens, cached_tokens)
                logprobs = self._logprob_infos(step.logprobs) if request.sampling.logprobs is not None else None
                if parsers is None:
                    frames = renderer.delta(step.text, logprobs, prompt_logprobs, step.index)
                else:
                    events = parsers[step.index].feed(step.text)
                    frames = self._tool_frames(prepared, renderer, events, calls, step.index, logprobs,
                                               prompt_logprobs)
                if prepared.stream_token_ids:
                    frames = stream_token_ids.tagged(frames, step.token_ids)
                for frame in frames:
                    yield frame
                prompt_logprobs = None
                if step.finish_reason is not None:
                    finishes[step.index] = step.finish_reason
                    if per_choice:
                        for frame in self._choice_end_frames(prepared, renderer, parsers, calls,
                                                             step.finish_reason, step.index):
                            yield frame
                step = await anext(steps, None)
            usage = Usage(request.prompt_len, completion_tokens, cached_tokens)
            if per_choice:
                unfinished = [index for index in range(n) if index not in finishes]
                ends = [frame for index in unfinished
                        for frame in self._choice_end_frames(prepared, renderer, parsers, calls, None, index)]
                ends += renderer.end(usage)
            else:
                ends = self._response_end_frames(prepared, renderer, parsers, calls, finishes.get(0), usage)
            for frame in ends:
                yield frame
            ok = len(finishes) == n and "abort" not in finishes.values()
        except ServingError as exc:
            for frame in renderer.error(exc):
                yield frame
        except Exception as exc:
            logger.exception("stream failure on %s", request.request_id)
            for frame in renderer.error(EngineError(f"the engine failed: {type(exc).__name__}")):
                yield frame
        finally:
            ended(prepared, ok)
            await steps.aclose()

    def _tool_frames(self, prepared: PreparedGeneration, renderer: StreamRenderer, events: list[ToolEvent],
                     calls: list[int], index: int, logprobs: Sequence[TokenLogprobInfo] | None = None,
                     prompt_logprobs: list[Any] | None = None) -> list[bytes]:
        """What choice ``index``'s reader made known, as frames: text as text deltas (the step's logprobs with the
        first, or alone), calls as tool-call deltas; ``calls``: each choice's count of calls, kept here."""
        frames: list[bytes] = []
        text: list[str] = []

        def flush_text() -> None:
            nonlocal logprobs, prompt_logprobs
            if text or logprobs or prompt_logprobs is not None:
                frames.extend(renderer.delta("".join(text), logprobs, prompt_logprobs, index))
                text.clear()
                logprobs, prompt_logprobs = None, None

        for event in events:
            if isinstance(event, TextPiece):
                text.append(event.text)
                continue
            flush_text()
            if isinstance(event, CallOpened):
                calls[index] += 1
                call_id = call_id_of(_call_id(prepared, index), event.index)
                frames += renderer.tool_call_opened(call_id, event.name, event.index, index)
            else:
                frames += renderer.tool_call_arguments(event.text, event.index, index)
        flush_text()
        return frames

    def _choice_end_frames(self, prepared: PreparedGeneration, renderer: StreamRenderer,
                           parsers: list[ToolCallParser] | None, calls: list[int], finish: str | None,
                           index: int) -> list[bytes]:
        """The frames that end choice ``index``: what its reader held back, then the finish chunk (``tool_calls``
        where the choice ended its turn after calls, all of them whole and valid: a call whose arguments broke off
        or are not JSON went out in pieces, but is no call for the client to run, as the whole answer says)."""
        if parsers is None:
            return renderer.finish_choice(finish, index)
        parser = parsers[index]
        frames = self._tool_frames(prepared, renderer, parser.finish(), calls, index)
        called = calls[index] and finish == "stop" and not parser.incomplete
        return [*frames, *renderer.finish_choice("tool_calls" if called else finish, index)]

    def _response_end_frames(self, prepared: PreparedGeneration, renderer: StreamRenderer,
                             parsers: list[ToolCallParser] | None, calls: list[int], finish: str | None,
                             usage: Usage) -> list[bytes]:
        """The frames that end a Responses stream: what its reader held back, then the open items done and the
        final event."""
        frames = [] if parsers is None else self._tool_frames(prepared, renderer, parsers[0].finish(), calls, 0)
        return [*frames, *renderer.finish(finish, usage, call_broken=parsers is not None and parsers[0].incomplete)]

    def _echo_frames(self, request: GenerationRequest, renderer: StreamRenderer, first: TextStep | None,
                     prompt_logprobs: list[Any] | None) -> list[bytes]:
        """Echo: every choice's stream opens with the prompt (and its logprobs, when asked for)."""
        real_prompt = first.prompt_token_ids if first is not None else None
        scores = first.prompt_logprobs if first is not None else None
        echoed = self._echo_infos(request, real_prompt, scores) if request.sampling.logprobs is not None else None
        text = self._prompt_text(request, real_prompt)
        return [frame for index in range(request.sampling.n)
                for frame in renderer.delta(text, echoed, prompt_logprobs if index == 0 else None, index)]

    def _prompt_text(self, request: GenerationRequest, real_prompt: TokenArray | None) -> str:
        """Echo reads prompt token values: the real prompt from the engine if this request had a placeholder."""
        if real_prompt is not None:
            return self.tokenizer.decode(real_prompt)
        if request.prompt_is_placeholder:
            raise InvalidRequestError("echo needs the real prompt tokens, which this request did not carry",
                                      param="echo")
        return self.tokenizer.decode(request.prompt_token_ids)

    # -- logprobs as clients read them ---------------------------------------------------------------------------
    def _echo_infos(self, request: GenerationRequest, real_prompt: TokenArray | None,
                    scores: PromptLogprobs | None) -> list[TokenLogprobInfo]:
        prompt = real_prompt if real_prompt is not None else request.prompt_token_ids
        return echo_logprob_infos(self.tokenizer, prompt, scores)

    def _prompt_logprobs(self, prepared: PreparedGeneration,
                         scores: PromptLogprobs | None) -> list[Any] | None:
        """vLLM's ``prompt_logprobs``, when the client asked for them (not when only echo needed them)."""
        if getattr(prepared.wire, "prompt_logprobs", None) is None or scores is None:
            return None
        return vllm_prompt_logprobs(self.tokenizer, scores)

    def _logprob_infos(self, logprobs: Sequence[TokenLogprob]) -> list[TokenLogprobInfo]:
        tokenizer = self.tokenizer
        return [token_logprob_info(tokenizer, lp.token_id, lp.logprob, lp.top) for lp in logprobs]


def _call_id(prepared: PreparedGeneration, choice: int) -> str:
    """The id of choice ``choice``'s first call (``frontend.tool_calls.call_id_of`` numbers the next ones)."""
    return "call_" + prepared.request.request_id + (f"_{choice}" if choice else "")


def token_logprob_info(tokenizer: Tokenizer, token_id: int, logprob: float | None,
                       top: Sequence[tuple[int, float]] = ()) -> TokenLogprobInfo:
    """One token's entry: its text and its alternatives', with their own bytes when the tokenizer knows them (the
    text of a token that is only part of a character is U+FFFD, whose bytes are not the token's)."""
    decode = tokenizer.decode
    top_texts = tuple((decode([t]), v) for t, v in top)
    if not isinstance(tokenizer, ProvidesTokenBytes):
        return TokenLogprobInfo(decode([token_id]), logprob, top_texts)
    raw = tokenizer.token_bytes
    return TokenLogprobInfo(decode([token_id]), logprob, top_texts, raw(token_id), tuple(raw(t) for t, _ in top))


def echo_logprob_infos(
    tokenizer: Tokenizer, prompt: Sequence[int] | TokenArray, scores: PromptLogprobs | None
) -> list[TokenLogprobInfo]:
    """One entry per prompt token: its text always, its logprob and alternatives where the engine scored it."""
    entries = []
    for index, token_id in enumerate(prompt):
        score = scores[index] if scores is not None and index < len(scores) else None
        entries.append(token_logprob_info(tokenizer, int(token_id), score.logprob if score else None,
                                          score.top if score is not None else ()))
    return entries


def vllm_prompt_logprobs(tokenizer: Tokenizer, scores: PromptLogprobs) -> list[dict[str, Any] | None]:
    """vLLM's shape: per prompt token ``None`` or ``{token_id: {logprob, rank, decoded_token}}``, the prompt's own
    token first, then the top alternatives; ``rank`` is 1-based, ``None`` where it was not among the top."""
    decode = tokenizer.decode
    rendered: list[dict[str, Any] | None] = []
    for score in scores:
        if score is None:
            rendered.append(None)
            continue
        ranks = {token_id: rank for rank, (token_id, _) in enumerate(score.top, start=1)}
        entry = {str(score.token_id): {"logprob": score.logprob, "rank": ranks.get(score.token_id),
                                       "decoded_token": decode([score.token_id])}}
        for token_id, logprob in score.top:
            entry.setdefault(str(token_id), {"logprob": logprob, "rank": ranks[token_id],
                                             "decoded_token": decode([token_id])})
        rendered.append(entry)
    return rendered
