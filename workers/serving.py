"""The worker's request logic, free of FastAPI: admit -> parse -> prepare the prompt -> run -> render.

A CTX (context_only) request returns the first token, the KV hand-off and the prompt as base64 int32. A GEN
(generation_only) request continues from the hand-off and answers the client's whole output, first token
included. A plain request (role ``both``) is ordinary aggregated serving.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncGenerator, AsyncIterator, Sequence
from dataclasses import dataclass, field
from typing import Any
from uuid import UUID

import pybase64

from frontend.disaggregated_params import DisaggregatedParams
from frontend.errors import (
    EngineError,
    InvalidRequestError,
    ModelNotFoundError,
    OverloadedError,
    ServingError,
    UnsupportedParameterError,
)
from frontend.http import DEFAULT_MAX_BODY_BYTES_READING, validate_wire
from frontend.metrics import Metrics
from frontend.openai_models import GenerationWireRequest, refuse_unsupported_parameters
from frontend.openai_output import (
    ChoiceOutput,
    ResponseIdentity,
    StreamRenderer,
    TokenLogprobInfo,
    Usage,
    render_choices,
)
from frontend.prefix_chain import PrefixChain
from frontend.structured_output import output_constraint
from frontend.token_codec import TokenArray, encode_prompt_tokens
from frontend.tool_calls import as_tool_call_message, tool_calls_from_text
from workers.engines.base import Engine, KVHandoffStore, ProvidesTokenizer, Tokenizer
from workers.engines.outputs import FinishReason, TokenLogprob
from workers.engines.request import GenerationRequest, Phase
from workers.generation_first import HandoffBoard, pull_handoff
from workers.lifecycle import LifecycleControl, LifecycleSettings, check_request
from workers.lifecycle import Role as Role  # defined once, where the lifecycle checks need it; imported from here
from workers.prefix_holdings import PrefixHoldings
from workers.prompt_logprobs import echo_logprob_infos, token_logprob_info, vllm_prompt_logprobs
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

_ID_PREFIX = {"chat": "chatcmpl-", "completions": "cmpl-", "responses": "resp_"}


@dataclass(frozen=True, slots=True)
class WorkerSettings:
    role: Role = "both"
    max_body_bytes: int = 64 * 1024 * 1024
    max_concurrent_requests: int = 512
    max_body_bytes_reading: int = DEFAULT_MAX_BODY_BYTES_READING  # frontend/http.py: BodyBudget
    admin_key: str | None = None  # guards the worker's admin endpoints (the hand-off ledger); None: they answer 403
    # KV events (workers/prefix_holdings.py): where the publisher binds (ZMQ; port 0: any) and its replay socket.
    # None: no events / no replay. Published only by an engine that reuses KV (``ReportsKvCapacity``).
    kv_events_endpoint: str | None = "tcp://127.0.0.1:0"
    kv_events_replay_endpoint: str | None = "tcp://127.0.0.1:0"
    # TensorRT-LLM's lifecycle protocol (workers/lifecycle.py): v0 unless turned on, as in TensorRT-LLM.
    lifecycle: LifecycleSettings = field(default_factory=LifecycleSettings)


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


def _comes_first(disagg: DisaggregatedParams | None) -> bool:
    """A generation-first GEN request sent before CTX answered: it carries no hand-off yet."""
    return (disagg is not None and disagg.request_type == "generation_only" and disagg.schedule_style == 1
            and disagg.encoded_opaque_state is None and disagg.first_gen_tokens is None)


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
        self.holdings: PrefixHoldings | None = None  # set while KV events are published (workers/server.py)
        self.lifecycle = LifecycleControl(settings.role, settings.lifecycle, abort_request=engine.abort,
                                          release_handoff=self._release_handoff)
        self.board = HandoffBoard(settings.lifecycle.artifact_ttl_s, settings.lifecycle.clock)

    async def _release_handoff(self, ctx_request_id: str, state: bytes) -> bool:
        engine = self.engine
        return isinstance(engine, KVHandoffStore) and await engine.release_handoff(ctx_request_id, state)

    # -- admission and parsing -------------------------------------------------------------------------
    async def prepare(self, body: dict[str, Any], wire_model: type[GenerationWireRequest],
                      chain_header: str | None = None) -> PreparedGeneration:
        """``chain_header``: the request's ``CHAIN_HEADER`` (frontend/prefix_chain.py), if it came with one."""
        refuse_unsupported_parameters(body)
        wire = validate_wire(wire_model, body)
        info = self.engine.info
        if wire.model != info.model:
            raise ModelNotFoundError(f"the model '{wire.model}' does not exist; this worker serves '{info.model}'",
                                     param="model")
        disagg = wire.disaggregated_params
        phase = phase_of(disagg)
        self._check_role(phase)
        check_request(disagg, self.settings.role, self.lifecycle)
        request_id = new_request_id(disagg)
        grant = None
        if self.lifecycle.enabled and phase is Phase.GENERATION_ONLY:
            assert disagg is not None
            grant = self.lifecycle.bind(disagg, request_id)
        try:
            if _comes_first(disagg):
                assert disagg is not None
                disagg = await self._pull_generation_first(disagg, grant)
            prepared = await self._prepare(wire, disagg, phase, request_id, chain_header)
        except BaseException:
            if grant is not None:
                self.lifecycle.finish(grant, ok=False)
            raise
        prepared.grant = grant
        return prepared

    async def _pull_generation_first(self, disagg: DisaggregatedParams, grant: UUID | None) -> DisaggregatedParams:
        """GEN came first: wait (bounded) for CTX's hand-off by ``disagg_request_id`` and continue from it."""
        endpoint = disagg.ctx_info_endpoint
        if isinstance(endpoint, list):
            endpoint = endpoint[0] if endpoint else None
        if not endpoint or disagg.disagg_request_id is None:
            raise InvalidRequestError("a generation-first generation_only request needs ctx_info_endpoint and "
                                      "disagg_request_id", param="disaggregated_params.ctx_info_endpoint")
        pull = asyncio.ensure_future(pull_handoff(self.lifecycle.http(), endpoint, disagg.disagg_request_id,
                                                  self.settings.lifecycle.generation_first_wait_s))
        if grant is not None:  # a grant that ends while GEN waits ends the wait too
            ended = asyncio.ensure_future(self.lifecycle.until_ended(grant))
            try:
                await asyncio.wait({pull, ended}, return_when=asyncio.FIRST_COMPLETED)
            finally:
                ended.cancel()
                if not pull.done():
                    pull.cancel()
            self.lifecycle.ensure_live(grant)  # aborted or expired while it waited: the KV is freed, not taken
        params = await pull
        return disagg.model_copy(update={k: params.get(k) for k in (
            "first_gen_tokens", "first_gen_log_probs", "ctx_request_id", "encoded_opaque_state")})

    async def _prepare(self, wire: GenerationWireRequest, disagg: DisaggregatedParams | None, phase: Phase,
                       request_id: str, chain_header: str | None) -> PreparedGeneration:
        info = self.engine.info
        constraint = output_constraint(wire)
        sampling = sampling_params_from(wire, info, constraint)
        if sampling.n > 1 and phase is not Phase.AGGREGATED and answers_trtllm(disagg):
            # TensorRT-LLM's hand-off fields start one sequence; the others' first tokens have no field there.
            raise UnsupportedParameterError("n > 1 is not served in TensorRT-LLM's disaggregated wire; send it to an "
                                            "aggregated worker or through disagg-serve's orchestrator", param="n")
        prompt = await prepare_prompt(wire, sampling, info, self.tokenizer)
        sampling = resolve_max_tokens(wire, sampling, int(prompt.tokens.size), info)
        assert sampling.max_tokens is not None
        # Decided against the resolved budget: only first tokens that used it all up finish the request at CTX.
        answered_at_context = finished_at_context(disagg, sampling.max_tokens)
        if answered_at_context:
            phase = Phase.AGGREGATED  # nothing to continue from: answered from CTX's first tokens (_text_steps)
        handoff = None if answered_at_context else handoff_from(disagg, info.vocab_size, sampling.n)
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
        # Only an engine run holds the prompt's KV: not an answer made of CTX's first tokens alone.
        chain = self._chain(chain_header, request_id) if chain_header and not answered_at_context else None
        return PreparedGeneration(wire, request, ident, disagg, tool_call=tool_call,
                                  answered_at_context=answered_at_context, chain=chain)

    def _chain(self, header: str, request_id: str) -> PrefixChain | None:
        if self.holdings is None:
            return None  # nothing published here: the chain is not even parsed
        try:
            return PrefixChain.from_header(header)
        except ValueError:
            logger.debug("request %s: a malformed prefix chain header, ignored", request_id)
            return None

    def _hold(self, prepared: PreparedGeneration) -> None:
        """The engine has this request's prompt KV (its first output came): record it for routing."""
        holdings, chain = self.holdings, prepared.chain
        if holdings is not None and chain is not None:
            holdings.record(chain, prepared.request.prompt_len)

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
        collected = CollectedOutput([CollectedChoice() for _ in range(prepared.request.sampling.n)])
        unheld = prepared.chain is not None
        ok = False
        try:
            async for step in self._text_steps(prepared):
                self._took_handoff(prepared)
                if unheld:
                    unheld = False
                    self._hold(prepared)
                collected.add(step)
            ok = all(choice.finish_reason not in (None, "abort") for choice in collected.choices)
        except ServingError:
            raise
        except Exception as exc:  # an adapter bug must still answer in OpenAI's shape
            logger.exception("engine failure on %s", prepared.request.request_id)
            raise EngineError(f"the engine failed: {type(exc).__name__}") from exc
        finally:
            self._finish_grant(prepared, ok)
        return self._render_whole(prepared, collected)

    def _took_handoff(self, prepared: PreparedGeneration) -> None:
        """The first output of a GEN request: its engine holds the KV, CTX no longer does."""
        if prepared.grant is not None:
            self.lifecycle.handoff_taken(prepared.grant)

    def _finish_grant(self, prepared: PreparedGeneration, ok: bool) -> None:
        grant, prepared.grant = prepared.grant, None
        if grant is not None:
            self.lifecycle.finish(grant, ok)

    def _text_steps(self, prepared: PreparedGeneration) -> AsyncGenerator[TextStep, None]:
        if prepared.answered_at_context:
            assert prepared.disagg is not None
            return first_tokens_only(prepared.disagg, self.tokenizer, self.engine.info.vocab_size)
        return stream_text(self.engine, self.tokenizer.detokenizer, prepared.request)

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
                self.lifecycle.park(disagg, request.request_id, out.handoff_state if state is not None else None)
            if disagg.schedule_style == 1 and disagg.disagg_request_id is not None:
                self.board.post(disagg.disagg_request_id, body["choices"][0]["disaggregated_params"])
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
            self._finish_grant(prepared, False)
            raise
        except Exception as exc:  # an adapter bug before the first byte: still an OpenAI-shaped engine error
            await steps.aclose()
            self._finish_grant(prepared, False)
            logger.exception("engine failure on %s", prepared.request.request_id)
            raise EngineError(f"the engine failed: {type(exc).__name__}") from exc
        except BaseException:
            await steps.aclose()
            self._finish_grant(prepared, False)
            raise
        if first is not None:
            self._took_handoff(prepared)
            self._hold(prepared)
        return self._frames(prepared, renderer, steps, first)

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
