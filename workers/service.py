"""The worker's request path, free of FastAPI: admit -> prepare -> run -> render.

A CTX (context_only) request answers the first token, the KV hand-off and the prompt; a GEN (generation_only)
request continues from the hand-off and answers the client's whole output; a plain request (role ``both``) is
aggregated serving. The answer's shape (``workers.dialects``) is chosen once, in ``prepare``.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import AsyncGenerator, AsyncIterator, Mapping
from typing import Any

from frontend import stream_token_ids
from frontend.disaggregated_params import DisaggregatedParams
from frontend.errors import EngineError, InvalidRequestError, ModelNotFoundError, OverloadedError, ServingError
from frontend.http import validate_wire
from frontend.metrics import Metrics
from frontend.openai_models import GenerationWireRequest, ResponsesRequest, refuse_unsupported_parameters
from frontend.openai_output import ResponseIdentity, ResponsesSettings
from frontend.prefix_chain import PrefixChain
from frontend.responses_tools import ResponsesNamedToolChoice
from frontend.structured_output import OutputConstraint, output_constraint
from frontend.tool_calls import ToolCalling, tool_calling_for
from frontend.tool_parsers import ToolCallFormat, choose_format
from workers.dialects import NATIVE, AnswerDialect
from workers.engines.base import DeclaresChatTemplate, Engine, KVHandoffStore, ProvidesTokenizer, Tokenizer
from workers.engines.request import GenerationRequest, Phase
from workers.handoff_counts import StorelessHandoffs
from workers.internal_callers import InternalCallers
from workers.prefix_holdings import PrefixHoldings
from workers.prepared_generation import PreparedGeneration
from workers.rendering import Renderer
from workers.request_builder import (
    endpoint_of,
    handoff_from,
    phase_of,
    prepare_prompt,
    resolve_max_tokens,
    sampling_params_from,
)
from workers.settings import WorkerSettings
from workers.text_stream import CollectedOutput, TextStep, stream_text
from workers.trtllm.answers import Trtllm, first_tokens_only, new_request_id
from workers.trtllm.checks import check_request
from workers.trtllm.generation_first import HandoffBoard, comes_first, wait_for_handoff
from workers.trtllm.lifecycle import LifecycleControl

logger = logging.getLogger("disagg_serve.worker")

_ID_PREFIX = {"chat": "chatcmpl-", "completions": "cmpl-", "responses": "resp_"}


def responses_settings(wire: GenerationWireRequest) -> ResponsesSettings:
    """What a Responses request set that its Response object repeats; nothing for the other endpoints."""
    if not isinstance(wire, ResponsesRequest):
        return ResponsesSettings()
    choice = wire.tool_choice
    return ResponsesSettings(wire.instructions, wire.temperature, wire.max_output_tokens,
                             tuple(tool.echoed() for tool in wire.tools or ()),
                             {"type": "function", "name": choice.name} if isinstance(choice, ResponsesNamedToolChoice)
                             else choice or "auto",
                             wire.parallel_tool_calls if wire.parallel_tool_calls is not None else True)


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
        secret = settings.internal_secret
        self.lifecycle = LifecycleControl(settings.role, settings.lifecycle, abort_request=engine.abort,
                                          release_handoff=self._release_handoff,
                                          peer_headers=secret.headers() if secret is not None else None)
        self.board = HandoffBoard(settings.lifecycle.artifact_ttl_s, settings.lifecycle.clock)
        self.callers = InternalCallers(secret, settings.trtllm_auth_key)
        self.renderer = Renderer(engine)
        self._tool_format: tuple[ToolCallFormat | None] | None = None  # (the format,) once chosen
        self.handoff_counts = StorelessHandoffs(metrics, engine)
        self._trtllm = Trtllm(self.lifecycle, self.board)
        self._trtllm_for_us = Trtllm(self.lifecycle, self.board, keeps_prompt_logprobs=True)

    @property
    def tokenizer(self) -> Tokenizer:
        """The engine's tokenizer (asked each time: an engine has one only once it has started)."""
        return self._tokenizer_source.get_tokenizer()

    def tool_format(self) -> ToolCallFormat | None:
        """The model's tool-call format: the one ``--tool-call-parser`` names or its chat template declares (chosen
        at the first request: the tokenizer comes with the started engine); None where no parser reads it."""
        if self._tool_format is None:
            tokenizer = self.tokenizer
            template = tokenizer.chat_template if isinstance(tokenizer, DeclaresChatTemplate) else None
            self._tool_format = (choose_format(self.settings.tool_call_parser, template),)
        return self._tool_format[0]

    def tool_calling(self, wire: GenerationWireRequest, constraint: OutputConstraint | None) -> ToolCalling | None:
        """How the answer to ``wire`` is read for tool calls, in the model's format."""
        return tool_calling_for(wire, constraint, self.tool_format())

    async def _release_handoff(self, ctx_request_id: str, state: bytes) -> bool:
        engine = self.engine
        return isinstance(engine, KVHandoffStore) and await engine.release_handoff(ctx_request_id, state)

    # -- admit ------------------------------------------------------------------------------------------------------
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

    # -- prepare ----------------------------------------------------------------------------------------------------
    def dialect_of(self, disagg: DisaggregatedParams | None, from_our_process: bool = False) -> AnswerDialect:
        """The answer's shape: TensorRT-LLM's for a cross-side caller that did not ask for ours (our orchestrator
        sets ``native_extensions`` on its own wire), ours otherwise; TensorRT-LLM's keeps our ``prompt_logprobs``
        for a caller that proved it is one of this deployment's processes. Chosen here only."""
        if disagg is None or disagg.native_extensions:
            return NATIVE
        return self._trtllm_for_us if from_our_process else self._trtllm

    def require_model(self, model: str) -> None:
        """A 404 in OpenAI's shape unless ``model`` is the one this worker serves."""
        served = self.engine.info.model
        if model != served:
            raise ModelNotFoundError(f"the model '{model}' does not exist; this worker serves '{served}'",
                                     param="model")

    async def prepare(self, body: dict[str, Any], wire_model: type[GenerationWireRequest],
                      chain_header: str | None = None, headers: Mapping[str, str] | None = None
                      ) -> PreparedGeneration:
        """``chain_header``: the request's ``CHAIN_HEADER`` (frontend/prefix_chain.py), if it came with one;
        ``headers``: the request's, for the credentials of one whose ``disaggregated_params`` name where this worker
        goes next (``workers.internal_callers``)."""
        refuse_unsupported_parameters(body)
        wire = validate_wire(wire_model, body)
        self.require_model(wire.model)
        disagg = wire.disaggregated_params
        if disagg is not None and not self.callers.open:
            self.callers.require_for_params(headers or {}, disagg.model_dump(mode="json"))
        phase = phase_of(disagg)
        self._check_role(phase)
        # TensorRT-LLM's lifecycle v1 governs TensorRT-LLM's wire; our orchestrator's own wire (native_extensions)
        # hands off through our KV transfer, which it does not touch: a v1 worker serves both.
        trtllm_wire = disagg is not None and not disagg.native_extensions
        if trtllm_wire:
            check_request(disagg, self.settings.role, self.lifecycle)
        request_id = new_request_id(disagg)
        grant = None
        if trtllm_wire and self.lifecycle.enabled and phase is Phase.GENERATION_ONLY:
            assert disagg is not None
            grant = self.lifecycle.bind(disagg, request_id)
        try:
            if comes_first(disagg):
                assert disagg is not None
                disagg = await wait_for_handoff(disagg, self.lifecycle, self.settings.lifecycle.generation_first_wait_s,
                                                grant)
            dialect = self.dialect_of(disagg, self.callers.has_token(headers or {}))
            prepared = await self._prepare(wire, disagg, dialect, phase, request_id, chain_header)
        except BaseException:
            if grant is not None:
                self.lifecycle.finish(grant, ok=False)
            raise
        prepared.grant = grant
        prepared.stream_token_ids = headers is not None and headers.get(stream_token_ids.HEADER) == "1"
        return prepared

    async def _prepare(self, wire: GenerationWireRequest, disagg: DisaggregatedParams | None, dialect: AnswerDialect,
                       phase: Phase, request_id: str, chain_header: str | None) -> PreparedGeneration:
        info = self.engine.info
        constraint = output_constraint(wire)
        sampling = sampling_params_from(wire, info, constraint)
        tool_calling = self.tool_calling(wire, constraint)
        if tool_calling is not None and tool_calling.grammar is not None and info.supports_structured_output:
            sampling = dataclasses.replace(sampling, grammar=tool_calling.grammar)  # auto: text or well-formed calls
        dialect.refuse_unservable(wire, sampling, phase)
        prompt = await prepare_prompt(wire, sampling, info, self.tokenizer, tool_calling, self.tool_format())
        sampling = resolve_max_tokens(wire, sampling, int(prompt.tokens.size), info)
        assert sampling.max_tokens is not None
        # Decided against the resolved budget: only first tokens that used it all up finish the request at CTX.
        answered_at_context = dialect.answered_at_context(disagg, sampling)
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
        ident = ResponseIdentity(endpoint, _ID_PREFIX[endpoint] + request_id, info.model,
                                 settings=responses_settings(wire))
        # Only an engine run holds the prompt's KV: not an answer made of CTX's first tokens alone.
        chain = self._chain(chain_header, request_id) if chain_header and not answered_at_context else None
        return PreparedGeneration(wire, request, ident, disagg, dialect, tool_calling=tool_calling,
                                  answered_at_context=answered_at_context, chain=chain)

    def _check_role(self, phase: Phase) -> None:
        role = self.settings.role
        if phase is Phase.GENERATION_ONLY and role == "context":
            raise InvalidRequestError("this worker has role 'context' and takes no generation_only requests",
                                      param="disaggregated_params.request_type")
        if phase is Phase.CONTEXT_ONLY and role == "generation":
            raise InvalidRequestError("this worker has role 'generation' and takes no context_only requests",
                                      param="disaggregated_params.request_type")

    def _chain(self, header: str, request_id: str) -> PrefixChain | None:
        if self.holdings is None:
            return None  # nothing published here: the chain is not even parsed
        try:
            return PrefixChain.from_header(header)
        except ValueError:
            logger.debug("request %s: a malformed prefix chain header, ignored", request_id)
            return None

    # -- run and render ---------------------------------------------------------------------------------------------
    async def complete(self, prepared: PreparedGeneration) -> dict[str, Any]:
        """Run to the end and return the whole answer's body."""
        collected = CollectedOutput.of(prepared.request.sampling.n)
        unheld = prepared.chain is not None
        ok = False
        try:
            async for step in self._text_steps(prepared):
                self._took_handoff(prepared, step)
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
        if collected.handoff_state is not None and prepared.request.phase is Phase.CONTEXT_ONLY:
            self.handoff_counts.parked()
        return self.renderer.whole(prepared, collected)

    async def open_stream(self, prepared: PreparedGeneration) -> AsyncIterator[bytes]:
        """Start the stream and return its frames. Fails as an HTTP error if it fails before the first token."""
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
            self._took_handoff(prepared, first)
            self._hold(prepared)
        return self.renderer.frames(prepared, steps, first, self._finish_grant)

    def _text_steps(self, prepared: PreparedGeneration) -> AsyncGenerator[TextStep, None]:
        if prepared.answered_at_context:
            assert prepared.disagg is not None
            return first_tokens_only(prepared.disagg, self.tokenizer, self.engine.info.vocab_size)
        return stream_text(self.engine, self.tokenizer.detokenizer, prepared.request)

    def _took_handoff(self, prepared: PreparedGeneration, step: TextStep) -> None:
        """The first output of a GEN request: its engine holds the KV, CTX no longer does; and what of the prompt
        it computed itself is known (its answer's head says so: ``workers.handoff_counts``)."""
        if prepared.grant is not None:
            self.lifecycle.handoff_taken(prepared.grant)
        if prepared.recomputed_tokens is None and prepared.request.phase is Phase.GENERATION_ONLY:
            prepared.recomputed_tokens = step.recomputed_tokens
            self.handoff_counts.taken()

    def _hold(self, prepared: PreparedGeneration) -> None:
        """The engine has this request's prompt KV (its first output came): record it for routing."""
        holdings, chain = self.holdings, prepared.chain
        if holdings is not None and chain is not None:
            holdings.record(chain, prepared.request.prompt_len)

    def _finish_grant(self, prepared: PreparedGeneration, ok: bool) -> None:
        grant, prepared.grant = prepared.grant, None
        if grant is not None:
            self.lifecycle.finish(grant, ok)
