"""KV block reuse keyed by token values (tiny model)."""

from __future__ import annotations

import numpy as np

from tests.workers.engines.reference.conftest import Engine
from workers.engines.reference.prefix_cache import BLOCK_TOKENS, PrefixCache, block_keys


def _tokens(n: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(3, 300, size=n).astype("<i4")


def test_block_keys_chain_so_a_key_names_the_whole_prefix() -> None:
    a, b = _tokens(48), _tokens(48, seed=1)
    b[:16] = a[:16]
    keys_a, keys_b = block_keys(a), block_keys(b)
    assert len(keys_a) == 3
    assert keys_a[0] == keys_b[0]
    assert keys_a[1] != keys_b[1]
    c = a.copy()
    c[0] += 1  # a change in the first block changes every later key, even with equal later blocks
    assert all(x != y for x, y in zip(block_keys(c), keys_a, strict=True))


def test_a_loaded_prefix_continues_like_a_full_prefill(tiny: Engine) -> None:
    model = tiny.transformer
    prompt = _tokens(3 * BLOCK_TOKENS + 5)
    full = model.new_cache()
    expected = model.prefill(prompt, full)
    cache = PrefixCache(max_bytes=64 * 1024**2)
    cache.insert(prompt, full)
    assert cache.blocks == 3
    reused = model.new_cache()
    loaded = cache.load_prefix(prompt, reused)
    assert loaded == 3 * BLOCK_TOKENS
    for layer in range(len(full.k)):
        assert np.array_equal(reused.k[layer][:, :loaded], full.k[layer][:, :loaded])
    logits = model.prefill(prompt[loaded:], reused)
    np.testing.assert_allclose(logits, expected, rtol=1e-4, atol=1e-4)
    assert int(np.argmax(logits)) == int(np.argmax(expected))


def test_at_least_one_token_is_left_to_prefill(tiny: Engine) -> None:
    model = tiny.transformer
    prompt = _tokens(2 * BLOCK_TOKENS)
    full = model.new_cache()
    model.prefill(prompt, full)
    cache = PrefixCache(max_bytes=64 * 1024**2)
    cache.insert(prompt, full)
    assert cache.load_prefix(prompt, model.new_cache()) == BLOCK_TOKENS


def test_the_cache_is_bounded_by_bytes(tiny: Engine) -> None:
    model = tiny.transformer
    full = model.new_cache()
    prompt = _tokens(8 * BLOCK_TOKENS)
    model.prefill(prompt, full)
    cfg = model.config
    block_bytes = 2 * cfg.n_layers * cfg.n_kv_heads * BLOCK_TOKENS * cfg.head_dim * 4
    cache = PrefixCache(max_bytes=3 * block_bytes)
    cache.insert(prompt, full)
    assert cache.blocks == 3


def test_placeholder_prompts_collide_which_is_why_the_guardrail_exists(tiny: Engine) -> None:
    model = tiny.transformer
    real_a, real_b = _tokens(2 * BLOCK_TOKENS + 1, seed=1), _tokens(2 * BLOCK_TOKENS + 1, seed=2)
    placeholder = np.zeros_like(real_a)
    cache_a, cache_b = model.new_cache(), model.new_cache()
    model.prefill(real_a, cache_a)
    model.prefill(real_b, cache_b)
    cache = PrefixCache(max_bytes=64 * 1024**2)
    cache.insert(placeholder, cache_a)  # request A's KV, keyed by its placeholder values
    target = model.new_cache()
    assert cache.load_prefix(placeholder, target) == 2 * BLOCK_TOKENS  # request B would get A's KV
    assert not np.array_equal(target.k[0][:, :BLOCK_TOKENS], cache_b.k[0][:, :BLOCK_TOKENS])
