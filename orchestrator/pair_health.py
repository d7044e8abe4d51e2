"""Which CTX/GEN pairs are kept out of routing: those whose last pair probe failed (orchestrator/pair_probe.py).

Per pair, never per worker: a GEN that cannot read one CTX's KV (a wrong address advertised, a connector mismatch,
a network policy between two nodes) may read every other CTX's, and a CTX whose KV one GEN cannot reach still
serves the others. The flow asks two things: after CTX answered, which GEN workers to pass over for that CTX; and
before CTX is picked, which CTX workers have no routable GEN left that they pass with (their every request would
land on a failing pair). Both are *avoided*, as the retry policy avoids workers that failed a request: picked only
when nothing else is left, since a failing pair still answers right, only at twice the prefill, and a 503 would be
worse.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from orchestrator.member import PoolMember


@dataclass(frozen=True, slots=True)
class FailingPair:
    ctx: str
    gen: str
    cause: str  # what the probe saw, in words


class PairHealth:
    def __init__(self) -> None:
        self._failing: dict[str, dict[str, str]] = {}  # CTX URL -> GEN URL -> cause

    def __bool__(self) -> bool:
        """Whether any pair is kept out now (the flow's one check per request while none is)."""
        return bool(self._failing)

    def failed(self, ctx: str, gen: str, cause: str) -> None:
        self._failing.setdefault(ctx, {})[gen] = cause

    def passed(self, ctx: str, gen: str) -> bool:
        """The pair is routable again; whether it had been kept out."""
        gens = self._failing.get(ctx)
        if gens is None or gens.pop(gen, None) is None:
            return False
        if not gens:
            del self._failing[ctx]
        return True

    def is_failing(self, ctx: str, gen: str) -> bool:
        return gen in self._failing.get(ctx, ())

    def failing(self) -> list[FailingPair]:
        return [FailingPair(ctx, gen, cause) for ctx, gens in self._failing.items() for gen, cause in gens.items()]

    def gens_to_avoid(self, ctx: str | None, gens: Iterable[PoolMember]) -> tuple[PoolMember, ...]:
        """The GEN workers that fail with CTX ``ctx`` (None: no CTX ran, no pair to judge)."""
        failing = self._failing.get(ctx) if ctx is not None else None
        if not failing:
            return ()
        return tuple(gen for gen in gens if gen.url in failing)

    def ctxs_to_avoid(self, ctxs: Iterable[PoolMember], gens: Iterable[PoolMember]) -> tuple[PoolMember, ...]:
        """The CTX workers that fail with every routable GEN worker."""
        if not self._failing:
            return ()
        routable = [gen.url for gen in gens if gen.routable]
        if not routable:
            return ()  # no GEN to send anything to: not a question of pairs
        return tuple(ctx for ctx in ctxs
                     if (failing := self._failing.get(ctx.url)) and all(url in failing for url in routable))
