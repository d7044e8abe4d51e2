"""How a worker writes its answers: the engine's text as one OpenAI body or as SSE frames, with echo, logprobs (as
clients read them: each token's text and bytes, vLLM's ``prompt_logprobs``) and forced tool calls. The context
fields and the field set are the request's dialect's (``workers.dialects``).

The engine scores the prompt during prefill (on CTX in the disaggregated flow; the hand-off carries the scores to
GEN), one entry per prompt token, ``None`` for the first, which has no context to be scored in.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Sequence
from typing import Any

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
from frontend.tool_calls import as_tool_call_message, tool_calls_from_text
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
        for index, choice in enumerate(out.choices):
            calls = self._tool_calls(prepared, choices[index].text, choice.finish_reason, index)
            if calls is not None and prepared.ident.endpoint == "responses":
                as_function_call_output(body, calls)
            elif calls is not None:
                as_tool_call_message(body, calls, index)
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
                                  bool(options and options.continuous_usage_stats), tool_call=prepared.tool_call)
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
            held: list[list[str]] = [[] for _ in range(n)]  # each choice's tool call: sent whole once complete
            step = first
            while step is not None:
                completion_tokens += len(step.token_ids)
                cached_tokens = step.cached_tokens or cached_tokens
                if renderer.continuous_usage:
                    renderer.usage = Usage(request.prompt_len, completion_tokens, cached_tokens)
                logprobs = self._logprob_infos(step.logprobs) if request.sampling.logprobs is not None else None
                text = step.text
                if prepared.tool_call:
                    held[step.index].append(text)
                    text = ""
                for frame in renderer.delta(text, logprobs, prompt_logprobs, step.index):
                    yield frame
                prompt_logprobs = None
                if step.finish_reason is not None:
                    finishes[step.index] = step.finish_reason
                    if per_choice:
                        for frame in self._choice_end_frames(prepared, renderer, held[step.index],
                                                             step.finish_reason, step.index):
                            yield frame
                step = await anext(steps, None)
            usage = Usage(request.prompt_len, completion_tokens, cached_tokens)
            if per_choice:
                unfinished = [index for index in range(n) if index not in finishes]
                ends = [frame for index in unfinished
                        for frame in self._choice_end_frames(prepared, renderer, held[index], None, index)]
                ends += renderer.end(usage)
            else:
                ends = self._response_end_frames(prepared, renderer, held[0], finishes.get(0), usage)
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

    @staticmethod
    def _tool_calls(prepared: PreparedGeneration, text: str, finish: str | None,
                    index: int = 0) -> list[dict[str, Any]] | None:
        """The forced tool call a finished choice made; None for plain text or a call cut short."""
        if not prepared.tool_call or finish != "stop":
            return None
        call_id = "call_" + prepared.request.request_id + (f"_{index}" if index else "")
        return tool_calls_from_text(text, call_id)

    def _choice_end_frames(self, prepared: PreparedGeneration, renderer: StreamRenderer, held: list[str],
                           finish: str | None, index: int) -> list[bytes]:
        """The frames that end choice ``index``: a held-back tool call first (the whole call, or its text when
        cut short by ``max_tokens``), then the finish chunk."""
        if not prepared.tool_call:
            return renderer.finish_choice(finish, index)
        text = "".join(held)
        calls = self._tool_calls(prepared, text, finish, index)
        if calls is None:
            frames = renderer.delta(text, None, None, index) if text else []
            return [*frames, *renderer.finish_choice(finish, index)]
        return [*renderer.tool_calls(calls, index), *renderer.finish_choice("tool_calls", index)]

    def _response_end_frames(self, prepared: PreparedGeneration, renderer: StreamRenderer, held: list[str],
                             finish: str | None, usage: Usage) -> list[bytes]:
        """The frames that end a Responses stream: a held-back tool call as its function call items (or its text,
        when cut short by ``max_output_tokens``), then the final event."""
        if not prepared.tool_call:
            return renderer.finish(finish, usage)
        text = "".join(held)
        calls = self._tool_calls(prepared, text, finish)
        if calls is None:
            return [*(renderer.delta(text) if text else []), *renderer.finish(finish, usage)]
        return renderer.finish_function_calls(calls, usage)

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
