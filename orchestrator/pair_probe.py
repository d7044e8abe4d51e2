"""The pair probe: proof, pair by pair, that KV really moves from CTX to GEN.

A CTX/GEN pair whose KV transfer is broken may still answer every request right: a GEN whose fetch failed (or whose
connector is misconfigured) prefills the prompt itself, at twice the cost, and nothing fails. So the orchestrator
sends a tiny disaggregated request through each pair it would use (every healthy CTX worker with every healthy GEN
worker), each step straight to that pair's two workers in their own wire, and reads GEN's account of its prompt
(``frontend.prompt_report``):

- ``passed``: GEN computed none of the prompt itself; a pair that was kept out of routing is routable again;
- ``recomputed``: GEN answered, but computed prompt tokens the hand-off should have carried;
- ``failed``: the pair could not serve the probe (a worker's error answer, a transport failure, no answer in
  ``timeout_s``), with the cause;
- ``unverified``: nothing to judge by: a GEN that speaks another wire (trtllm-serve, vLLM's own servers) and sends
  no account, or a worker too busy to take the probe now (429) or draining (503). The pair's standing is left as it
  was.

A ``recomputed`` or ``failed`` pair is logged with its cause and kept out of routing (``orchestrator.pair_health``)
until a probe passes. Rounds run at start-up and every ``pair_probe.interval_s`` when ``pair_probe.enabled`` (off by
default: each probe is a prefill and a decode step on both workers), and on demand from ``POST /admin/pair-probe``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import orjson

from frontend.config import PairProbeConfig
from frontend.errors import UpstreamError
from frontend.metrics import Metrics
from orchestrator.flow.disagg_flow import DisaggFlow
from orchestrator.flow.worker_call import post
from orchestrator.member import PoolMember
from orchestrator.metric_labels import PROBE_FAILED as FAILED
from orchestrator.metric_labels import PROBE_PASSED as PASSED
from orchestrator.metric_labels import PROBE_RECOMPUTED as RECOMPUTED
from orchestrator.metric_labels import PROBE_UNVERIFIED as UNVERIFIED
from orchestrator.protocols.registry import DEFAULT_PROTOCOL

logger = logging.getLogger("disagg_serve.pair_probe")

# The probe's prompt: a few dozen tokens in any tokenizer, enough to fill a KV block or two; its answer is two tokens.
PROBE_PROMPT = ("A pair probe checks that the generation worker takes the prompt's KV cache from the context "
                "worker instead of computing the prompt again by itself.")
PROBE_MAX_TOKENS = 2
# A worker too busy for the probe now (429), or draining to shut down (503): it judges no pair.
_NOT_NOW = (429, 503)


@dataclass(frozen=True, slots=True)
class PairVerdict:
    ctx: str
    gen: str
    outcome: str  # one of orchestrator.metric_labels.PROBE_OUTCOMES
    cause: str = ""  # why it did not pass, in words
    prompt_tokens: int | None = None  # as GEN accounted for them
    computed: int | None = None  # of those, computed by GEN itself

    def as_json(self) -> dict[str, Any]:
        return {"ctx": self.ctx, "gen": self.gen, "outcome": self.outcome, "cause": self.cause,
                "prompt_tokens": self.prompt_tokens, "computed_by_gen": self.computed}


class PairProbe:
    def __init__(self, config: PairProbeConfig, flow: DisaggFlow, metrics: Metrics) -> None:
        self.config = config
        self.flow = flow
        self.metrics = metrics
        self.pairs = flow.steps.pairs
        self.last: list[PairVerdict] = []  # the latest round's verdicts
        self._judged: set[tuple[str, str]] = set()  # (CTX, GEN) pairs with a verdict on the gauge
        self._round = asyncio.Lock()  # one round at a time: an admin call during a periodic round waits for it
        self._task: asyncio.Task[None] | None = None

    # -- periodic -------------------------------------------------------------------------------------------------
    def start(self) -> None:
        """Probe now and every ``interval_s``, if enabled (called once the pools' first health check is in)."""
        if self.config.enabled and self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._every_interval())

    async def stop(self) -> None:
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

    async def _every_interval(self) -> None:
        while True:
            try:
                await self.run()
            except Exception:  # a bug in one round must not end the probing
                logger.exception("a pair probe round failed")
            await asyncio.sleep(self.config.interval_s)

    # -- one round ------------------------------------------------------------------------------------------------
    async def run(self) -> list[PairVerdict]:
        """Probe every pair of a healthy CTX worker and a healthy GEN worker; their verdicts, each also applied to
        routing (see the module's docstring) and counted."""
        async with self._round:
            ctxs = [w for w in self.flow.ctx_pool.workers if w.healthy]
            gens = [w for w in self.flow.gen_pool.workers if w.healthy]
            room = asyncio.Semaphore(self.config.concurrency)

            async def one(ctx: PoolMember, gen: PoolMember) -> PairVerdict:
                async with room:
                    try:
                        return await self.probe_pair(ctx, gen)
                    except Exception as exc:  # a bug of the probe's own judges no pair
                        logger.exception("pair probe: CTX %s -> GEN %s could not be probed", ctx.url, gen.url)
                        return PairVerdict(ctx.url, gen.url, UNVERIFIED, f"the probe failed: {type(exc).__name__}")

            verdicts = list(await asyncio.gather(*(one(ctx, gen) for ctx in ctxs for gen in gens)))
            self._forget_workers_gone()
            for verdict in verdicts:
                self._apply(verdict)
            self.last = verdicts
            return verdicts

    def _forget_workers_gone(self) -> None:
        """The pairs of a worker no longer in its pool are judged no more: out of routing state and of the gauge
        (a worker that is only unhealthy keeps its pairs' standing: it may come back as broken as it went)."""
        present = ({w.url for w in self.flow.ctx_pool.workers}, {w.url for w in self.flow.gen_pool.workers})
        for ctx, gen in [pair for pair in self._judged if pair[0] not in present[0] or pair[1] not in present[1]]:
            self._judged.discard((ctx, gen))
            self.pairs.passed(ctx, gen)
            self.metrics.pair_probe_passing.remove(ctx, gen)

    def _apply(self, verdict: PairVerdict) -> None:
        self.metrics.pair_probes.labels(outcome=verdict.outcome).inc()
        ctx, gen = verdict.ctx, verdict.gen
        if verdict.outcome in (PASSED, RECOMPUTED, FAILED):
            self._judged.add((ctx, gen))
        if verdict.outcome == PASSED:
            self.metrics.pair_probe_passing.labels(ctx=ctx, gen=gen).set(1)
            if self.pairs.passed(ctx, gen):
                logger.info("pair probe: CTX %s -> GEN %s passed again: the pair is back in routing", ctx, gen)
        elif verdict.outcome in (RECOMPUTED, FAILED):
            self.metrics.pair_probe_passing.labels(ctx=ctx, gen=gen).set(0)
            self.pairs.failed(ctx, gen, verdict.cause)
            logger.warning("pair probe: CTX %s -> GEN %s %s: %s; the pair is kept out of routing until it passes",
                           ctx, gen, verdict.outcome, verdict.cause)
        else:
            logger.info("pair probe: CTX %s -> GEN %s unverified: %s", ctx, gen, verdict.cause)

    # -- one pair -------------------------------------------------------------------------------------------------
    async def probe_pair(self, ctx: PoolMember, gen: PoolMember) -> PairVerdict:
        """One probe through ``ctx`` then ``gen``, each step sent to that worker in its own wire."""
        def verdict(outcome: str, cause: str = "", prompt_tokens: int | None = None,
                    computed: int | None = None) -> PairVerdict:
            return PairVerdict(ctx.url, gen.url, outcome, cause, prompt_tokens, computed)

        if gen.protocol != DEFAULT_PROTOCOL:
            return verdict(UNVERIFIED, f"the GEN worker speaks the {gen.protocol} wire, which reports nothing of "
                                       "how it got its prompt's KV")
        try:
            return await self._probe(ctx, gen, verdict)
        except TimeoutError:
            return verdict(FAILED, f"no answer within {self.config.timeout_s:g} s")
        except UpstreamError as exc:
            return verdict(FAILED, exc.message)

    async def _probe(self, ctx: PoolMember, gen: PoolMember, verdict: Callable[..., PairVerdict]) -> PairVerdict:
        flow, steps, timeout_s = self.flow, self.flow.steps, self.config.timeout_s
        model = await self._model_of(ctx)
        body = {"model": model, "prompt": PROBE_PROMPT, "max_tokens": PROBE_MAX_TOKENS, "temperature": 0,
                "ignore_eos": True}
        request = flow.new_request("completions", body, time.perf_counter(),
                                   headers={"x-request-id": f"pair-probe-{uuid.uuid4().hex}"})
        async with asyncio.timeout(timeout_s):
            reply = await steps.call_ctx(request, ctx, True)
        if reply.status_code != 200:
            outcome = UNVERIFIED if reply.status_code in _NOT_NOW else FAILED
            return verdict(outcome, f"the CTX worker answered {reply.status_code}: {_message(reply.content)}")
        request.ctx_worker = ctx.url
        answer = request.ctx = steps.wire(request, ctx).read_context_answer(reply.content)
        if answer.finished:
            return verdict(UNVERIFIED, "the CTX worker finished the probe by itself: nothing was handed off")
        taken = False
        try:  # (from here on CTX holds the probe's KV: whatever fails, it is freed)
            steps.sign_for_gen(request.headers, answer.handoff)
            carriage, _ = steps.prompt_carriage(request, answer, gen)
            gen_body = steps.wire(request, gen).generation_request(request.body, answer, carriage)
            async with asyncio.timeout(timeout_s):
                gen_reply = await post(flow.gen_pool, gen, request, gen_body, request.key)
            taken = gen_reply.status_code == 200
        finally:
            if not taken:  # GEN refused it or never answered: CTX's parked KV is freed now, not at its expiry
                steps.releaser.release(answer, ctx.url, request.headers, request.wire)
        if gen_reply.status_code != 200:
            outcome = UNVERIFIED if gen_reply.status_code in _NOT_NOW else FAILED
            return verdict(outcome, f"the GEN worker answered {gen_reply.status_code}: "
                                    f"{_message(gen_reply.content)}")
        report = steps.recomputes.saw(gen.url, gen_reply.status_code, gen_reply.prompt_report, ctx.url)
        if report is None:
            return verdict(UNVERIFIED, "the GEN worker's answer says nothing of how it got its prompt's KV")
        total = report.received + report.computed
        if report.computed:
            return verdict(RECOMPUTED, f"the GEN worker computed {report.computed} of the {total} prompt tokens "
                                       "itself: their KV did not come from the CTX worker", total, report.computed)
        return verdict(PASSED, "", total, 0)

    async def _model_of(self, ctx: PoolMember) -> str:
        """The model ``ctx`` serves, from its own listing."""
        reply = await ctx.transport.get("/v1/models", self.config.timeout_s)
        try:
            model = orjson.loads(reply.content)["data"][0]["id"]
        except (orjson.JSONDecodeError, KeyError, IndexError, TypeError):
            model = None
        if reply.status_code != 200 or not isinstance(model, str):
            raise UpstreamError(f"the CTX worker's /v1/models answered {reply.status_code} with no model in it")
        return model


def _message(content: bytes) -> str:
    """An error answer's message (OpenAI's shape), or its first bytes."""
    try:
        message = orjson.loads(content)["error"]["message"]
    except (orjson.JSONDecodeError, KeyError, TypeError):
        message = None
    return message if isinstance(message, str) else content[:200].decode("utf-8", errors="replace")
