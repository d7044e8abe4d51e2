"""The worker's request logic, free of FastAPI: admit -> parse -> prepare the prompt -> run -> render.

A CTX (context_only) request returns the first token, the KV hand-off and the prompt as base64 int32. A GEN
(generation_only) request continues from the hand-off and answers the client's whole output, first token
included. A plain request (role ``both``) is ordinary aggregated serving.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncGenerator, AsyncIterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import pybase64

from frontend.errors import (
    EngineError,
    InvalidRequestError,
    ModelNotFoundError,
    OverloadedError,
    ServingError,
)
from frontend.http import validate_wire
from frontend.metrics import Metrics
from frontend.openai_models import (
    DisaggregatedParams,
    GenerationWireRequest,
    refuse_unsupported_parameters,
)
from frontend.openai_output import (
    ResponseIdentity,
    StreamRenderer,
    TokenLogprobInfo,
    Usage,
    render_response,
)
from frontend.structured_output import output_constraint
from frontend.token_codec import TokenArray, encode_prompt_tokens
from frontend.tool_calls import as_tool_call_message, tool_calls_from_text
from workers.engines.base import Engine, ProvidesTokenizer, Tokenizer
from workers.engines.outputs import FinishReason, TokenLogprob
from workers.engines.request import GenerationRequest, Phase
from workers.prompt_logprobs import echo_logprob_infos, vllm_prompt_logprobs
from workers.request_builder import (
    endpoint_of,
    handoff_from,
    phase_of,
    prepare_prompt,
    resolve_max_tokens,
    sampling_params_from,
)
from workers.text_stream import TextStep, stream_text
from workers.trtllm_answers import (
    add_context_fields,
    answers_trtllm,
    finished_at_context,
    first_tokens_only,
    new_request_id,
    strip_to_trtllm_fields,
)

logger = logging.getLogger(__name__)

Role = Literal["context", "generation", "both"]
_ID_PREFIX = {"chat": "chatcmpl-", "completions": "cmpl-", "responses": "resp_"}


@dataclass(frozen=True, slots=True)
class WorkerSettings:
    role: Role = "both"
    max_body_bytes: int = 64 * 1024 * 1024
    max_concurrent_requests: int = 512
    admin_key: str | None = None  # guards the worker's admin endpoints (the hand-off ledger); None: they answer 403


@dataclass(slots=True)
class PreparedGeneration:
    """A request that passed every check and is ready to run."""

    wire: GenerationWireRequest
    request: GenerationRequest
    ident: ResponseIdentity
    disagg: DisaggregatedParams | None
    tool_call: bool = False  # the output is a forced tool call, answered as message.tool_calls


@dataclass(slots=True)
class CollectedOutput:
    text_parts: list[str] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    finish_reason: FinishReason | None = None
    handoff_state: bytes | None = None
    prompt_logprobs: tuple[TokenLogprob | None, ...] | None = None
    real_prompt: TokenArray | None = None  # from the engine, when this request had a placeholder prompt


class WorkerService:
    def __init__(self, engine: Engine, settings: WorkerSettings, metrics: Metrics) -> None:
        if not isinstance(engine, ProvidesTokenizer):
            # An OpenAI server reads and writes text; an engine without a tokenizer would need one given here.
            raise TypeError(f"{type(engine).__name__} provides no tokenizer (workers.engines.base.ProvidesTokenizer)")
        self.engine = engine
        self._tokenizer_source: ProvidesTokenizer = engine
        self.settings = settings
        self.metrics = metrics
        self.inflight = 0
        self._inflight_gauge = metrics.engine_inflight.labels(role=settings.role)

    # -- admission and parsing -------------------------------------------------------------------------
    async def prepare(self, body: dict[str, Any], wire_model: type[GenerationWireRequest]) -> PreparedGeneration:
        refuse_unsupported_parameters(body)
        wire = validate_wire(wire_model, body)
        info = self.engine.info
        if wire.model != info.model:
            raise ModelNotFoundError(f"the model '{wire.model}' does not exist; this worker serves '{info.model}'",
                                     param="model")
        disagg = wire.disaggregated_params
        phase = phase_of(disagg)
        self._check_role(phase)
        if finished_at_context(disagg):
            phase = Phase.AGGREGATED  # nothing to continue from: answered from CTX's first tokens (_text_steps)
        constraint = output_constraint(wire)
        sampling = sampling_params_from(wire, info, constraint)
        prompt = await prepare_prompt(wire, sampling, info, self.tokenizer)
        sampling = resolve_max_tokens(wire, sampling, int(prompt.tokens.size), info)
        handoff = handoff_from(disagg, info.vocab_size)
        request_id = new_request_id(disagg)
        if prompt.token_list is not None:
            request = GenerationRequest.from_token_list(
                request_id, prompt.token_list, prompt.tokens, sampling, phase=phase, handoff=handoff
            )
        else:
            request = GenerationRequest(
                request_id, prompt.tokens, sampling, phase=phase, prompt_path=prompt.path, handoff=handoff
            )
        if phase is Phase.GENERATION_ONLY:
            self.metrics.gen_prompt_path.labels(path=prompt.path.value).inc()
        endpoint = endpoint_of(wire)
        ident = ResponseIdentity(endpoint, _ID_PREFIX[endpoint] + request_id, info.model)
        tool_call = constraint is not None and constraint.tool_call
        return PreparedGeneration(wire, request, ident, disagg, tool_call=tool_call)

    @property
    def tokenizer(self) -> Tokenizer:
        """The engine's tokenizer (asked each time: an engine has one only once it has started)."""
        return self._tokenizer_source.get_tokenizer()

    def _check_role(self, phase: Phase) -> None:
        role = self.settings.role
        if phase is Phase.GENERATION_ONLY and role == "context":
            raise InvalidRequestError("this worker has role 'context' and takes no generation_only requests",
                                      param="disaggregated_params.request_type")
        if phase is Phase.CONTEXT_ONLY and role == "generation":
            raise InvalidRequestError("this worker has role 'generation' and takes no context_only requests",
                                      param="disaggregated_params.request_type")

    def admit(self) -> None:
        if self.inflight >= self.settings.max_concurrent_requests:
            raise OverloadedError(
                f"this worker is at its limit of {self.settings.max_concurrent_requests} concurrent requests"
            )
        self.inflight += 1
        self._inflight_gauge.inc()

    def release(self) -> None:
        self.inflight -= 1
        self._inflight_gauge.dec()

    # -- running ----------------------------------------------------------------------------------------
    async def complete(self, prepared: PreparedGeneration) -> dict[str, Any]:
        """Run to the end and return the whole response body (CTX adds its hand-off fields)."""
        collected = CollectedOutput()
        try:
            async for step in self._text_steps(prepared):
                collected.text_parts.append(step.text)
                collected.token_ids.extend(step.token_ids)
                collected.logprobs.extend(step.logprobs)
                collected.finish_reason = step.finish_reason or collected.finish_reason
                collected.handoff_state = step.handoff_state or collected.handoff_state
                if step.prompt_logprobs is not None:
                    collected.prompt_logprobs = step.prompt_logprobs
                if step.prompt_token_ids is not None:
                    collected.real_prompt = step.prompt_token_ids
        except ServingError:
            raise
        except Exception as exc:  # an adapter bug must still answer in OpenAI's shape
            logger.exception("engine failure on %s", prepared.request.request_id)
            raise EngineError(f"the engine failed: {type(exc).__name__}") from exc
        return self._render_whole(prepared, collected)

    def _text_steps(self, prepared: PreparedGeneration) -> AsyncGenerator[TextStep, None]:
        if finished_at_context(prepared.disagg):
            assert prepared.disagg is not None
            return first_tokens_only(prepared.disagg, self.tokenizer, self.engine.info.vocab_size)
        return stream_text(self.engine, self.tokenizer.detokenizer(), prepared.request)

    def _render_whole(self, prepared: PreparedGeneration, out: CollectedOutput) -> dict[str, Any]:
        request = prepared.request
        sampling = request.sampling
        text = "".join(out.text_parts)
        logprob_entries: list[TokenLogprobInfo | None] | None = None
        if sampling.logprobs is not None:
            logprob_entries = list(self._logprob_infos(out.logprobs))
        if sampling.echo:
            text = self._prompt_text(request, out.real_prompt) + text
            if logprob_entries is not None:
                logprob_entries = [*self._echo_infos(request, out.real_prompt, out.prompt_logprobs), *logprob_entries]
        usage = Usage(request.prompt_len, len(out.token_ids))
        body = render_response(prepared.ident, text, out.finish_reason, usage, logprob_entries,
                               self._prompt_logprobs(prepared, out.prompt_logprobs))
        calls = self._tool_calls(prepared, text, out.finish_reason)
        if calls is not None:
            as_tool_call_message(body, calls)
        if request.phase is Phase.CONTEXT_ONLY:
            self._add_context_fields(body, prepared, out)
        if answers_trtllm(prepared.disagg):
            strip_to_trtllm_fields(body)
        return body

    def _add_context_fields(self, body: dict[str, Any], prepared: PreparedGeneration, out: CollectedOutput) -> None:
        request = prepared.request
        disagg = prepared.disagg
        assert disagg is not None
        state = pybase64.b64encode(out.handoff_state).decode("ascii") \
            if out.handoff_state is not None and out.finish_reason is None else None
        if answers_trtllm(disagg) and "choices" in body:
            logprobs = out.logprobs if request.sampling.logprobs is not None else None
            add_context_fields(body, request, disagg, out.token_ids, logprobs, state, prepared.ident.endpoint)
            return
        params: dict[str, Any] = {
            "request_type": "context_only",
            "ctx_request_id": request.request_id,
            "disagg_request_id": disagg.disagg_request_id,
            "first_gen_tokens": out.token_ids,
            "encoded_opaque_state": state,
            "prompt_len": request.prompt_len,
            "native_extensions": True,  # GEN gets these params back: it answers our orchestrator in our shape
        }
        if request.sampling.logprobs is not None:
            params["first_gen_logprobs"] = [
                {"token_id": lp.token_id, "logprob": lp.logprob, "top": [list(t) for t in lp.top]}
                for lp in out.logprobs
            ]
        if "choices" in body:
            body["choices"][0]["disaggregated_params"] = params
        else:
            body["disaggregated_params"] = params
        if disagg.return_prompt_token_ids_b64 and out.finish_reason is None:  # finished: no GEN will need it
            body["prompt_token_ids"] = None
            body["prompt_token_ids_b64"] = encode_prompt_tokens(request.prompt_token_ids_i32)

    async def open_stream(self, prepared: PreparedGeneration) -> AsyncIterator[bytes]:
        """Start the stream and return its frames. Fails as an HTTP error if it fails before the first token."""
        include_usage = bool(prepared.wire.stream_options and prepared.wire.stream_options.include_usage)
        renderer = StreamRenderer(prepared.ident, include_usage)
        steps = self._text_steps(prepared)
        try:
            first = await anext(steps)
        except StopAsyncIteration:
            first = None
        except ServingError:
            await steps.aclose()
            raise
        except Exception as exc:  # an adapter bug before the first byte: still an OpenAI-shaped engine error
            await steps.aclose()
            logger.exception("engine failure on %s", prepared.request.request_id)
            raise EngineError(f"the engine failed: {type(exc).__name__}") from exc
        except BaseException:
            await steps.aclose()
            raise
        return self._frames(prepared, renderer, steps, first)

    async def _frames(
        self,
        prepared: PreparedGeneration,
        renderer: StreamRenderer,
        steps: AsyncGenerator[TextStep, None],
        first: TextStep | None,
    ) -> AsyncIterator[bytes]:
        request = prepared.request
        completion_tokens = 0
        finish: FinishReason | None = None
        try:
            for frame in renderer.begin():
                yield frame
            scores = first.prompt_logprobs if first is not None else None
            prompt_logprobs = self._prompt_logprobs(prepared, scores)  # sent once, with the first delta
            if request.sampling.echo:
                real_prompt = first.prompt_token_ids if first is not None else None
                echoed = self._echo_infos(request, real_prompt, scores) if request.sampling.logprobs is not None \
                    else None
                for frame in renderer.delta(self._prompt_text(request, real_prompt), echoed, prompt_logprobs):
                    yield frame
                prompt_logprobs = None
            held: list[str] = []  # a tool call's text: sent whole once complete, as the call
            step = first
            while step is not None:
                completion_tokens += len(step.token_ids)
                finish = step.finish_reason or finish
                logprobs = self._logprob_infos(step.logprobs) if request.sampling.logprobs is not None else None
                text = step.text
                if prepared.tool_call:
                    held.append(text)
                    text = ""
                for frame in renderer.delta(text, logprobs, prompt_logprobs):
                    yield frame
                prompt_logprobs = None
                step = await anext(steps, None)
            finish_reason: str | None = finish
            if prepared.tool_call:
                frames, finish_reason = self._held_call_frames(prepared, renderer, "".join(held), finish)
                for frame in frames:
                    yield frame
            for frame in renderer.finish(finish_reason, Usage(request.prompt_len, completion_tokens)):
                yield frame
        except ServingError as exc:
            for frame in renderer.error(exc):
                yield frame
        except Exception as exc:
            logger.exception("stream failure on %s", request.request_id)
            for frame in renderer.error(EngineError(f"the engine failed: {type(exc).__name__}")):
                yield frame
        finally:
            await steps.aclose()

    @staticmethod
    def _tool_calls(prepared: PreparedGeneration, text: str, finish: str | None) -> list[dict[str, Any]] | None:
        """The forced tool call a finished answer made; None for plain text or a call cut short."""
        if not prepared.tool_call or finish != "stop":
            return None
        return tool_calls_from_text(text, "call_" + prepared.request.request_id)

    def _held_call_frames(self, prepared: PreparedGeneration, renderer: StreamRenderer, text: str,
                          finish: str | None) -> tuple[list[bytes], str | None]:
        """A held-back tool call's frames and the finish reason to report: the whole call, or its text when cut
        short (``max_tokens``)."""
        calls = self._tool_calls(prepared, text, finish)
        if calls is None:
            return renderer.delta(text), finish
        return renderer.tool_calls(calls), "tool_calls"

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

    def _logprob_info(self, lp: TokenLogprob) -> TokenLogprobInfo:
        decode = self.tokenizer.decode
        return TokenLogprobInfo(decode([lp.token_id]), lp.logprob, tuple((decode([t]), v) for t, v in lp.top))

    def _logprob_infos(self, logprobs: Sequence[TokenLogprob]) -> list[TokenLogprobInfo]:
        return [self._logprob_info(lp) for lp in logprobs]
