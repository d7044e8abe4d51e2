"""Moves the tokenizer's running totals (``workers.tokenization.prompt_encoder.TokenizeStats``) into the worker's
Prometheus metrics when ``/metrics`` is scraped: each scrape adds what is new since the last one."""

from __future__ import annotations

from frontend.metrics import CounterFeed, Metrics
from workers.tokenization.prompt_encoder import TokenizeStats


class TokenizeCounts:
    def __init__(self, metrics: Metrics) -> None:
        self._metrics = metrics
        self._feed = CounterFeed()

    def bring_up_to(self, stats: TokenizeStats | None) -> None:
        if stats is None:  # nothing tokenized yet
            return
        m, feed = self._metrics, self._feed
        feed.add(m.tokenize_prompts, "prompts", stats.prompts)
        feed.add(m.tokenize_encoded_tokens, "encoded", stats.encoded_tokens)
        rendered = stats.rendered
        if rendered is not None:
            feed.add(m.tokenize_render_hits, "render_hits", rendered.hits)
            feed.add(m.tokenize_render_reused_messages, "render_reused", rendered.reused_messages)
            m.tokenize_render_bytes.set(rendered.bytes)
        cache = stats.cache
        if cache is None:
            return
        feed.add(m.tokenize_cache_hits, "hits", cache.hits)
        feed.add(m.tokenize_cache_reused_tokens, "reused", cache.reused_tokens)
        feed.add(m.tokenize_cache_evictions, "evictions", cache.evictions)
        m.tokenize_cache_bytes.set(cache.bytes)
        m.tokenize_cache_entries.set(cache.entries)
