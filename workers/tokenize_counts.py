"""Moves the tokenizer's running totals (``workers.tokenization.prompt_encoder.TokenizeStats``) into the worker's
Prometheus metrics when ``/metrics`` is scraped: each scrape adds what is new since the last one."""

from __future__ import annotations

from prometheus_client import Counter

from frontend.metrics import Metrics
from workers.tokenization.prompt_encoder import TokenizeStats


class TokenizeCounts:
    def __init__(self, metrics: Metrics) -> None:
        self._metrics = metrics
        self._seen: dict[str, int] = {}

    def bring_up_to(self, stats: TokenizeStats | None) -> None:
        if stats is None:  # nothing tokenized yet
            return
        m = self._metrics
        self._add(m.tokenize_prompts, "prompts", stats.prompts)
        self._add(m.tokenize_encoded_tokens, "encoded", stats.encoded_tokens)
        cache = stats.cache
        if cache is None:
            return
        self._add(m.tokenize_cache_hits, "hits", cache.hits)
        self._add(m.tokenize_cache_reused_tokens, "reused", cache.reused_tokens)
        self._add(m.tokenize_cache_evictions, "evictions", cache.evictions)
        m.tokenize_cache_bytes.set(cache.bytes)
        m.tokenize_cache_entries.set(cache.entries)

    def _add(self, counter: Counter, name: str, total: int) -> None:
        new = total - self._seen.get(name, 0)
        if new > 0:
            counter.inc(new)
        self._seen[name] = total
