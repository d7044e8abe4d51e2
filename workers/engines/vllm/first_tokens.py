"""GEN's vLLM chooses every sequence's first token(s) again (``workers.engines.vllm.engine``): the seed CTX hands on
so that it draws what CTX drew, and the watch that counts the sequences where it chose otherwise."""

from __future__ import annotations

import secrets

from frontend.sampling import SamplingParams
from workers.engines.outputs import EngineOutput


def handoff_seed(sampling: SamplingParams) -> int | None:
    """The seed CTX samples with and hands to GEN: the client's, or one drawn here when sampling is random, so
    that GEN, choosing the first token(s) again, draws what CTX drew. Greedy needs none. 62 bits: vLLM seeds
    sequence i with ``seed + i``."""
    if sampling.seed is not None or sampling.temperature == 0:
        return sampling.seed
    return secrets.randbits(62)


class FirstTokenWatch:
    """Which sequences' first token(s), chosen again by GEN's vLLM, are not CTX's. On the CPU they always are (the
    same KV, the same kernels: bit for bit); on GPUs logits that differ in the last bits across batch shapes and
    kernels can flip a greedy near-tie or move a seeded draw now and then. GEN's choice stands either way."""

    def __init__(self, starts: list[tuple[int, ...]]) -> None:
        self._starts = starts
        self._chosen: list[tuple[int, ...]] = [() for _ in starts]  # GEN's first tokens of each sequence so far
        self._open = set(range(len(starts)))  # sequences whose first tokens are not all in yet

    @property
    def done(self) -> bool:
        return not self._open

    def see(self, output: EngineOutput) -> int | None:
        """``output``'s sequence index, if with it GEN's first token(s) of that sequence are complete and differ
        from CTX's (a sequence that ends sooner differs too); else None. Each sequence is reported once."""
        index = output.index
        if index not in self._open:
            return None
        start, chosen = self._starts[index], self._chosen[index]
        chosen += output.token_ids[:len(start) - len(chosen)]
        self._chosen[index] = chosen
        if len(chosen) < len(start) and output.finish_reason is None:
            return None
        self._open.discard(index)
        return index if chosen != start else None
