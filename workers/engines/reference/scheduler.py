"""The engine core's scheduler: chunked prefill and per-sequence decode, interleaved step by step.

Each ``step`` runs one prefill chunk of the oldest waiting request, then one decode step of every running sequence,
so a long prompt never starves running streams. Decoding is per sequence, not batched, because batched BLAS changes
bits with the batch's composition, and this engine must give disaggregated output equal to aggregated output token
for token. A request for n > 1 sequences is prefilled once and forked (docs/engines.md); every output names its
sequence (``index``), and the request's last output carries ``done``."""

from __future__ import annotations

import collections
import logging
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import numpy as np
import orjson

from frontend.token_codec import TokenArray
from workers.engines.reference.grammar import GrammarCompiler, GrammarError, TokenConstraint
from workers.engines.reference.kv_fetch import FetchedHandoff, HandoffUnavailable, HandoffUnreachable, fetch_handoff
from workers.engines.reference.kv_handoff import KVHandoff, encode_handoff
from workers.engines.reference.kv_store import KVStore, KVStoreFull
from workers.engines.reference.prefix_cache import PrefixCache
from workers.engines.reference.sampler import Sampler, log_softmax, top_logprobs
from workers.engines.reference.sequences import Sequence, SubmitSpec
from workers.engines.reference.transformer import Interrupted, KVCache, Transformer, export_kv, fork_kv

logger = logging.getLogger(__name__)

Emit = Callable[..., None]  # (header, payload=b"") -> None


@dataclass(frozen=True, slots=True)
class SchedulerConfig:
    model_hash: str
    eos_token_ids: frozenset[int]
    prefill_chunk: int = 512
    prompt_tokens_in_handoff: bool = True
    kv_url_base: str = ""  # "http://host:port" of this core's KV transfer server
    prefix_cache_bytes: int = 0  # KV block reuse: 0 = off
    # GEN, when the hand-off's KV cannot be fetched: "fail" the request (the orchestrator runs CTX again), or
    # "recompute" the prompt here and go on (vLLM's kv_load_failure_policy): the answer is the same, the work twice
    # over, and the first output says how many tokens were computed (frontend/prompt_report.py).
    kv_load_failure: str = "fail"


