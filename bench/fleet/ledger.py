"""The fleet's oracle: every block any simulated engine of the host process prefilled, so that each router's hit
ratio is read against the best any cache could have done on the same work (``observe_prefills`` feeds it)."""

from __future__ import annotations

from workers.engines.simulated import BLOCK_TOKENS, observe_prefills, usable_blocks


class FleetLedger:
    """Every block prefilled by any simulated engine of this process, kept without bound.

    For each prefill, in the order prefills start, ``record`` counts the tokens of the longest prefix of its
    usable blocks that some prefill in the fleet had already started: what a cache holding everything, on the
    worker that had it, would have given. No real cache can hit a block no prefill made, so the fleet's hit tokens
    never exceed ``reachable_tokens``."""

    def __init__(self) -> None:
        self._seen: set[bytes] = set()
        self.prefills = 0
        self.queried_tokens = 0
        self.reachable_tokens = 0

    def record(self, keys: list[bytes], prompt_len: int) -> int:
        reachable = 0
        for key in keys[: usable_blocks(prompt_len)]:
            if key not in self._seen:
                break
            reachable += BLOCK_TOKENS
        self._seen.update(keys)
        self.prefills += 1
        self.queried_tokens += prompt_len
        self.reachable_tokens += reachable
        return reachable

    def snapshot(self) -> dict[str, int]:
        return {"prefills": self.prefills, "queried_tokens": self.queried_tokens,
                "reachable_tokens": self.reachable_tokens, "blocks": len(self._seen)}


def record_every_prefill() -> FleetLedger:
    """A ledger every simulated engine of this process records its prefills in, from now on."""
    ledger = FleetLedger()
    observe_prefills(ledger.record)
    return ledger
