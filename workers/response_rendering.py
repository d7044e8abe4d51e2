"""How a worker answers: the engine's output rendered as one OpenAI body (CTX adds its hand-off fields) or as
SSE frames, with echo, logprobs and forced tool calls.

``ResponseRendering`` is a base of ``workers.serving.WorkerService``, which supplies the tokenizer, the lifecycle
control and the hand-off board; the rendering reads them and nothing else of the service.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncGenerator, AsyncIterator, Sequence
from typing import Any

import pybase64

from frontend.errors import EngineError, InvalidRequestError, ServingError
from frontend.openai_output import ChoiceOutput, StreamRenderer, TokenLogprobInfo, Usage, render_choices
from frontend.token_codec import TokenArray, encode_prompt_tokens
from frontend.tool_calls import as_tool_call_message, tool_calls_from_text
from workers.engines.base import Tokenizer
from workers.engines.outputs import FinishReason, TokenLogprob
from workers.engines.request import GenerationRequest, Phase
from workers.prepared_generation import CollectedChoice, CollectedOutput, PreparedGeneration
from workers.prompt_logprobs import echo_logprob_infos, token_logprob_info, vllm_prompt_logprobs
from workers.text_stream import TextStep
from workers.trtllm.answers import add_context_fields, answers_trtllm, strip_to_trtllm_fields
from workers.trtllm.generation_first import HandoffBoard
from workers.trtllm.lifecycle import LifecycleControl

# The logger of the module this was split out of, as it was: what an operator's filters name.
logger = logging.getLogger("workers.serving")


class ResponseRendering:
    """Renders prepared requests' outputs; the service that runs them provides what is declared here."""

    lifecycle: LifecycleControl
    board: HandoffBoard

    @property
    def tokenizer(self) -> Tokenizer:
        raise NotImplementedError  # WorkerService's: the engine's tokenizer

    def _finish_grant(self, prepared: PreparedGeneration, ok: bool) -> None:
        grant, prepared.grant = prepared.grant, None
        if grant is not None:
            self.lifecycle.finish(grant, ok)

    def _render_whole(self, prepared: PreparedGeneration, out: CollectedOutput) -> dict[str, Any]:
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
            if calls is not None:
                as_tool_call_message(body, calls, index)
        if request.phase is Phase.CONTEXT_ONLY:
            self._add_context_fields(body, prepared, out)
        if answers_trtllm(prepared.disagg):
            strip_to_trtllm_fields(body)
        return body

    def _add_context_fields(self, body: dict[str, Any], prepared: PreparedGeneration, out: CollectedOutput) -> None:
        request = prepared.request
        disagg = prepared.disagg
        assert disagg is not None
        finished = all(choice.finish_reason is not None for choice in out.choices)
        state = pybase64.b64encode(out.handoff_state).decode("ascii") \
            if out.handoff_state is not None and not finished else None
        with_logprobs = request.sampling.logprobs is not None
        first, *more = out.choices
        if answers_trtllm(disagg) and "choices" in body:  # n is 1 here: prepare refuses more for this wire
            add_context_fields(body, request, disagg, first.token_ids, first.logprobs if with_logprobs else None,
                               state, prepared.ident.endpoint)
            if self.lifecycle.enabled:  # v1: the parked KV is now this attempt's artifact
                parked = out.handoff_state if state is not None else None
                self.lifecycle.artifacts.park(disagg, request.request_id, parked)
            if disagg.schedule_style == 1 and disagg.disagg_request_id is not None:
                claim = str(disagg.transfer_session_id) if disagg.transfer_session_id is not None else None
                if not self.board.post(disagg.disagg_request_id, body["choices"][0]["disaggregated_params"], claim):
                    logger.warning("generation-first hand-off of disagg_request_id %s already on the board: this "
                                   "one (ctx_request_id %s) is not posted, and its KV expires unused",
                                   disagg.disagg_request_id, request.request_id)
            return
        params: dict[str, Any] = {
            "request_type": "context_only",
            "ctx_request_id": request.request_id,
            "disagg_request_id": disagg.disagg_request_id,
            **self._sequence_start(first, with_logprobs),
            "encoded_opaque_state": state,
            "prompt_len": request.prompt_len,
            "native_extensions": True,  # GEN gets these params back: it answers our orchestrator in our shape
        }
        if more:  # n > 1: one hand-off (the prompt's KV) starts every sequence
            params["more_sequences"] = [self._sequence_start(choice, with_logprobs) for choice in more]
        if out.cached_tokens:
            params["cached_tokens"] = out.cached_tokens
        if "choices" in body:
            body["choices"][0]["disaggregated_params"] = params
        else:
            body["disaggregated_params"] = params
        if disagg.return_prompt_token_ids_b64 and not finished:  # finished: no GEN will need it
            body["prompt_token_ids"] = None
            body["prompt_token_ids_b64"] = encode_prompt_tokens(request.prompt_token_ids_i32)

    @staticmethod
    def _sequence_start(choice: CollectedChoice, with_logprobs: bool) -> dict[str, Any]:
        """What GEN needs to continue one sequence CTX started: its first token(s) (and their logprobs)."""
        start: dict[str, Any] = {"first_gen_tokens": choice.token_ids}
        if with_logprobs:
            start["first_gen_logprobs"] = [
                {"token_id": lp.token_id, "logprob": lp.logprob, "top": [list(t) for t in lp.top]}
                for lp in choice.logprobs
            ]
        return start

    async def _frames(
        self,
        prepared: PreparedGeneration,
        renderer: StreamRenderer,
        steps: AsyncGenerator[TextStep, None],
        first: TextStep | None,
    ) -> AsyncIterator[bytes]:
        request = prepared.request
        n = request.sampling.n
        per_choice = prepared.ident.endpoint != "responses"  # chat and completions end each choice apart
        completion_tokens = cached_tokens = 0
        finishes: dict[int, FinishReason | None] = {}
        ok = False
        try:
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
                ends = renderer.finish(finishes.get(0), usage)
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
            self._finish_grant(prepared, ok)
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

    # -- logprob token strings --------------------------------------------------------------------------
    def _echo_infos(self, request: GenerationRequest, real_prompt: TokenArray | None,
                    scores: Sequence[TokenLogprob | None] | None) -> list[TokenLogprobInfo]:
        prompt = real_prompt if real_prompt is not None else request.prompt_token_ids
        return echo_logprob_infos(self.tokenizer, prompt, scores)

    def _prompt_logprobs(self, prepared: PreparedGeneration,
                         scores: Sequence[TokenLogprob | None] | None) -> list[Any] | None:
        """vLLM's ``prompt_logprobs``, when the client asked for them (not when only echo needed them)."""
        if getattr(prepared.wire, "prompt_logprobs", None) is None or scores is None:
            return None
        return vllm_prompt_logprobs(self.tokenizer, scores)

    def _logprob_infos(self, logprobs: Sequence[TokenLogprob]) -> list[TokenLogprobInfo]:
        tokenizer = self.tokenizer
        return [token_logprob_info(tokenizer, lp.token_id, lp.logprob, lp.top) for lp in logprobs]
