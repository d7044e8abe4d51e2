"""The vllm engine's adapter: vLLM's ``AsyncLLM`` in this process, its engine core in vLLM's own process.

CTX runs the prompt for one token with ``do_remote_decode`` and hands on what vLLM's KV connector answers, with its
seed (``handoff.py``); GEN loads that KV with ``do_remote_prefill`` and chooses the first tokens again under the same
seed and grammar, so, as in vLLM's own P/D, GEN's choice is the answer's. The prompt stays an int32 array until
``vllm_api.vllm_prompt``. vLLM's exceptions are translated here, and closing ``generate``'s iterator aborts the
request in vLLM. See docs/engines.md, "Disaggregation through vLLM's KV connector"."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import os
from collections.abc import AsyncGenerator
from typing import Any

import numpy as np
from prometheus_client import CollectorRegistry, Counter, generate_latest

from frontend.errors import (
    ContextLengthError,
    EngineError,
    InvalidRequestError,
    ServingError,
)
from workers.engines.base import Tokenizer
from workers.engines.options import EngineOptions, TokenizeConfig, VllmConfig
from workers.engines.outputs import EngineInfo, EngineOutput
from workers.engines.request import GenerationRequest, Phase
from workers.engines.vllm.first_tokens import FirstTokenWatch, handoff_seed
from workers.engines.vllm.handoff import VllmHandoff, parse_handoff
from workers.engines.vllm.memory import (
    MemoryShareError,
    host_memory,
    memory_engine_args,
    startup_failure_hint,
    user_memory_setting,
    weights_bytes,
)
from workers.engines.vllm.sampling import refuse_n_across_handoff, repeated_sequences, vllm_sampling_fields
from workers.engines.vllm.served_model import ServedModel, checkpoint_hash, resolve_model
from workers.engines.vllm.tokenizer import HFTokenizer
from workers.engines.vllm.vllm_api import finish_reason_of, import_vllm, kv_capacity_of, token_logprobs, vllm_prompt

logger = logging.getLogger(__name__)


def create(options: EngineOptions) -> VllmEngine:
    """The factory ``workers.engines.factory`` calls for ``--engine vllm``."""
    return VllmEngine(options.vllm, options.model_path, options.served_model_name, options.tokenize)


class VllmEngine:
    """The typed adapter over vLLM's ``AsyncLLM``; also a ``ProvidesTokenizer`` and, with vLLM's prefix caching
    on, ``ReportsKvCapacity``."""

    def __init__(self, config: VllmConfig, model_path: str | None = None, served_model_name: str | None = None,
                 tokenize: TokenizeConfig | None = None):
        self._tokenize = tokenize
        self.config = config
        self._model_path = model_path
        self._served_model_name = served_model_name
        self._info: EngineInfo | None = None
        self._tokenizer: HFTokenizer | None = None
        self._llm: Any = None  # vllm.v1.engine.async_llm.AsyncLLM, imported only in start()
        self._vllm: Any = None
        self._connector: str | None = None  # the KV connector's name, from --kv-transfer-config
        # Our own metric beside vLLM's (``metrics_text``), in a registry of this engine's, so engines built in one
        # process (tests) never collide. Both label values exist from start-up: a scraper sees 0, not nothing.
        self._registry = CollectorRegistry()
        self._first_token_differed = Counter(
            "disagg_vllm_first_token_differed",
            "GEN sequences whose first token GEN's vLLM chose otherwise than CTX's (the answer continues from GEN's), "
            "by sampling: greedy (a near-tie flipped) or sampled (a seeded draw moved)",
            ["sampling"], registry=self._registry)
        for sampling in _SAMPLING_LABELS:
            self._first_token_differed.labels(sampling=sampling)

    @property
    def info(self) -> EngineInfo:
        if self._info is None:
            raise EngineError("the vllm engine has not started")
        return self._info

    def get_tokenizer(self) -> Tokenizer:
        if self._tokenizer is None:
            raise EngineError("the vllm engine has not started")
        return self._tokenizer

    async def start(self) -> None:
        model = await asyncio.to_thread(resolve_model, self._model_path, self._served_model_name)
        self._tokenizer = await asyncio.to_thread(HFTokenizer, model.folder, self._tokenize)
        model_hash = await asyncio.to_thread(checkpoint_hash, model.folder)
        self._vllm = await asyncio.to_thread(import_vllm)  # ~9 s of imports, off the event loop
        memory_args = await asyncio.to_thread(self._memory_args, model)
        args = self._vllm.AsyncEngineArgs(**self._engine_args(model), **memory_args)
        try:
            self._llm = self._vllm.AsyncLLM.from_engine_args(args)
        except Exception as exc:
            # vLLM's engine core logs why it failed and raises "Engine core initialization failed" here: when it
            # was memory (the usual cause on a CPU shared with another engine), say which setting fixes it.
            hint = await asyncio.to_thread(self._startup_hint, model, memory_args)
            raise EngineError(f"vLLM failed to start: {exc}" + (f"; {hint}" if hint else "")) from exc
        max_context = int(self._llm.model_config.max_model_len)
        self._info = EngineInfo(
            engine="vllm", model=model.name, vocab_size=self._tokenizer.vocab_size, max_context=max_context,
            model_hash=model_hash,
            # vLLM's prefix cache keys blocks by token values, and GEN needs the real prompt: never placeholders.
            kv_block_reuse=True, prompt_tokens_in_handoff=False, supports_logprobs=True,
            supports_structured_output=True, supports_n=True,
        )
        self._connector = json.loads(self.config.kv_transfer_config or "{}").get("kv_connector")

    def _engine_args(self, model: ServedModel) -> dict[str, Any]:
        c = self.config
        args: dict[str, Any] = {
            "model": str(model.folder), "served_model_name": [model.name], "dtype": c.dtype,
            "enforce_eager": c.enforce_eager, "max_num_seqs": c.max_num_seqs, "disable_log_stats": False,
            # vLLM's structured output needs its tokenizer (llguidance builds its token trie from it); vLLM still
            # never detokenizes (``detokenize`` off in every request).
            "tokenizer": str(model.folder), "skip_tokenizer_init": False,
            "structured_outputs_config": self._vllm.StructuredOutputsConfig(backend="guidance"),
        }
        if c.max_model_len is not None:
            args["max_model_len"] = c.max_model_len
        if c.kv_transfer_config is not None:
            args["kv_transfer_config"] = self._vllm.KVTransferConfig(**json.loads(c.kv_transfer_config))
        return args

    def _memory_args(self, model: ServedModel) -> dict[str, Any]:
        c = self.config
        try:
            args = memory_engine_args(
                kv_cache_memory_bytes=c.kv_cache_memory_bytes, gpu_memory_utilization=c.gpu_memory_utilization,
                engines_on_host=c.engines_on_host, on_cpu=self._vllm.on_cpu, environ=os.environ,
                memory=host_memory, weights=lambda: weights_bytes(model.folder))
        except MemoryShareError as exc:
            raise EngineError(str(exc)) from exc
        if c.engines_on_host > 1:
            logger.info("one of %d vLLM engines on this host: %s", c.engines_on_host,
                        user_memory_setting(c.kv_cache_memory_bytes, c.gpu_memory_utilization, os.environ,
                                            self._vllm.on_cpu) or f"its share, {args}")
        return args

    def _startup_hint(self, model: ServedModel, memory_args: dict[str, Any]) -> str | None:
        on_cpu = self._vllm.on_cpu
        try:
            memory = host_memory() if on_cpu else None
            weights = weights_bytes(model.folder)
        except (OSError, KeyError, ValueError):  # no figures to go by: vLLM's own message stands alone
            return None
        return startup_failure_hint(on_cpu, memory, weights, memory_args.get("kv_cache_memory_bytes"),
                                    memory_args.get("gpu_memory_utilization"), os.environ)

    def kv_capacity_tokens(self) -> int | None:
        """The tokens vLLM's KV cache holds (``num_gpu_blocks * block_size``, what its prefix cache can reuse),
        known once started; None before, or with prefix caching off."""
        if self._llm is None:
            return None
        return kv_capacity_of(self._llm.vllm_config.cache_config)

    def metrics_text(self) -> bytes:
        """vLLM's own metrics (``vllm:*``: running requests, prefix-cache and connector hits, ...), which its
        ``AsyncLLM`` records in this process's default Prometheus registry; then this adapter's own."""
        from prometheus_client import REGISTRY

        lines = generate_latest(REGISTRY).split(b"\n")
        kept = [line for line in lines if line.startswith((b"vllm:", b"# HELP vllm:", b"# TYPE vllm:"))]
        return (b"\n".join(kept) + b"\n" if kept else b"") + generate_latest(self._registry)

    async def aclose(self) -> None:
        if self._llm is not None:
            llm, self._llm = self._llm, None
            await asyncio.to_thread(llm.shutdown)

    async def abort(self, request_id: str) -> None:
        if self._llm is not None:
            await self._llm.abort(request_id)

    # -- generation -------------------------------------------------------------------------------------------
    def generate(self, request: GenerationRequest) -> AsyncGenerator[EngineOutput, None]:
        return self._generate(request)

    async def _generate(self, request: GenerationRequest) -> AsyncGenerator[EngineOutput, None]:
        if self._llm is None:
            raise EngineError("the vllm engine has not started")
        if request.prompt_is_placeholder:
            raise InvalidRequestError("the vllm engine needs the real prompt tokens (no metadata-only hand-off)",
                                      param="prompt_token_ids_b64")
        if request.phase is Phase.CONTEXT_ONLY:
            async for output in self._context(request):
                yield output
        elif request.phase is Phase.GENERATION_ONLY:
            async for output in self._continue(request):
                yield output
        else:
            async for output in self._run(request, request.prompt_token_ids_i32, request.max_tokens, None):
                yield output

    async def _context(self, request: GenerationRequest) -> AsyncGenerator[EngineOutput, None]:
        """Prefill and every sequence's first token; the KV stays with vLLM's connector for GEN to fetch."""
        wants_more = request.max_tokens > 1
        if wants_more:  # with one token CTX answers alone: nothing is handed off
            refuse_n_across_handoff(request.sampling, self._connector)
        seed = handoff_seed(request.sampling)
        params = {"do_remote_decode": True} if wants_more else None
        firsts: dict[int, EngineOutput] = {}
        kv_params = None
        async for output, out in self._outputs(request, request.prompt_token_ids_i32, 1, params, seed):
            kv_params = out.kv_transfer_params if out.kv_transfer_params is not None else kv_params
            finish = output.finish_reason
            if finish == "length" and wants_more:  # our cap of one token, not the client's: GEN goes on
                finish = None
            firsts[output.index] = dataclasses.replace(output, finish_reason=finish)
        # One output per sequence; the last carries the hand-off that every unfinished sequence continues from.
        ordered = [firsts[index] for index in sorted(firsts)]
        for position, output in enumerate(ordered):
            if position == len(ordered) - 1 and any(o.finish_reason is None for o in ordered):
                output = dataclasses.replace(output, handoff_state=VllmHandoff(
                    self.info.model_hash, request.prompt_len, kv_params, seed).encode())
            yield output

    async def _continue(self, request: GenerationRequest) -> AsyncGenerator[EngineOutput, None]:
        """vLLM gets the prompt alone with ``do_remote_prefill``, as in its own P/D protocol: it loads the prompt's
        KV through the connector and chooses each sequence's first token again, under the same seed and grammar,
        so seeded sampling, ``n`` and structured output continue exactly as an aggregated run would. Its first
        tokens are the answer's (the first output says ``chose_first_tokens``); where one is not CTX's it is
        counted, and the answer still continues from GEN's: CTX's was never shown to the client."""
        assert request.handoff is not None
        state = parse_handoff(request.handoff.opaque_state, self.info.model_hash, request.prompt_len)
        starts = [start.first_gen_tokens for start in request.handoff.sequences]
        if request.max_tokens <= len(starts[0]):  # CTX's token(s) used the whole budget: GEN chooses nothing
            for index in range(len(starts)):
                yield EngineOutput((), finish_reason="length", index=index)
            return
        seed = state.seed if state.seed is not None else request.sampling.seed
        watch = FirstTokenWatch(starts)
        held: list[EngineOutput] | None = []  # until every sequence has begun: vLLM ending the request before
        # that (an abort) is an error before the first byte of the answer, not an answer missing a sequence
        cached: int | None = None  # prompt tokens vLLM found cached or loaded through its connector
        async with contextlib.aclosing(self._outputs(request, request.prompt_token_ids_i32, request.max_tokens,
                                                     state.for_decode(), seed)) as outputs:
            async for output, out in outputs:
                if cached is None:
                    cached = int(getattr(out, "num_cached_tokens", None) or 0)
                differed = watch.see(output)
                if differed is not None:
                    self._count_differed(request, differed, starts[differed])
                if held is None:
                    if output.token_ids or output.finish_reason is not None:
                        yield output
                    continue
                held.append(output)
                if watch.done:
                    first, *rest = _without_empty_tail(held)
                    block = getattr(self._llm.vllm_config.cache_config, "block_size", None) or 1
                    yield dataclasses.replace(first, chose_first_tokens=True, recomputed_tokens=recomputed_tokens(
                        request.prompt_len, cached or 0, int(block)))
                    for kept in rest:
                        yield kept
                    held = None
        if held is not None:
            raise EngineError("vLLM ended the request before it continued every sequence")

    def _count_differed(self, request: GenerationRequest, index: int, ctx_start: tuple[int, ...]) -> None:
        sampling = "greedy" if request.sampling.temperature == 0 else "sampled"
        self._first_token_differed.labels(sampling=sampling).inc()
        logger.warning("request %s: GEN's vLLM chose sequence %d's first token(s) otherwise than CTX's %s (%s); "
                       "the answer continues from GEN's", request.request_id, index, list(ctx_start), sampling)

    async def _run(self, request: GenerationRequest, prompt: np.ndarray[Any, Any], max_tokens: int,
                   kv_params: dict[str, Any] | None) -> AsyncGenerator[EngineOutput, None]:
        async for output, _ in self._outputs(request, prompt, max_tokens, kv_params):
            yield output

    async def _outputs(self, request: GenerationRequest, prompt: np.ndarray[Any, Any], max_tokens: int,
                       kv_params: dict[str, Any] | None, seed: int | None = None,
                       ) -> AsyncGenerator[tuple[EngineOutput, Any], None]:
        vllm = self._vllm
        assert self._tokenizer is not None
        fields = vllm_sampling_fields(request.sampling, max_tokens, self._tokenizer.eos_token_ids, kv_params, seed)
        try:
            if "structured_outputs" in fields:
                fields["structured_outputs"] = vllm.StructuredOutputsParams(**fields["structured_outputs"])
            sampling = vllm.SamplingParams(output_kind=vllm.RequestOutputKind.DELTA, **fields)
        except (ValueError, vllm.ClientError) as exc:
            raise InvalidRequestError(f"vLLM refused the sampling parameters: {exc}") from exc
        copies = repeated_sequences(request.sampling)
        finished = False
        stream = self._llm.generate(vllm_prompt(vllm, prompt), sampling, request.request_id)
        try:
            async for out in stream:
                finished = out.finished
                for completion in out.outputs:  # n > 1: one child's new tokens per output
                    output = EngineOutput(tuple(completion.token_ids),
                                          token_logprobs(completion, request.sampling.logprobs),
                                          finish_reason_of(completion.finish_reason), index=completion.index)
                    for index in range(copies):  # greedy n > 1: the one sequence, as each of the n
                        yield (output if copies == 1 else dataclasses.replace(output, index=index)), out
        except ServingError:
            raise
        except (ValueError, vllm.ClientError) as exc:  # vLLM's input checks: a prompt over the context, a schema, ...
            message = str(exc)
            if "longer than the maximum model length" in message or "max_model_len" in message:
                raise ContextLengthError(message, param="messages") from exc
            raise InvalidRequestError(f"vLLM refused the request: {message}") from exc
        except Exception as exc:
            raise EngineError(f"vLLM failed: {type(exc).__name__}: {exc}") from exc
        finally:
            await stream.aclose()
            if not finished:  # the caller went away (a stop string, a client disconnect) or vLLM failed
                await self._llm.abort(request.request_id)


_SAMPLING_LABELS = ("greedy", "sampled")


def recomputed_tokens(prompt_len: int, cached: int, block_size: int) -> int:
    """GEN: the prompt tokens vLLM computed itself that the connector should have loaded, from vLLM's count of
    the request's cached tokens (found in its prefix cache or loaded through the connector). Only whole KV blocks
    before the prompt's last token count: vLLM computes the last token whatever it loaded (its logits choose the
    next one), and a connector may move whole blocks only (ExampleConnector does), so the tail of a partial block
    computed again is no sign of a KV that never moved; a transfer that failed leaves whole blocks uncached."""
    expected = (prompt_len - 1) // block_size * block_size
    return max(0, expected - cached)


def _without_empty_tail(held: list[EngineOutput]) -> list[EngineOutput]:
    """The first held output always (it confirms the hand-off), then only those with tokens or a finish."""
    return held[:1] + [o for o in held[1:] if o.token_ids or o.finish_reason is not None]
