"""The encoder of prompt pieces: ``fastokens`` where it is exact for this tokenizer, else Hugging Face ``tokenizers``.

``fastokens`` is built from the JSON ``tokenizers`` serializes and checked against it at load on a probe text; a
difference or a load failure keeps ``tokenizers``, with one log line. Its flat uint32 output is viewed as the int32
array, so no Python int is built per token. Costs: docs/engines.md, "Tokenization: what a turn costs"."""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from typing import Any, Protocol

import numpy as np
import numpy.typing as npt
from tokenizers import Tokenizer

from frontend.token_codec import TOKEN_DTYPE, TokenArray

log = logging.getLogger("disagg_serve.tokenization")

Offsets = npt.NDArray[np.uint64]

_PROBE = (
    "Hello, world! It's 2026-12-07; 3.14159 and 1234567890 digits.\n\n  indented\tcode = {'a': [1, 2]}\n"
    "Ünïcödé κόσμε 日本語のテキスト 🙂🚀👩‍👩‍👧 mañana\r\n"
    "averyveryverylongrunwithoutanyspacesatallthatgoesonandonandonforquiteawhile_andmore_____\n"
    "def f(x):\n    return x ** 2  # comment   \n\n\n   trailing spaces   "
    "<|im_end <im_start|> <|endoftext| << >> <| |> "
)


class PieceEncoder(Protocol):
    """Encodes pieces independently (no added special tokens) into their ids, concatenated in order."""

    @property
    def name(self) -> str: ...

    def encode_pieces(self, pieces: Sequence[str]) -> tuple[TokenArray, Offsets]:
        """(all pieces' ids one after another, offsets: piece i's ids are ids[offsets[i]:offsets[i+1]])."""
        ...


class TokenizersEncoder:
    """Hugging Face ``tokenizers``: a batch is encoded in parallel; each piece's ids come back as a Python list."""

    name = "tokenizers"

    def __init__(self, tokenizer: Tokenizer) -> None:
        self._tokenizer = tokenizer

    def encode_pieces(self, pieces: Sequence[str]) -> tuple[TokenArray, Offsets]:
        if len(pieces) == 1:
            id_lists = [self._tokenizer.encode(pieces[0], add_special_tokens=False).ids]
        else:
            id_lists = [e.ids for e in self._tokenizer.encode_batch(list(pieces), add_special_tokens=False)]
        lengths = np.fromiter((len(ids) for ids in id_lists), dtype=np.uint64, count=len(id_lists))
        offsets = np.zeros(len(id_lists) + 1, dtype=np.uint64)
        np.cumsum(lengths, out=offsets[1:])
        ids = np.fromiter((i for ids in id_lists for i in ids), dtype=TOKEN_DTYPE, count=int(offsets[-1]))
        return ids, offsets


class FastokensEncoder:
    """``fastokens``: the batch's ids as one uint32 buffer, viewed as int32 with no per-token object. A batch it
    refuses (its regex engine's backtracking limits, e.g. on a run of a million spaces) is encoded by ``fallback``:
    the answer is ``tokenizers``' either way, never an error ``tokenizers`` would not give."""

    name = "fastokens"

    def __init__(self, tokenizer: Any, fallback: PieceEncoder) -> None:
        self._tokenizer = tokenizer
        self._fallback = fallback

    def encode_pieces(self, pieces: Sequence[str]) -> tuple[TokenArray, Offsets]:
        try:
            flat, offsets = self._tokenizer.encode_batch_flat(list(pieces), add_special_tokens=False)
        except Exception as exc:  # a Rust error surfaces as ValueError (or a panic's exception): not ours to raise
            log.warning("fastokens refused a prompt (%s: %s); encoding it with Hugging Face tokenizers",
                        type(exc).__name__, exc)
            return self._fallback.encode_pieces(pieces)
        ids: TokenArray = np.frombuffer(flat, dtype="<u4").view(TOKEN_DTYPE)
        return ids, np.frombuffer(offsets, dtype="<u8")


def load_piece_encoder(tokenizer: Tokenizer, backend: str = "auto", threads: int | None = None) -> PieceEncoder:
    """``fastokens`` for ``tokenizer`` if asked (``auto``) and exact on the probe, else ``tokenizers`` itself.

    ``threads`` caps the encoders' threads, process-wide and fixed at their first use: ``fastokens`` runs a long
    text's BPE on worker threads of its own (``FASTOKENS_BPE_THREADS``: a new 131k-token chat 27.6 ms on one, 17.7 ms
    on both of this machine's cores), ``tokenizers`` a batch of pieces on Rust's rayon pool (``RAYON_NUM_THREADS``).
    By default both take the cores this process may use. A variable already set in the environment wins."""
    if threads is not None:
        os.environ.setdefault("FASTOKENS_BPE_THREADS", str(threads))
        os.environ.setdefault("RAYON_NUM_THREADS", str(threads))
    baseline = TokenizersEncoder(tokenizer)
    if backend == "tokenizers":
        return baseline
    try:
        import fastokens

        fast = FastokensEncoder(fastokens.Tokenizer.from_json_str(tokenizer.to_str()), baseline)
        differs = _first_difference(fast, baseline, tokenizer)
    except Exception as exc:  # a Rust panic or an unsupported component: either way, not usable here
        log.warning("fastokens cannot load this tokenizer (%s: %s); encoding with Hugging Face tokenizers",
                    type(exc).__name__, exc)
        return baseline
    if differs is not None:
        log.warning("fastokens' ids differ from Hugging Face tokenizers' on %r; encoding with tokenizers", differs)
        return baseline
    return fast


def _first_difference(encoder: PieceEncoder, reference: PieceEncoder, tokenizer: Tokenizer) -> str | None:
    """The first probe piece the two encoders disagree on (None: they agree on all). The probe holds every added
    token of ``tokenizer`` whole, between words and back to back, besides partial spellings."""
    added = [token.content for token in tokenizer.get_added_tokens_decoder().values()]
    pieces = [_PROBE, *_PROBE.split(" "), *_PROBE.splitlines(), " x ".join(added), "".join(added),
              *(f"a{token}b {token}\n" for token in added)]
    ids, offsets = encoder.encode_pieces(pieces)
    want, want_offsets = reference.encode_pieces(pieces)
    if np.array_equal(ids, want) and np.array_equal(offsets, want_offsets):
        return None
    for piece in pieces:
        mine = encoder.encode_pieces([piece])[0]
        theirs = reference.encode_pieces([piece])[0]
        if not np.array_equal(mine, theirs):
            return piece
    return "(the batch)"
