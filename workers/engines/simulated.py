"""The simulated engine: computes nothing, but spends an engine's time, and keeps a prefix cache that routing can win.

For fleet benchmarks of routing (``bench.fleet``), where what matters is which worker's cache a request meets, not
what a model computes. Its time is real (``asyncio.sleep``), its work is a model of a GPU engine's:

- **prefill**: one at a time, first come first served, each taking ``prefill_base_s + uncached / prefill_tokens_per_s``
  seconds, where ``uncached`` is the prompt's length less the tokens its prefix cache already holds;
- **a prefix cache** of ``BLOCK_TOKENS``-token blocks, each named by a hash chained over the token values of every
  block up to it (as ``workers.engines.reference.prefix_cache.block_keys``), so a hit is always a whole prefix; LRU,
  bounded to ``prefix_cache_tokens``; a prompt's last token is always prefilled (its logits choose the first token);
  blocks are refreshed tail first, so eviction takes a prompt's tail before its head (as vLLM frees blocks);
- **decode**: ``inter_token_latency_s`` per token, for every sequence at once (decode is batched);
- **the hand-off** (context-only, then generation-only) is the synthetic engine's, and a GEN worker that accepts one
  puts the prompt's blocks into its own cache: it now holds that KV, so an aggregated request there later hits it.

Output token i is the synthetic engine's (``SYNTHETIC_TEXT``), so aggregated and disaggregated answers agree; with
``--tokenizer reference`` it takes the reference model's real tokenizer as the synthetic engine does. Unlike
the synthetic engine it reads the prompt's token values: its cache keys are made of them (``kv_block_reuse``, so
the metadata-only guardrail relays real tokens to it). Its counters are on the worker's ``/metrics``
(``disagg_engine_prefix_cache_*``, ``disagg_engine_prefill*``).

``observe_prefills(observer)`` (benchmarks only) shows every prefill of the process, as it starts, to one observer:
``bench.fleet``'s ledger of what any cache could have hit.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import hashlib
import time
from collections.abc import AsyncGenerator, Callable
from dataclasses import dataclass, replace

from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest

from frontend.errors import EngineError
from frontend.token_codec import TokenArray
from workers.engines.base import Tokenizer
from workers.engines.byte_tokenizer import ByteTokenizer
from workers.engines.options import EngineOptions, SimulatedConfig, TokenizeConfig
from workers.engines.outputs import EngineInfo, EngineOutput
from workers.engines.request import GenerationRequest, Phase
from workers.engines.synthetic import (
    BYTE_ANSWER,
    EngineTokens,
    certain_logprobs,
    check_tokenizer,
    finish_reason,
    first_output,
    handoff_finish,
    handoff_position,
    load_engine_tokens,
    token_at,
)

__all__ = ["BLOCK_TOKENS", "PrefillObserver", "SimulatedConfig", "SimulatedEngine", "SimulatedStats", "block_keys",
           "create", "observe_prefills", "usable_blocks"]

BLOCK_TOKENS = 16
_ENGINE = "simulated"


def create(options: EngineOptions) -> SimulatedEngine:
    """The factory ``workers.engines.factory`` calls for ``--engine simulated``."""
    config = options.simulated
    if options.served_model_name:
        config = replace(config, model=options.served_model_name)
    return SimulatedEngine(config, tokenizer=options.tokenizer, tokenize=options.tokenize)


def block_keys(tokens: TokenArray, block_tokens: int = BLOCK_TOKENS) -> list[bytes]:
    """One key per full block of ``tokens``: a hash of the previous block's key and this block's int32 bytes."""
    raw = tokens.tobytes()  # one copy of the prompt's bytes, then slices of it
    step = block_tokens * 4
    keys: list[bytes] = []
    previous = b""
    for start in range(0, (len(raw) // step) * step, step):
        previous = hashlib.blake2b(previous + raw[start : start + step], digest_size=16).digest()
        keys.append(previous)
    return keys


def usable_blocks(prompt_len: int, block_tokens: int = BLOCK_TOKENS) -> int:
    """Blocks a prefill may take from a cache: the last token is always computed."""
    return max(prompt_len - 1, 0) // block_tokens


# (block keys, prompt length) of each prefill as it starts, for a benchmark's ledger (bench.fleet)
PrefillObserver = Callable[[list[bytes], int], object]
_PREFILL_OBSERVER: PrefillObserver | None = None


def observe_prefills(observer: PrefillObserver | None) -> None:
    """Show every prefill any simulated engine of this process starts to ``observer`` (None: to nobody)."""
    global _PREFILL_OBSERVER
    _PREFILL_OBSERVER = observer


@dataclass(frozen=True, slots=True)
class SimulatedStats:
    queried_tokens: int  # prompt tokens of every prefill
    hit_tokens: int  # of those, taken from the prefix cache
    prefills: int
    busy_prefill_s: float  # simulated prefill time spent (the sum of every prefill's duration)
    cached_tokens: int  # tokens the prefix cache holds now
    handoff_inserted_tokens: int  # tokens put into the cache from accepted hand-offs (GEN)
    peak_concurrent_prefills: int  # never above 1: the queue is one at a time

    @property
    def hit_ratio(self) -> float:
        return self.hit_tokens / self.queried_tokens if self.queried_tokens else 0.0


class _BlockCache:
    """An LRU of block keys bounded to ``capacity_blocks``; it holds no KV (nothing is computed)."""

    def __init__(self, capacity_blocks: int) -> None:
        self.capacity_blocks = capacity_blocks
        self._blocks: collections.OrderedDict[bytes, None] = collections.OrderedDict()

    def __len__(self) -> int:
        return len(self._blocks)

    def __contains__(self, key: bytes) -> bool:
        return key in self._blocks

    def match(self, keys: list[bytes]) -> int:
        """How many of ``keys``, from the first, the cache holds; those are refreshed (tail first)."""
        found = 0
        for key in keys:
            if key not in self._blocks:
                break
            found += 1
        for key in reversed(keys[:found]):
            self._blocks.move_to_end(key)
        return found

    def insert(self, keys: list[bytes]) -> None:
        """Hold every block of ``keys``; the head ends most recently used, so eviction takes tails first."""
        if self.capacity_blocks <= 0:
            return
        for key in reversed(keys):
            self._blocks[key] = None
            self._blocks.move_to_end(key)
        while len(self._blocks) > self.capacity_blocks:
            self._blocks.popitem(last=False)


class SimulatedEngine:
    """A typed engine (``workers.engines.base.Engine``) that also provides its tokenizer (the byte tokenizer, or with
    ``tokenizer="reference"`` the reference model's, loaded in ``start``), reports its KV capacity
    (``ReportsKvCapacity``) and exposes its counters (``ExposesMetrics``)."""

    def __init__(self, config: SimulatedConfig | None = None, *, tokenizer: str = "byte",
                 tokenize: TokenizeConfig | None = None) -> None:
        self.config = config or SimulatedConfig()
        self._tokenizer_choice = check_tokenizer(tokenizer)
        self._tokenize = tokenize
        if self.config.prefill_tokens_per_s <= 0:
            raise ValueError("prefill_tokens_per_s must be positive")
        self.info = EngineInfo(
            engine=_ENGINE,
            model=self.config.model,
            vocab_size=self.config.vocab_size,
            max_context=self.config.max_context,
            model_hash="simulated-v1",
            # Its cache keys blocks by token values: a length-only placeholder prompt would collide (guardrail).
            kv_block_reuse=self.config.prefix_cache_tokens > 0,
            supports_structured_output=False,
        )
        self._tokens: EngineTokens | None = None
        if tokenizer == "byte":  # free to build, and there before start (as it always was)
            self._tokens = EngineTokens(ByteTokenizer(self.config.vocab_size), BYTE_ANSWER)
        self._answer = BYTE_ANSWER
        self._cache = _BlockCache(max(0, self.config.prefix_cache_tokens) // BLOCK_TOKENS)
        self._prefill_turn = asyncio.Lock()  # FIFO: asyncio wakes waiters in the order they came
        self._running: dict[str, asyncio.Event] = {}
        self._queried = self._hits = self._prefills = self._inserted = 0
        self._busy_s = 0.0
        self._prefilling = self._peak_prefilling = 0
        self._registry = CollectorRegistry()  # the engine's own: several engines in one process never collide
        self._queried_total = Counter("disagg_engine_prefix_cache_queried_tokens",
                                      "Prompt tokens of every prefill, looked up in the prefix cache",
                                      registry=self._registry)
        self._hit_total = Counter("disagg_engine_prefix_cache_hit_tokens",
                                  "Prompt tokens a prefill took from the prefix cache instead of computing them",
                                  registry=self._registry)
        self._prefills_total = Counter("disagg_engine_prefills", "Prefills run (one at a time)",
                                       registry=self._registry)
        self._busy_total = Counter("disagg_engine_prefill_busy_seconds",
                                   "Simulated seconds spent prefilling", registry=self._registry)
        self._cached_gauge = Gauge("disagg_engine_prefix_cache_tokens", "Tokens the prefix cache holds now",
                                   registry=self._registry)
        self._capacity_gauge = Gauge("disagg_engine_prefix_cache_capacity_tokens",
                                     "Tokens the prefix cache can hold", registry=self._registry)
        self._capacity_gauge.set(self._cache.capacity_blocks * BLOCK_TOKENS)
        self._waiting_gauge = Gauge("disagg_engine_prefill_queue_requests",
                                    "Requests waiting for or running their prefill", registry=self._registry)

    async def start(self) -> None:
        if self._tokens is None:  # the reference tokenizer: nothing else to load
            self._tokens = await load_engine_tokens(self._tokenizer_choice, self.config.vocab_size, self._tokenize)
            self.info = replace(self.info, vocab_size=self._tokens.tokenizer.vocab_size)
        self._answer = self._tokens.answer

    async def aclose(self) -> None:
        for aborted in self._running.values():
            aborted.set()

    def get_tokenizer(self) -> Tokenizer:
        if self._tokens is None:
            raise EngineError("the simulated engine's tokenizer is loaded when it starts")
        return self._tokens.tokenizer

    def kv_capacity_tokens(self) -> int | None:
        return self._cache.capacity_blocks * BLOCK_TOKENS

    def metrics_text(self) -> bytes:
        self._cached_gauge.set(len(self._cache) * BLOCK_TOKENS)
        return generate_latest(self._registry)

    def stats(self) -> SimulatedStats:
        return SimulatedStats(self._queried, self._hits, self._prefills, self._busy_s,
                              len(self._cache) * BLOCK_TOKENS, self._inserted, self._peak_prefilling)

    def generate(self, request: GenerationRequest) -> AsyncGenerator[EngineOutput, None]:
        return self._tracked(request)

    async def abort(self, request_id: str) -> None:
        aborted = self._running.get(request_id)
        if aborted is not None:
            aborted.set()

    async def _tracked(self, request: GenerationRequest) -> AsyncGenerator[EngineOutput, None]:
        aborted = asyncio.Event()
        self._running[request.request_id] = aborted
        try:
            async for output in self._generate(request, aborted):
                yield output
        finally:
            if self._running.get(request.request_id) is aborted:
                del self._running[request.request_id]

    async def _generate(self, request: GenerationRequest, aborted: asyncio.Event
                        ) -> AsyncGenerator[EngineOutput, None]:
        sampling = request.sampling
        max_tokens = request.max_tokens
        if request.phase is Phase.GENERATION_ONLY:
            position = self._accept_handoff(request)
            finish = handoff_finish(request, position, self._answer.eos)
            if finish is not None:  # the budget used, or a continued stream's EOS handed over
                yield EngineOutput((), finish_reason=finish)
                return
            yield EngineOutput(())  # the hand-off is accepted
        else:
            cached = await self._prefill(request, aborted)
            if cached is None:
                yield EngineOutput((), finish_reason="abort")
                return
            first = first_output(request, _ENGINE, self.config.output_tokens, cached, self._answer)
            position = 1
            yield first
            if first.finish_reason is not None or request.phase is Phase.CONTEXT_ONLY:
                return
        while True:
            if aborted.is_set():
                yield EngineOutput((), finish_reason="abort")
                return
            await asyncio.sleep(self.config.inter_token_latency_s)  # 0 still yields to the event loop
            token = token_at(position, self.config.output_tokens, self._answer)
            position += 1
            finish = finish_reason(token, position, max_tokens, sampling.ignore_eos, self._answer.eos)
            yield EngineOutput((token,), certain_logprobs(token, sampling.logprobs), finish)
            if finish is not None:
                return

    async def _prefill(self, request: GenerationRequest, aborted: asyncio.Event) -> int | None:
        """Wait for this request's turn, then spend its prefill time; the cached tokens, or None if aborted."""
        self._waiting_gauge.inc()
        try:
            async with self._prefill_turn:
                if aborted.is_set():
                    return None
                self._prefilling += 1
                self._peak_prefilling = max(self._peak_prefilling, self._prefilling)
                try:
                    return await self._prefill_now(request, aborted)
                finally:
                    self._prefilling -= 1
        finally:
            self._waiting_gauge.dec()

    async def _prefill_now(self, request: GenerationRequest, aborted: asyncio.Event) -> int | None:
        prompt_len = request.prompt_len
        keys = [] if request.prompt_is_placeholder else block_keys(request.prompt_token_ids_i32)
        usable = keys[: usable_blocks(prompt_len)]
        cached = self._cache.match(usable) * BLOCK_TOKENS
        observer = _PREFILL_OBSERVER
        if observer is not None:
            observer(keys, prompt_len)
        duration = self.config.prefill_base_s + (prompt_len - cached) / self.config.prefill_tokens_per_s
        started = time.monotonic()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(aborted.wait(), duration)
        spent = duration if not aborted.is_set() else min(duration, time.monotonic() - started)
        self._queried += prompt_len
        self._hits += cached
        self._prefills += 1
        self._busy_s += spent
        self._queried_total.inc(prompt_len)
        self._hit_total.inc(cached)
        self._prefills_total.inc()
        self._busy_total.inc(spent)
        if aborted.is_set():
            return None  # its KV was never finished: nothing enters the cache
        self._cache.insert(keys)
        return cached

    def _accept_handoff(self, request: GenerationRequest) -> int:
        """Check a generation-only request's hand-off, and hold its prompt's KV from now on."""
        position = handoff_position(request, _ENGINE)
        if not request.prompt_is_placeholder:  # a placeholder's values are not the prompt's: they key nothing
            keys = block_keys(request.prompt_token_ids_i32)
            self._cache.insert(keys)
            self._inserted += len(keys) * BLOCK_TOKENS
        return position
