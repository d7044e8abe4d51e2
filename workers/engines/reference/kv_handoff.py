"""The KV hand-off format: what a CTX engine exports and a GEN engine imports.

    b"DSKV1\n" | u32 header length | JSON header | K bytes | V bytes | prompt int32 bytes (optional)

The header (dtype, layout, RoPE convention, token count, model hash) lets GEN refuse a hand-off that is not its own
instead of decoding garbage. The layout and when the prompt's ids ride along: docs/engines.md."""

from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt
import orjson

from frontend.token_codec import TOKEN_DTYPE, TokenArray

MAGIC = b"DSKV1\n"
LAYOUT = "layers,kv_heads,tokens,head_dim"
ROPE = "adjacent-pairs"
_LEN = struct.Struct("<I")

F32Array = npt.NDArray[np.float32]


class HandoffFormatError(ValueError):
    """The bytes are not a usable hand-off for this engine; the message says why."""


@dataclass(frozen=True, slots=True)
class KVHandoff:
    k: F32Array
    v: F32Array
    model_hash: str
    rope_base: float
    prompt_tokens: TokenArray | None = None
    prompt_logprobs: list[Any] | None = None  # computed on CTX when asked for; GEN reports them

    @property
    def n_tokens(self) -> int:
        return int(self.k.shape[2])


def encode_handoff(handoff: KVHandoff) -> bytes:
    header = {
        "dtype": "float32",
        "layout": LAYOUT,
        "rope": ROPE,
        "rope_base": handoff.rope_base,
        "shape": list(handoff.k.shape),
        "n_tokens": handoff.n_tokens,
        "model_hash": handoff.model_hash,
        "prompt_tokens": handoff.prompt_tokens is not None,
        "prompt_logprobs": handoff.prompt_logprobs,
    }
    head = orjson.dumps(header)
    parts: list[bytes | memoryview] = [MAGIC, _LEN.pack(len(head)), head, np.ascontiguousarray(handoff.k).data,
                                       np.ascontiguousarray(handoff.v).data]
    if handoff.prompt_tokens is not None:
        parts.append(np.ascontiguousarray(handoff.prompt_tokens, dtype=TOKEN_DTYPE).data)
    return b"".join(parts)


def decode_handoff(
    data: bytes, *, model_hash: str, rope_base: float, layers: int, kv_heads: int, head_dim: int,
    expected_tokens: int
) -> KVHandoff:
    """Parse and check a hand-off; zero-copy views over ``data``. Raises HandoffFormatError on any mismatch."""
    if not data.startswith(MAGIC):
        raise HandoffFormatError("not a KV hand-off (bad magic)")
    offset = len(MAGIC)
    try:
        (head_len,) = _LEN.unpack_from(data, offset)
        header = orjson.loads(data[offset + _LEN.size : offset + _LEN.size + head_len])
    except (struct.error, orjson.JSONDecodeError) as exc:
        raise HandoffFormatError("the hand-off header is unreadable") from exc
    offset += _LEN.size + head_len
    expected_header = {"dtype": "float32", "layout": LAYOUT, "rope": ROPE, "model_hash": model_hash}
    for key, value in expected_header.items():
        if header.get(key) != value:
            raise HandoffFormatError(f"hand-off {key} is {header.get(key)!r}, this engine needs {value!r}")
    if header.get("rope_base") != rope_base:
        raise HandoffFormatError(f"hand-off RoPE base {header.get('rope_base')} != this model's {rope_base}")
    n = header.get("n_tokens")
    shape = (layers, kv_heads, n, head_dim)
    if header.get("shape") != list(shape):
        raise HandoffFormatError(f"hand-off shape {header.get('shape')} does not fit this model {list(shape)}")
    if n != expected_tokens:
        raise HandoffFormatError(f"hand-off holds {n} tokens but the request's prompt has {expected_tokens}")
    count = layers * kv_heads * n * head_dim
    size = count * 4
    token_bytes = n * 4 if header.get("prompt_tokens") else 0
    if len(data) != offset + 2 * size + token_bytes:
        raise HandoffFormatError("the hand-off is truncated or has trailing bytes")
    k = np.frombuffer(data, np.float32, count, offset).reshape(shape)
    v = np.frombuffer(data, np.float32, count, offset + size).reshape(shape)
    tokens = np.frombuffer(data, TOKEN_DTYPE, n, offset + 2 * size) if token_bytes else None
    return KVHandoff(k, v, model_hash, rope_base, tokens, header.get("prompt_logprobs"))
