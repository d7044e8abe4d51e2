"""The worker's request logic, free of FastAPI: admit -> parse -> prepare the prompt -> run; the rendering of
the answer is ``workers.response_rendering``'s.

A CTX (context_only) request returns the first token, the KV hand-off and the prompt as base64 int32. A GEN
(generation_only) request continues from the hand-off and answers the client's whole output, first token
included. A plain request (role ``both``) is ordinary aggregated serving.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncGenerator, AsyncIterator, Mapping
from typing import Any
from uuid import UUID

from frontend.disaggregated_params import DisaggregatedParams
from frontend.errors import (
    EngineError,
    InvalidRequestError,
    ModelNotFoundError,
    OverloadedError,
    ServingError,
    UnsupportedParameterError,
)
from frontend.http import validate_wire
from frontend.metrics import Metrics
from frontend.openai_models import GenerationWireRequest, refuse_unsupported_parameters
from frontend.openai_output import ResponseIdentity, StreamRenderer
from frontend.prefix_chain import PrefixChain
from frontend.structured_output import output_constraint
from workers.engines.base import Engine, KVHandoffStore, ProvidesTokenizer, Tokenizer
from workers.engines.request import GenerationRequest, Phase
from workers.internal_callers import InternalCallers
from workers.prefix_holdings import PrefixHoldings
from workers.prepared_generation import CollectedChoice, CollectedOutput, PreparedGeneration
from workers.request_builder import (
    endpoint_of,
    handoff_from,
    phase_of,
    prepare_prompt,
    resolve_max_tokens,
    sampling_params_from,
)
from workers.response_rendering import ResponseRendering
from workers.settings import Role as Role  # public: tests build workers by role
from workers.settings import WorkerSettings as WorkerSettings  # public: built by the CLI, tests and bench
from workers.text_stream import TextStep, stream_text
from workers.trtllm.answers import answers_trtllm, finished_at_context, first_tokens_only, new_request_id
from workers.trtllm.checks import check_request
from workers.trtllm.generation_first import HandoffBoard, pull_handoff
from workers.trtllm.lifecycle import LifecycleControl

logger = logging.getLogger(__name__)

_ID_PREFIX = {"chat": "chatcmpl-", "completions": "cmpl-", "responses": "resp_"}



def _comes_first(disagg: DisaggregatedParams | None) -> bool:
    """A generation-first GEN request sent before CTX answered: it carries no hand-off yet."""
    return (disagg is not None and disagg.request_type == "generation_only" and disagg.schedule_style == 1
            and disagg.encoded_opaque_state is None and disagg.first_gen_tokens is None)


class WorkerService(ResponseRendering):
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

    async def _release_handoff(self, ctx_request_id: str, state: bytes) -> bool:
        engine = self.engine
        return isinstance(engine, KVHandoffStore) and await engine.release_handoff(ctx_request_id, state)

    # -- admission and parsing -------------------------------------------------------------------------
    async def prepare(self, body: dict[str, Any], wire_model: type[GenerationWireRequest],
                      chain_header: str | None = None, headers: Mapping[str, str] | None = None
                      ) -> PreparedGeneration:
        """``chain_header``: the request's ``CHAIN_HEADER`` (frontend/prefix_chain.py), if it came with one;
        ``headers``: the request's, for the credentials of one whose ``disaggregated_params`` name where this worker
        goes next (``workers.internal_callers``)."""
        refuse_unsupported_parameters(body)
        wire = validate_wire(wire_model, body)
        info = self.engine.info
        if wire.model != info.model:
            raise ModelNotFoundError(f"the model '{wire.model}' does not exist; this worker serves '{info.model}'",
                                     param="model")
        disagg = wire.disaggregated_params
        if disagg is not None and not self.callers.open:
            self.callers.require_for_params(headers or {}, disagg.model_dump(mode="json"))
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
        # v1: the attempt's transfer_session_id is its claim on the hand-off (workers/trtllm/generation_first.py).
        claim = str(disagg.transfer_session_id) if disagg.transfer_session_id is not None else None
        pull = asyncio.ensure_future(pull_handoff(self.lifecycle.http(), endpoint, disagg.disagg_request_id,
                                                  self.settings.lifecycle.generation_first_wait_s, claim))
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

    def _text_steps(self, prepared: PreparedGeneration) -> AsyncGenerator[TextStep, None]:
        if prepared.answered_at_context:
            assert prepared.disagg is not None
            return first_tokens_only(prepared.disagg, self.tokenizer, self.engine.info.vocab_size)
        return stream_text(self.engine, self.tokenizer.detokenizer, prepared.request)


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
