"""A tokenizer that needs no download: token id = UTF-8 byte (0-255); ids from 256 up are special.

Used by the synthetic engine. Ids at or above 256 are valid (the synthetic vocabulary is large so that benchmark
prompts can use realistic ids) and decode to nothing.
"""

from __future__ import annotations

import codecs
from collections.abc import Sequence

import numpy as np

from frontend.token_codec import TOKEN_DTYPE, TokenArray

BYTE_TOKENS = 256


class ByteDetokenizer:
    def __init__(self) -> None:
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def add(self, token_ids: Sequence[int]) -> str:
        return self._decoder.decode(bytes(t for t in token_ids if t < BYTE_TOKENS))


class ByteTokenizer:
    def __init__(self, vocab_size: int) -> None:
        if vocab_size < BYTE_TOKENS + 1:
            raise ValueError(f"the byte tokenizer needs a vocabulary of at least {BYTE_TOKENS + 1}")
        self._vocab_size = vocab_size

    @property
    def vocab_size(self) -> int:
        return self._vocab_size

    def encode(self, text: str) -> TokenArray:
        encoded: TokenArray = np.frombuffer(text.encode("utf-8"), dtype=np.uint8).astype(TOKEN_DTYPE)
        return encoded

    def decode(self, token_ids: Sequence[int] | TokenArray) -> str:
        ids = np.asarray(token_ids)
        return ids[ids < BYTE_TOKENS].astype(np.uint8).tobytes().decode("utf-8", errors="replace")

    def token_bytes(self, token_id: int) -> bytes:
        """The one byte a byte token stands for (``workers.engines.base.ProvidesTokenBytes``)."""
        return bytes((token_id,)) if 0 <= token_id < BYTE_TOKENS else b""

    def render_chat(self, messages: list[dict[str, str]]) -> str:
        turns = "".join(f"<|{m['role']}|>\n{m['content']}\n" for m in messages)
        return turns + "<|assistant|>\n"

    def detokenizer(self) -> ByteDetokenizer:
        return ByteDetokenizer()
