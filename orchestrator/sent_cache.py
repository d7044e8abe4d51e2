"""A model of a worker's prefix cache for a worker that publishes nothing: what this process sent there, aged as
the engine ages it.

The engine keeps prompt KV for reuse up to its capacity and evicts the least recently used first, a chain's tail
before its head. The model does the same over prefix-chain links (``frontend.prefix_chain``): each link stands for
its bytes of prompt text, the bytes a token are learned from the worker's answers (its exact prompt length against
the prompt's bytes), and the capacity is the worker's own where it says it (``kv_capacity_tokens`` on its card, a
vLLM server's cache config on its ``/metrics``), else the pool's ``kv_capacity_tokens``. What this process cannot
see (another process's requests to the same worker, an engine that keeps less than it says) the answers tell: an
answer that reports fewer cached tokens than the model predicted lowers the share of the capacity this process
counts on, and every answer that confirms the model lets it grow back. See docs/routing.md, "Workers that publish
nothing"."""

from __future__ import annotations

import collections
import math
import re
from collections.abc import Mapping
from typing import Any

from frontend.prefix_chain import LINK_ENDS, MAX_LINKS, PrefixChain

DEFAULT_BYTES_PER_TOKEN = 4.0  # English text under a BPE tokenizer, until the worker's answers say
_BYTES_PER_TOKEN_WEIGHT = 0.1  # of each answer, in the running estimate of a worker's bytes a token
# An answer that confirms the model gives back this share of what misses took from the capacity counted on.
_REGROW = 0.125
_FLOOR = 0.05  # the capacity counted on never falls under this share of the worker's (a burst of misses)
_SLACK_LINKS = 1  # a miss smaller than this many links (the prompt's unnamed tail, rounding) is no miss


def link_bytes(name: int) -> int:
    """The bytes of prompt text link ``name`` stands for (its position is in its name)."""
    index = name >> 32
    return LINK_ENDS[index] - (LINK_ENDS[index - 1] if index else 0) if 0 <= index < MAX_LINKS else 0


class SentCacheModel:
    """One worker's prefix cache as this process can know it: the links it sent there, least recently used
    first, bounded by the worker's capacity (in bytes of prompt text, at the worker's bytes a token)."""

    __slots__ = ("bytes_per_token", "capacity_tokens", "held_bytes", "links", "share")

    def __init__(self, capacity_tokens: int) -> None:
        self.links: collections.OrderedDict[int, int] = collections.OrderedDict()  # link -> its bytes; LRU first
        self.held_bytes = 0
        self.capacity_tokens = capacity_tokens
        self.bytes_per_token = DEFAULT_BYTES_PER_TOKEN
        # The share of the capacity this process counts on: 1 until answers say the engine holds less than what
        # this process alone sent (other processes send there too; the engine keeps less than it says).
        self.share = 1.0

    @property
    def capacity_bytes(self) -> float:
        return self.capacity_tokens * self.share * self.bytes_per_token

    @property
    def held_tokens(self) -> int:
        return int(self.held_bytes / self.bytes_per_token)

    def resize(self, capacity_tokens: int) -> None:
        if capacity_tokens != self.capacity_tokens:
            self.capacity_tokens = capacity_tokens
            self._evict()

    def note(self, chain: PrefixChain) -> None:
        """The worker was sent ``chain``'s prompt: it will hold every link, the head most recently used (the
        engine evicts a prompt's tail before its head, so what the model holds stays prefix-closed)."""
        links = self.links
        for name in reversed(chain.links):
            size = links.pop(name, None)
            if size is None:
                size = link_bytes(name)
                self.held_bytes += size
            links[name] = size
        self._evict()

    def holds(self, name: int) -> bool:
        return name in self.links

    def learn(self, chain: PrefixChain, prompt_tokens: int | None, predicted_links: int,
              cached_tokens: int | None) -> None:
        """An answer from the worker for ``chain``'s prompt: its exact length in tokens (the bytes a token), and
        the tokens its engine found cached, against the ``predicted_links`` the model said it held when the
        request was routed."""
        if prompt_tokens and prompt_tokens > 0 and chain.total_bytes:
            measured = chain.total_bytes / prompt_tokens
            self.bytes_per_token += _BYTES_PER_TOKEN_WEIGHT * (measured - self.bytes_per_token)
        if cached_tokens is None or not chain.links:
            return
        predicted = chain.covered_bytes(predicted_links)
        cached = cached_tokens * self.bytes_per_token
        slack = chain.link_bytes(min(predicted_links, len(chain.links) - 1)) * _SLACK_LINKS
        if cached + slack < predicted:
            # The engine had evicted what the model still counted: it keeps less of this process's work than
            # the model assumed. Count on that much less, and drop the model's oldest links to fit.
            missed = predicted - cached
            self.share = max(_FLOOR, self.share - missed / max(self.capacity_bytes / self.share, 1.0))
            self._evict()
        elif self.share < 1.0:
            self.share = min(1.0, self.share + _REGROW * (1.0 - self.share))

    def _evict(self) -> None:
        links, limit = self.links, self.capacity_bytes
        while self.held_bytes > limit and links:
            _, size = links.popitem(last=False)
            self.held_bytes -= size

    def clear(self) -> None:
        self.links.clear()
        self.held_bytes = 0


def card_capacity_tokens(card: object) -> int | None:
    """The prompt KV a worker's engine keeps for reuse, in tokens, as its ``/v1/models`` card says it
    (``engine_info.kv_capacity_tokens``, or the capacity its KV-event announcement names); None if it does not."""
    try:
        info = card["engine_info"]  # type: ignore[index]
    except (KeyError, TypeError, IndexError):
        return None
    if not isinstance(info, Mapping):
        return None
    value: Any = info.get("kv_capacity_tokens")
    if value is None and isinstance(info.get("kv_events"), Mapping):
        value = info["kv_events"].get("capacity_tokens")
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None


def answer_cached_tokens(response: Mapping[str, Any], handoff: Mapping[str, Any]) -> int | None:
    """The prompt tokens a worker's engine took from its cache for a request, as its answer says it: our
    workers' hand-off (``cached_tokens``), else OpenAI's ``usage.prompt_tokens_details.cached_tokens`` (vLLM
    with ``--enable-prompt-tokens-details``); None when the answer does not say."""
    value: Any = handoff.get("cached_tokens")
    if value is None:
        usage = response.get("usage")
        details = usage.get("prompt_tokens_details") if isinstance(usage, Mapping) else None
        value = details.get("cached_tokens") if isinstance(details, Mapping) else None
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value) or value < 0:
        return None
    return int(value)


_VLLM_CACHE_CONFIG = "vllm:cache_config_info{"


def vllm_capacity_tokens(metrics: str) -> int | None:
    """The prompt KV a vLLM server keeps for reuse, in tokens, from its ``/metrics`` page: its cache config's
    ``num_gpu_blocks`` times ``block_size`` (one engine's: a data-parallel server gives each request to one); None
    where the page does not say, or prefix caching is off."""
    for line in metrics.splitlines():
        if not line.startswith(_VLLM_CACHE_CONFIG):
            continue
        labels = dict(_LABEL.findall(line[len(_VLLM_CACHE_CONFIG):line.rfind("}")]))
        if labels.get("enable_prefix_caching", "True") != "True":
            return None
        try:
            capacity = int(labels["num_gpu_blocks"]) * int(labels["block_size"])
        except (KeyError, ValueError):
            return None
        return capacity if capacity > 0 else None
    return None


_LABEL = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')