class Scheduler:
    def __init__(self, model: Transformer, config: SchedulerConfig, store: KVStore, emit: Emit,
                 wake: Callable[[], None] = lambda: None,
                 abort_pending: Callable[[str], bool] = lambda request_id: False,
                 grammars: GrammarCompiler | None = None) -> None:
        self.model = model
        self.config = config
        self.store = store
        self.emit = emit
        self.wake = wake  # called from a fetch thread when its KV arrives
        # Whether an abort for this request has arrived but is not handled yet (the core's reader threads see
        # it at once; the loop only between steps): a prefill chunk stops within its layer when it says so, and a
        # queued request it names is dropped before a step would start it.
        self.abort_pending = abort_pending
        self.vocab_size = model.config.vocab_size
        self.context = model.config.context_length
        self._prefill_queue: collections.deque[Sequence] = collections.deque()
        self._running: dict[tuple[str, int], Sequence] = {}  # by (request id, sequence index)
        self._live: dict[str, int] = {}  # request id -> its sequences still decoding
        self._fetching: dict[str, tuple[SubmitSpec, Future[FetchedHandoff]]] = {}
        self._fetcher = ThreadPoolExecutor(max_workers=4, thread_name_prefix="kv-fetch")
        self.prefix_cache = PrefixCache(config.prefix_cache_bytes) if config.prefix_cache_bytes else None
        self.grammars = grammars

    # -- requests in --------------------------------------------------------------------------------------
    def submit(self, spec: SubmitSpec) -> None:
        if spec.phase == "generation_only":
            assert spec.handoff_state is not None
            future = self._fetcher.submit(fetch_handoff, spec.handoff_state, self.model.config,
                                          self.config.model_hash, int(spec.prompt.shape[0]))
            self._fetching[spec.request_id] = (spec, future)
            future.add_done_callback(lambda _: self.wake())
            return
        # Compiled before prefill: a schema that does not compile fails the submit, not a step.
        constraint = self._constraint(spec)
        # The cache takes its memory at the first prefill chunk (KVCache), not here in the queue.
        seq = Sequence(spec, self.model.new_cache(int(spec.prompt.shape[0]) + 16), constraint=constraint)
        if self.prefix_cache is not None and spec.sampling.prompt_logprobs is None:
            seq.prefilled = seq.cached_tokens = self.prefix_cache.load_prefix(spec.prompt, seq.cache)
        self._prefill_queue.append(seq)

    def abort(self, request_id: str) -> None:
        self._drop_sequences(request_id)
        self._fetching.pop(request_id, None)  # a fetch in flight finishes in its thread; its result is dropped
        self._prefill_queue = collections.deque(s for s in self._prefill_queue if s.spec.request_id != request_id)
        self.store.discard(request_id)

    def _drop_sequences(self, request_id: str) -> None:
        for key in [key for key in self._running if key[0] == request_id]:
            del self._running[key]
        self._live.pop(request_id, None)

    def stop_sequence(self, request_id: str, index: int) -> None:
        """The front end finished one sequence itself (a stop string): stop decoding it, keep its siblings.
        Nothing is emitted; the front end has already counted it finished."""
        if self._running.pop((request_id, index), None) is not None:
            self._sequence_left(request_id)

    def _sequence_left(self, request_id: str) -> bool:
        """One of the request's sequences stopped decoding; True when it was the last."""
        left = self._live.get(request_id, 1) - 1
        if left > 0:
            self._live[request_id] = left
            return False
        self._live.pop(request_id, None)
        return True

    @property
    def busy(self) -> bool:
        """Compute to do now. KV fetches in flight are not: their threads wake the loop when they finish."""
        return bool(self._prefill_queue or self._running or any(f.done() for _, f in self._fetching.values()))

    @property
    def active_requests(self) -> int:
        return len(self._prefill_queue) + len(self._live) + len(self._fetching)

    def stats(self) -> dict[str, int]:
        cache = self.prefix_cache
        return {
            "active": self.active_requests,
            "sequences": len(self._running),  # decoding now: n per request asking for n
            "prefix_cache_blocks": cache.blocks if cache else 0,
            "prefix_cache_hit_tokens": cache.hit_tokens if cache else 0,
        }

    # -- one step -----------------------------------------------------------------------------------------
    def step(self) -> None:
        self._admit_fetched()
        # A queued request whose abort has arrived is not started: its abort frame, handled next, finds it gone.
        while self._prefill_queue and self.abort_pending(self._prefill_queue[0].spec.request_id):
            self._prefill_queue.popleft()
        if self._prefill_queue:
            self._prefill_chunk(self._prefill_queue[0])
        for key, seq in list(self._running.items()):
            if key in self._running:
                self._decode_one(seq)

    def _admit_fetched(self) -> None:
        for request_id, (spec, future) in list(self._fetching.items()):
            if not future.done():
                continue
            del self._fetching[request_id]
            try:
                fetched = future.result()
            except HandoffUnreachable as exc:
                self._fetch_failed(spec, "upstream", str(exc))
                continue
            except HandoffUnavailable as exc:
                self._fetch_failed(spec, "handoff", str(exc))
                continue
            except Exception as exc:  # a transfer bug must fail one request, not the core
                logger.exception("KV fetch failed for %s", request_id)
                self._fetch_failed(spec, "engine", f"KV fetch failed: {type(exc).__name__}")
                continue
            handoff = fetched.handoff
            self._start_generation(spec, fetched.cache, handoff.prompt_tokens, handoff.prompt_logprobs,
                                   fetched.nbytes)

    def _fetch_failed(self, spec: SubmitSpec, kind: str, message: str) -> None:
        """A GEN request whose KV did not arrive: failed, or (``kv_load_failure`` "recompute", with the prompt's
        real tokens at hand) queued to prefill its prompt here, as an aggregated request would."""
        if self.config.kv_load_failure != "recompute" or spec.placeholder:
            self._fail(spec.request_id, kind, message)
            return
        logger.warning("request %s: the KV hand-off did not arrive (%s); prefilling its %d prompt tokens here",
                       spec.request_id, message, int(spec.prompt.shape[0]))
        seq = Sequence(spec, self.model.new_cache(int(spec.prompt.shape[0]) + 16))
        if self.prefix_cache is not None and spec.sampling.prompt_logprobs is None:
            seq.prefilled = seq.cached_tokens = self.prefix_cache.load_prefix(spec.prompt, seq.cache)
        self._prefill_queue.append(seq)

    def _start_generation(self, spec: SubmitSpec, cache: KVCache, carried_prompt: TokenArray | None,
                          carried_prompt_logprobs: list[Any] | None, nbytes: int, recomputed: int = 0) -> None:
        """Decode on from the prompt's KV in ``cache``: fetched from CTX (``nbytes`` of it, with the prompt and its
        logprobs where the hand-off carried them), or ``recomputed`` here after a failed fetch."""
        prompt = spec.prompt
        if spec.placeholder:
            if carried_prompt is not None:
                prompt = carried_prompt  # the real prompt, carried beside the KV
            elif spec.sampling.reads_prompt_token_values:
                self._fail(spec.request_id, "handoff", "this request reads prompt token values, but neither the "
                           "request nor the KV hand-off carries the prompt's tokens")
                return
        if self.prefix_cache is not None:
            # Keyed by the token values this worker holds: real ones, or a placeholder's (hence the guardrail).
            self.prefix_cache.insert(prompt, cache)
        starts = spec.starts
        try:
            # Each sequence's grammar state is rebuilt from the request and replayed over the first token(s) CTX
            # chose for it: nothing of the matcher crosses the hand-off.
            constraints = [self._constraint(spec) for _ in starts]
            eos = self.config.eos_token_ids
            for constraint, first in zip(constraints, starts, strict=True):
                if constraint is not None:  # EOS ends a sequence; as when sampled, it is not fed to the matcher
                    constraint.advance_all(t for t in first if t not in eos)
        except GrammarError as exc:
            self._fail(spec.request_id, "request", str(exc))
            return
        report_prompt_logprobs = carried_prompt_logprobs is not None and spec.sampling.prompt_logprobs is not None
        # Echo on a placeholder: the front end needs the real prompt, which came with the KV.
        report_prompt = spec.placeholder and spec.sampling.echo and prompt is not spec.prompt
        # Always answered: the front end holds the first token back until the hand-off is accepted.
        opening: dict[str, Any] = {"op": "output", "id": spec.request_id, "tokens": [], "logprobs": None,
                                   "finish": None, "prompt_tokens": report_prompt, "handoff_bytes": nbytes,
                                   "recomputed_tokens": recomputed}
        if report_prompt_logprobs:
            opening["prompt_logprobs"] = carried_prompt_logprobs
        # Fork before any sequence decodes its first tokens into the cache it was given.
        caches = [cache, *(fork_kv(cache) for _ in starts[1:])]
        finished: list[dict[str, Any]] = []
        for index, (first, cache) in enumerate(zip(starts, caches, strict=True)):
            seq = Sequence(spec, cache, index=index, constraint=constraints[index])
            seq.sampler = self._sampler(spec, prompt, index, first)
            seq.produced = len(first)
            for token in first[:-1]:  # tokens CTX chose beyond the first enter the cache here
                self.model.decode(token, seq.cache)
            seq.last_token = first[-1]
            finish = self._finish_reason(seq, seq.last_token)
            if finish is None:
                self._running[(spec.request_id, index)] = seq
            else:
                finished.append({"op": "output", "id": spec.request_id, "index": index, "tokens": [],
                                 "logprobs": None, "finish": finish})
        live = len(starts) - len(finished)
        if live:
            self._live[spec.request_id] = live
        else:
            finished[-1]["done"] = True
        self.emit(opening, prompt.data if report_prompt else b"")
        for message in finished:
            self.emit(message)

    def _constraint(self, spec: SubmitSpec) -> TokenConstraint | None:
        sampling = spec.sampling
        if sampling.json_schema is None and sampling.grammar is None:
            return None
        if self.grammars is None:
            raise GrammarError("this engine core has no grammar compiler")
        if sampling.grammar is not None:
            return self.grammars.constraint(sampling.grammar, lark=True)
        assert sampling.json_schema is not None
        return self.grammars.constraint(sampling.json_schema)

    def _sampler(self, spec: SubmitSpec, prompt: TokenArray, index: int, so_far: tuple[int, ...] = ()) -> Sampler:
        return Sampler(spec.sampling, prompt, self.vocab_size, output_so_far=so_far, sequence_index=index)

    def _prefill_chunk(self, seq: Sequence) -> None:
        spec = seq.spec
        start = seq.prefilled
        chunk = spec.prompt[start : start + self.config.prefill_chunk]
        stop = lambda: self.abort_pending(spec.request_id)  # noqa: E731 - asked within every layer
        try:
            if spec.sampling.prompt_logprobs is not None:
                all_logits = self.model.prefill_all_logits(chunk, seq.cache, stop)
                self._record_prompt_logprobs(seq, all_logits, start)
                logits = all_logits[-1]
            else:
                logits = self.model.prefill(chunk, seq.cache, stop)
        except Interrupted:
            # Its abort is in the inbox: drop the sequence now; the abort frame, handled next, finds it gone.
            self._prefill_queue.popleft()
            return
        seq.prefilled += int(chunk.shape[0])
        if seq.prefilled < spec.prompt.shape[0]:
            return
        self._prefill_queue.popleft()
        if spec.phase == "generation_only":  # a hand-off whose KV did not arrive, computed here (_fetch_failed)
            logprobs = seq.prompt_logprobs if spec.sampling.prompt_logprobs is not None else None
            self._start_generation(spec, seq.cache, None, logprobs, 0, int(spec.prompt.shape[0]) - seq.cached_tokens)
            return
        if self.prefix_cache is not None:
            self.prefix_cache.insert(spec.prompt, seq.cache)
        self._fork_after_prefill(seq, logits)

    def _fork_after_prefill(self, seq: Sequence, logits: np.ndarray) -> None:
        """Every sequence chooses its first token from the prompt's last logits. The request's first outputs go
        out together: the last one carries the hand-off (CTX), or ``done`` when no sequence is left to decode."""
        spec = seq.spec
        context_only = spec.phase == "context_only"
        messages: list[dict[str, Any]] = []
        decoding: list[Sequence] = []
        # Every sequence's grammar state starts from the prompt's: forked before any of them chooses a token.
        constraints = [seq.constraint, *(seq.constraint.fork() if seq.constraint is not None else None
                                         for _ in range(1, spec.sampling.n))]
        for index in range(spec.sampling.n):
            forked = seq
            if index:
                # CTX decodes nothing: its sequences share the prompt's KV, which is parked once for GEN.
                forked = Sequence(spec, seq.cache if context_only else fork_kv(seq.cache), index=index,
                                  constraint=constraints[index])
            forked.sampler = self._sampler(spec, spec.prompt, index)
            message = self._sample_message(forked, logits)
            if message is None:
                return  # its grammar broke: the request has failed
            messages.append(message)
            if message["finish"] is None:
                decoding.append(forked)
        if spec.sampling.prompt_logprobs is not None:
            messages[0]["prompt_logprobs"] = seq.prompt_logprobs
        messages[0]["cached_tokens"] = seq.cached_tokens
        if context_only:
            if decoding:
                try:
                    messages[-1]["handoff_state"] = self._park_kv(seq)
                except KVStoreFull as exc:
                    self._fail(spec.request_id, "overloaded", str(exc))
                    return
            messages[-1]["done"] = True
        elif decoding:
            self._running.update(((spec.request_id, s.index), s) for s in decoding)
            self._live[spec.request_id] = len(decoding)
        else:
            messages[-1]["done"] = True
        for message in messages:
            self.emit(message)

    def _record_prompt_logprobs(self, seq: Sequence, logits: np.ndarray, start: int) -> None:
        prompt = seq.spec.prompt
        n_top = seq.spec.sampling.prompt_logprobs or 0
        if start == 0:
            seq.prompt_logprobs.append(None)  # the first prompt token has no context to be scored in
        for row in range(logits.shape[0]):
            target = start + row + 1
            if target >= prompt.shape[0]:
                break
            lp = log_softmax(logits[row])
            token = int(prompt[target])
            seq.prompt_logprobs.append([token, float(lp[token]), [list(t) for t in top_logprobs(lp, n_top)]])

    def _decode_one(self, seq: Sequence) -> None:
        logits = self.model.decode(seq.last_token, seq.cache)
        message = self._sample_message(seq, logits)
        if message is None:
            return
        if message["finish"] is not None:
            request_id = seq.spec.request_id
            del self._running[(request_id, seq.index)]
            if self._sequence_left(request_id):
                message["done"] = True
        self.emit(message)

    def _sample_message(self, seq: Sequence, logits: np.ndarray) -> dict[str, Any] | None:
        """Choose ``seq``'s next token; the output frame that reports it, or None when its grammar broke (the
        request has failed)."""
        spec = seq.spec
        assert seq.sampler is not None
        if spec.sampling.logit_bias:
            logits = logits.copy()
            for token, bias in spec.sampling.logit_bias:
                logits[token] += np.float32(bias)
        constraint = seq.constraint
        try:
            sampled = seq.sampler.sample(logits, constraint.allowed() if constraint is not None else None)
            if constraint is not None and sampled.token_id not in self.config.eos_token_ids:
                constraint.advance(sampled.token_id)
        except GrammarError as exc:  # a matcher that broke fails its request, never the core
            logger.warning("grammar failure on %s: %s", spec.request_id, exc)
            self._fail(spec.request_id, "request", str(exc))
            return None
        seq.produced += 1
        seq.last_token = sampled.token_id
        return {
            "op": "output",
            "id": spec.request_id,
            "index": seq.index,
            "tokens": [sampled.token_id],
            "logprobs": None if spec.sampling.logprobs is None
            else [[sampled.token_id, sampled.logprob, [list(t) for t in sampled.top_logprobs]]],
            "finish": self._finish_reason(seq, sampled.token_id),
        }

    def _finish_reason(self, seq: Sequence, token: int) -> str | None:
        if token in self.config.eos_token_ids and not seq.spec.sampling.ignore_eos:
            return "stop"
        if seq.produced >= seq.spec.max_tokens or seq.cache.length + 1 >= self.context:
            return "length"
        return None

    def _park_kv(self, seq: Sequence) -> str:
        k, v = export_kv(seq.cache)
        spec = seq.spec
        handoff = KVHandoff(
            k, v, self.config.model_hash, self.model.config.rope_base,
            prompt_tokens=spec.prompt if self.config.prompt_tokens_in_handoff else None,
            prompt_logprobs=seq.prompt_logprobs if spec.sampling.prompt_logprobs is not None else None,
        )
        key = self.store.put(spec.request_id, encode_handoff(handoff))
        return json_state(self.config.kv_url_base, spec.request_id, key, self.config.model_hash, handoff.n_tokens)

    def _fail(self, request_id: str, kind: str, message: str) -> None:
        self._drop_sequences(request_id)
        self.emit({"op": "error", "id": request_id, "kind": kind, "message": message})

    def close(self) -> None:
        self._fetcher.shutdown(wait=False, cancel_futures=True)


def json_state(kv_url_base: str, entry_id: str, key: str, model_hash: str, n_tokens: int) -> str:
    """The opaque state GEN gets (base64-wrapped by the front end): where the KV is and the one-time key."""
    return orjson.dumps({"kv_url": f"{kv_url_base}/kv/{entry_id}", "key": key, "model_hash": model_hash,
                         "n_tokens": n_tokens}).decode()
