"""KV block reuse: full blocks of KV kept by a hash of the token *values* that produced them.

Block i's key chains the key of block i-1 with the int32 bytes of its tokens, so a key names a whole prefix.
A request whose prompt starts with cached blocks copies them in and prefills only the rest. Because keys are
made of token values, a length-only placeholder prompt would key its blocks on placeholder values and collide
with any real prompt of the same values: that is why the metadata-only guardrail refuses placeholders on a
worker with block reuse on (unless the real tokens came with the hand-off).
"""

from __future__ import annotations

import collections
import hashlib

import numpy as np
import numpy.typing as npt

from frontend.token_codec import TokenArray
from workers.engines.reference.model_file import ModelConfig
from workers.engines.reference.transformer import KVCache

F32Array = npt.NDArray[np.float32]
BLOCK_TOKENS = 16


def capacity_tokens(max_bytes: int, config: ModelConfig, block_tokens: int = BLOCK_TOKENS) -> int:
    """Tokens of prompt KV a cache of ``max_bytes`` holds: whole blocks of float32 K and V for every layer."""
    block_bytes = 2 * config.n_layers * config.n_kv_heads * block_tokens * config.head_dim * 4
    return max_bytes // block_bytes * block_tokens if max_bytes > 0 else 0


def block_keys(tokens: TokenArray, block_tokens: int = BLOCK_TOKENS) -> list[bytes]:
    keys: list[bytes] = []
    previous = b""
    for start in range(0, tokens.shape[0] - block_tokens + 1, block_tokens):
        previous = hashlib.blake2b(previous + tokens[start : start + block_tokens].tobytes(), digest_size=16).digest()
        keys.append(previous)
    return keys


class PrefixCache:
    """An LRU of KV blocks bounded by bytes. Each block holds [layers, kv_heads, block, head_dim] K and V."""

    def __init__(self, max_bytes: int, block_tokens: int = BLOCK_TOKENS) -> None:
        self.max_bytes = max_bytes
        self.block_tokens = block_tokens
        self._blocks: collections.OrderedDict[bytes, tuple[F32Array, F32Array]] = collections.OrderedDict()
        self._bytes = 0
        self.hit_tokens = 0

    @property
    def blocks(self) -> int:
        return len(self._blocks)

    def insert(self, tokens: TokenArray, cache: KVCache) -> None:
        """Keep every full block of ``tokens`` whose KV ``cache`` holds (positions 0..len(tokens))."""
        b = self.block_tokens
        for index, key in enumerate(block_keys(tokens, b)):
            if key in self._blocks:
                self._blocks.move_to_end(key)
                continue
            span = slice(index * b, (index + 1) * b)
            k = np.stack([layer[:, span] for layer in cache.k])
            v = np.stack([layer[:, span] for layer in cache.v])
            self._blocks[key] = (k, v)
            self._bytes += k.nbytes + v.nbytes
        while self._bytes > self.max_bytes and self._blocks:
            _, (k, v) = self._blocks.popitem(last=False)
            self._bytes -= k.nbytes + v.nbytes

    def load_prefix(self, tokens: TokenArray, cache: KVCache) -> int:
        """Copy the longest cached prefix of ``tokens`` into the empty ``cache``; returns its length in tokens.

        At least one token is always left to prefill, since the last position's logits are needed.
        """
        b = self.block_tokens
        usable = (int(tokens.shape[0]) - 1) // b
        found: list[tuple[F32Array, F32Array]] = []
        for key in block_keys(tokens[: usable * b], b):
            block = self._blocks.get(key)
            if block is None:
                break
            self._blocks.move_to_end(key)
            found.append(block)
        if not found:
            return 0
        n = len(found) * b
        cache.reserve(n)
        for layer in range(len(cache.k)):
            cache.k[layer][:, :n] = np.concatenate([k[layer] for k, _ in found], axis=1)
            cache.v[layer][:, :n] = np.concatenate([v[layer] for _, v in found], axis=1)
        cache.length = n
        self.hit_tokens += n
        return n
