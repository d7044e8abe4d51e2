"""The int32 token codec: prompt token ids as a base64 string of little-endian int32, and back.

Decoding gives a read-only ``np.frombuffer`` view of the decoded bytes, validated with whole-array operations, so a
long prompt costs one base64 pass and no Python ``int``; every failure is a 400 that names its field."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Final

import numpy as np
import numpy.typing as npt
import pybase64

from frontend.errors import ContextLengthError, TokenCodecError

TOKEN_DTYPE: Final = np.dtype("<i4")
TokenArray = npt.NDArray[np.int32]

B64_FIELD: Final = "prompt_token_ids_b64"
LIST_FIELD: Final = "prompt_token_ids"


def encode_prompt_tokens(token_ids: TokenArray | Sequence[int]) -> str:
    """Base64 of the token ids as little-endian int32 (the CTX side of the wire)."""
    array = np.asarray(token_ids)
    if array.dtype != TOKEN_DTYPE:
        array = array.astype(TOKEN_DTYPE)
    return pybase64.b64encode(np.ascontiguousarray(array).data).decode("ascii")


def decode_prompt_tokens(
    encoded: str,
    *,
    vocab_size: int,
    max_tokens: int | None = None,
    expected_len: int | None = None,
    field: str = B64_FIELD,
) -> TokenArray:
    """Decode and validate a ``prompt_token_ids_b64`` string into a read-only int32 array (zero-copy)."""
    if not isinstance(encoded, str):
        raise TokenCodecError(f"'{field}' must be a base64 string", param=field)
    try:
        raw = pybase64.b64decode(encoded, validate=True)
    except (ValueError, TypeError) as exc:
        # binascii.Error is a ValueError; non-ASCII text raises ValueError too.
        raise TokenCodecError(f"'{field}' is not valid base64: {exc}", param=field) from exc
    if len(raw) % TOKEN_DTYPE.itemsize:
        raise TokenCodecError(
            f"'{field}' decodes to {len(raw)} bytes, which is not a multiple of 4 (little-endian int32 ids)",
            param=field,
        )
    tokens: TokenArray = np.frombuffer(raw, dtype=TOKEN_DTYPE)
    validate_token_array(tokens, vocab_size=vocab_size, max_tokens=max_tokens, expected_len=expected_len, field=field)
    return tokens


def token_array_from_list(
    token_ids: Sequence[int],
    *,
    vocab_size: int,
    max_tokens: int | None = None,
    expected_len: int | None = None,
    field: str = LIST_FIELD,
) -> TokenArray:
    """The list path: a client's explicit ``prompt_token_ids``. Validated the same way as the array path."""
    try:
        given = np.asarray(token_ids)
    except (ValueError, TypeError, OverflowError) as exc:
        raise TokenCodecError(f"'{field}' must be a list of integers", param=field) from exc
    if given.ndim != 1:
        raise TokenCodecError(f"'{field}' must be a flat list of integers", param=field)
    # Casting straight to int64 would truncate 1.5 to 1 and parse "7" as 7: refuse anything not integral.
    if given.size and given.dtype.kind not in "iu":
        raise TokenCodecError(f"'{field}' must be a list of integers", param=field)
    wide = given.astype(np.int64)  # a uint64 id beyond int64 wraps negative and fails the range check below
    # Range-check in int64 first so that ids beyond int32 are reported, not silently wrapped.
    _check_range(wide, vocab_size, field)
    tokens: TokenArray = wide.astype(TOKEN_DTYPE)
    validate_token_array(tokens, vocab_size=vocab_size, max_tokens=max_tokens, expected_len=expected_len,
                         field=field, check_range=False)  # checked above, in int64
    return tokens


def validate_token_array(
    tokens: TokenArray,
    *,
    vocab_size: int,
    max_tokens: int | None,
    expected_len: int | None,
    field: str,
    check_range: bool = True,
) -> None:
    if tokens.size == 0:
        raise TokenCodecError(f"'{field}' must hold at least one token", param=field)
    if expected_len is not None and tokens.size != expected_len:
        raise TokenCodecError(
            f"'{field}' holds {tokens.size} tokens but prompt_len says {expected_len}", param="prompt_len"
        )
    if max_tokens is not None and tokens.size > max_tokens:
        raise ContextLengthError(
            f"the prompt has {tokens.size} tokens, more than the model's context of {max_tokens}", param=field
        )
    if check_range:
        _check_range(tokens, vocab_size, field)


def _check_range(tokens: npt.NDArray[np.integer], vocab_size: int, field: str) -> None:
    # One pass: viewed as unsigned, a negative id becomes huge, so a single comparison finds both ends.
    # ``max()`` is a reduction: no per-token temporary, so validation allocates nothing that grows with the prompt.
    unsigned: npt.NDArray[np.unsignedinteger] = tokens.view(np.uint32 if tokens.dtype.itemsize == 4 else np.uint64)
    if unsigned.size and int(unsigned.max()) >= vocab_size:
        index = int(np.flatnonzero(unsigned >= vocab_size)[0])  # only on the error path
        raise TokenCodecError(
            f"'{field}'[{index}] = {int(tokens[index])} is outside the vocabulary [0, {vocab_size})", param=field
        )
