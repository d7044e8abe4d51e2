"""The llama forward pass in float32 numpy: KV cache, prefill, single and batched decode.

Determinism matters more than speed here: the same input, cache contents and BLAS thread count
must give bitwise-identical logits, so a KV cache exported by one worker and imported by another
continues exactly. Every path therefore reads the cache through the same [:length] views and
runs the same operations in the same order whatever the cache's capacity.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import numpy.typing as npt

from workers.engines.reference.model_file import ModelConfig, ModelWeights

F32Array = npt.NDArray[np.float32]
I32Array = npt.NDArray[np.int32]

# Queries per attention block during prefill: bounds the score matrix to
# n_heads * block * n floats instead of n_heads * n * n for long prompts.
_PREFILL_QUERY_BLOCK = 512
_MIN_CAPACITY = 64

StopCheck = Callable[[], bool]
# Where a pass asks ``stop``, in every layer: before it, before attention, before the output projection, and
# between the MLP's two matmuls. None of these splits an operation, so a finished pass computes exactly what it
# would without asking; the longest stretch between two asks is one matmul (~20 ms for a 512-token chunk here).
STOP_CHECKS_PER_LAYER = 4


class Interrupted(Exception):
    """``stop`` said so inside the pass: the cache holds a partial pass and must be thrown away."""


def _check(stop: StopCheck | None) -> None:
    if stop is not None and stop():
        raise Interrupted


class KVCache:
    """Per-layer K and V, each [n_kv_heads, capacity, head_dim] float32, filled up to `length`.

    The arrays are made when first used, not with the cache: a request waiting in the scheduler's queue holds its
    cache but not its memory (~46 KB per position; zeroing it for ten 2,000-token prompts took tens of ms of the
    engine's loop), and one aborted there never takes any."""

    def __init__(self, config: ModelConfig, capacity: int = _MIN_CAPACITY) -> None:
        self.config = config
        self.length = 0
        self._capacity = max(1, capacity)
        self._k: list[F32Array] | None = None
        self._v: list[F32Array] | None = None

    @property
    def allocated(self) -> bool:
        """Whether the arrays exist yet."""
        return self._k is not None

    def _allocate(self) -> tuple[list[F32Array], list[F32Array]]:
        shape = (self.config.n_kv_heads, self._capacity, self.config.head_dim)
        self._k = [np.zeros(shape, np.float32) for _ in range(self.config.n_layers)]
        self._v = [np.zeros(shape, np.float32) for _ in range(self.config.n_layers)]
        return self._k, self._v

    @property
    def k(self) -> list[F32Array]:
        return self._k if self._k is not None else self._allocate()[0]

    @property
    def v(self) -> list[F32Array]:
        return self._v if self._v is not None else self._allocate()[1]

    @property
    def capacity(self) -> int:
        return self._capacity

    def reserve(self, total: int) -> None:
        """Make room for `total` positions, doubling so appends cost amortised O(1)."""
        if total > self.config.context_length:
            raise ValueError(f"{total} positions exceed the model's context of {self.config.context_length}")
        if total <= self.capacity:
            return
        new_capacity = min(max(total, 2 * self.capacity), self.config.context_length)
        if self._k is None:  # nothing in it yet: made at the new size when first used
            self._capacity = new_capacity
            return
        shape = (self.config.n_kv_heads, new_capacity, self.config.head_dim)
        for layer in range(self.config.n_layers):
            for store in (self.k, self.v):
                grown = np.zeros(shape, np.float32)
                grown[:, : self.length] = store[layer][:, : self.length]
                store[layer] = grown
        self._capacity = new_capacity


def fork_kv(cache: KVCache) -> KVCache:
    """A copy of ``cache`` that decodes on independently of it: bitwise the same positions, its own storage.

    Sequences forked from one prefill (n > 1) copy the prompt's KV rather than share it: attention here reads one
    contiguous [:length] view per layer, and sharing would need a block table whose gathers change the order of
    operations, so a forked sequence would no longer match the same sequence decoded alone, bit for bit."""
    forked = KVCache(cache.config, capacity=cache.capacity)
    n = cache.length
    for layer in range(cache.config.n_layers):
        forked.k[layer][:, :n] = cache.k[layer][:, :n]
        forked.v[layer][:, :n] = cache.v[layer][:, :n]
    forked.length = n
    return forked


def export_kv(cache: KVCache) -> tuple[F32Array, F32Array]:
    """K and V as contiguous [layers, kv_heads, n, head_dim] float32 (post-RoPE keys)."""
    n = cache.length
    k = np.stack([layer[:, :n] for layer in cache.k])
    v = np.stack([layer[:, :n] for layer in cache.v])
    return k, v


def import_kv(k: F32Array, v: F32Array, config: ModelConfig, capacity: int | None = None) -> KVCache:
    """A cache holding exported K/V; decoding from it matches decoding from the original bitwise."""
    expected = (config.n_layers, config.n_kv_heads, config.head_dim)
    if k.shape != v.shape or k.ndim != 4 or (k.shape[0], k.shape[1], k.shape[3]) != expected:
        raise ValueError(
            f"KV shapes {k.shape}/{v.shape} do not match [layers, kv_heads, n, head_dim] = {expected}"
        )
    if k.dtype != np.float32 or v.dtype != np.float32:
        raise ValueError("KV arrays must be float32")
    n = k.shape[2]
    cache = KVCache(config, capacity=max(n, _MIN_CAPACITY) if capacity is None else capacity)
    cache.reserve(n)
    for layer in range(config.n_layers):
        cache.k[layer][:, :n] = k[layer]
        cache.v[layer][:, :n] = v[layer]
    cache.length = n
    return cache


def _rms_norm(x: F32Array, weight: F32Array, eps: float) -> F32Array:
    variance = np.mean(x * x, axis=-1, keepdims=True)
    inv_rms: F32Array = np.float32(1.0) / np.sqrt(variance + np.float32(eps))
    out: F32Array = x * inv_rms * weight
    return out


def _softmax_inplace(scores: F32Array) -> F32Array:
    scores -= scores.max(axis=-1, keepdims=True)
    np.exp(scores, out=scores)
    scores /= scores.sum(axis=-1, keepdims=True)
    return scores


def _silu(x: F32Array) -> F32Array:
    # astype(copy=False) is free here: it only restates the float32 dtype for the type checker.
    out: F32Array = (x / (np.float32(1.0) + np.exp(-x))).astype(np.float32, copy=False)
    return out


class Transformer:
    def __init__(self, weights: ModelWeights) -> None:
        self.weights = weights
        self.config = c = weights.config
        # RoPE on adjacent pairs (x[2i], x[2i+1]), angle pos * base^(-2i/head_dim): the convention that
        # matches GGUF's permuted q/k weights. Tables are computed in float64 once, stored float32.
        inv_freq = c.rope_base ** (-np.arange(0, c.head_dim, 2, dtype=np.float64) / c.head_dim)
        angles = np.outer(np.arange(c.context_length, dtype=np.float64), inv_freq)
        self._cos = np.cos(angles).astype(np.float32)  # (context, head_dim/2)
        self._sin = np.sin(angles).astype(np.float32)
        self._scale = np.float32(1.0 / np.sqrt(c.head_dim))
        self._group = c.n_heads // c.n_kv_heads

    def new_cache(self, capacity: int = _MIN_CAPACITY) -> KVCache:
        return KVCache(self.config, capacity)

    def _rope(self, x: F32Array, positions: I32Array) -> F32Array:
        """x: [heads, T, head_dim] rotated at `positions` (length T)."""
        cos = self._cos[positions]  # (T, hd/2), broadcast over heads
        sin = self._sin[positions]
        even = x[..., 0::2]
        odd = x[..., 1::2]
        out = np.empty_like(x)
        out[..., 0::2] = even * cos - odd * sin
        out[..., 1::2] = even * sin + odd * cos
        return out

    def _qkv(self, h: F32Array, layer: int, positions: I32Array) -> tuple[F32Array, F32Array, F32Array]:
        """Project normalised h (T, d) to RoPE'd q [n_heads, T, hd], k and v [n_kv_heads, T, hd]."""
        c, lw = self.config, self.weights.layers[layer]
        t = h.shape[0]
        qkv = h @ lw.wqkv.T
        q = qkv[:, : lw.q_dim].reshape(t, c.n_heads, c.head_dim).transpose(1, 0, 2)
        k = qkv[:, lw.q_dim : lw.q_dim + lw.kv_dim].reshape(t, c.n_kv_heads, c.head_dim).transpose(1, 0, 2)
        v = qkv[:, lw.q_dim + lw.kv_dim :].reshape(t, c.n_kv_heads, c.head_dim).transpose(1, 0, 2)
        return self._rope(q, positions), self._rope(k, positions), v

    def _attend(self, q: F32Array, k_all: F32Array, v_all: F32Array, start: int) -> F32Array:
        """Causal GQA attention of queries at positions start..start+T-1 over k_all/v_all [kv, n, hd].

        Returns (T, n_heads * head_dim). Query head h reads KV head h // group: grouping the
        query heads per KV head turns GQA into one batched matmul per block.
        """
        c, g = self.config, self._group
        t, n = q.shape[1], k_all.shape[1]
        qg = q.reshape(c.n_kv_heads, g, t, c.head_dim)
        out = np.empty((c.n_kv_heads, g, t, c.head_dim), np.float32)
        k_t = k_all.transpose(0, 2, 1)  # [kv, hd, n]
        for b0 in range(0, t, _PREFILL_QUERY_BLOCK):
            b1 = min(t, b0 + _PREFILL_QUERY_BLOCK)
            blk = qg[:, :, b0:b1].reshape(c.n_kv_heads, g * (b1 - b0), c.head_dim)
            scores = (blk @ k_t) * self._scale  # [kv, g*tb, n]
            scores = scores.reshape(c.n_kv_heads, g, b1 - b0, n)
            if b1 - b0 > 1 or start + b0 + 1 < n:
                # Query at absolute position p sees keys 0..p.
                qpos = np.arange(start + b0, start + b1)[:, None]
                scores[..., np.arange(n)[None, :] > qpos] = -np.inf
            _softmax_inplace(scores)
            out[:, :, b0:b1] = (scores.reshape(c.n_kv_heads, g * (b1 - b0), n) @ v_all).reshape(
                c.n_kv_heads, g, b1 - b0, c.head_dim
            )
        return out.reshape(c.n_heads, t, c.head_dim).transpose(1, 0, 2).reshape(t, c.n_heads * c.head_dim)

    def _mlp(self, x: F32Array, layer: int, stop: StopCheck | None = None) -> F32Array:
        lw = self.weights.layers[layer]
        h = _rms_norm(x, lw.ffn_norm, self.config.rms_eps)
        gate_up = h @ lw.w_gate_up.T
        act = _silu(gate_up[:, : lw.d_ff]) * gate_up[:, lw.d_ff :]
        _check(stop)
        out: F32Array = act @ lw.w_down.T
        return out

    def _forward(self, token_ids: I32Array, cache: KVCache, stop: StopCheck | None = None) -> F32Array:
        """Run T new tokens through every layer, appending to the cache; returns final hidden (T, d).

        ``stop`` is asked ``STOP_CHECKS_PER_LAYER`` times in each layer (before it, before attention, before the
        output projection, between the MLP's matmuls); when it answers True the pass ends with ``Interrupted``.
        A prefill chunk of 512 tokens takes seconds on a busy CPU, one of its layers 50-80 ms: this is what lets an
        abort land within one matmul of it rather than after the layer or the chunk. It never changes what a
        finished pass computes.
        """
        c = self.config
        ids = np.asarray(token_ids, dtype=np.int32).reshape(-1)
        t = ids.shape[0]
        if t == 0:
            raise ValueError("no tokens to process")
        if ids.min() < 0 or ids.max() >= c.vocab_size:
            raise ValueError(f"token id out of range [0, {c.vocab_size})")
        start = cache.length
        cache.reserve(start + t)
        positions = np.arange(start, start + t, dtype=np.int32)
        x = self.weights.token_embedding[ids]
        for layer in range(c.n_layers):
            _check(stop)
            lw = self.weights.layers[layer]
            q, k, v = self._qkv(_rms_norm(x, lw.attn_norm, c.rms_eps), layer, positions)
            cache.k[layer][:, start : start + t] = k
            cache.v[layer][:, start : start + t] = v
            end = start + t
            _check(stop)
            attn = self._attend(q, cache.k[layer][:, :end], cache.v[layer][:, :end], start)
            _check(stop)
            x = x + attn @ lw.wo.T
            x = x + self._mlp(x, layer, stop)
        cache.length = start + t
        return _rms_norm(x, self.weights.output_norm, c.rms_eps)

    def _logits(self, hidden: F32Array) -> F32Array:
        out: F32Array = hidden @ self.weights.output.T
        return out

    def prefill(self, token_ids: I32Array, cache: KVCache, stop: StopCheck | None = None) -> F32Array:
        """Process a whole prompt in one shot, after whatever the cache holds.

        Returns the logits (vocab,) of the last position.
        """
        hidden = self._forward(token_ids, cache, stop)
        logits: F32Array = self._logits(hidden[-1:])[0]
        return logits

    def prefill_all_logits(self, token_ids: I32Array, cache: KVCache, stop: StopCheck | None = None) -> F32Array:
        """Like prefill, but logits (T, vocab) for every position (prompt logprobs / echo).

        The cache contents are identical to prefill's; only the output projection differs.
        """
        return self._logits(self._forward(token_ids, cache, stop))

    def decode(self, token_id: int, cache: KVCache) -> F32Array:
        """Append one token; logits (vocab,) for the next position."""
        hidden = self._forward(np.array([token_id], dtype=np.int32), cache)
        logits: F32Array = self._logits(hidden)[0]
        return logits
