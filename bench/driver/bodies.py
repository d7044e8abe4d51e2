"""Request bodies as the wire carries them: generation_only bodies for GEN (list, array, metadata-only) and client
bodies for the orchestrator. Token ids are random in [0, 50,000), below the synthetic engine's vocabulary."""

from __future__ import annotations

import functools
import pathlib
import sysconfig
from typing import Any, Literal

import numpy as np
import orjson
import pybase64

from frontend.token_codec import TOKEN_DTYPE

VOCAB_LIMIT = 50_000  # SyntheticConfig.vocab_size
SYNTHETIC_MODEL = "synthetic"
FIRST_GEN_TOKEN = 84  # 'T', the synthetic engine's first output token

GenKind = Literal["list", "array", "metadata"]
GEN_KINDS: tuple[GenKind, ...] = ("list", "array", "metadata")


def random_tokens(count: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, VOCAB_LIMIT, count, dtype=np.int64).astype(TOKEN_DTYPE)


def synthetic_handoff(prompt_len: int) -> dict[str, Any]:
    """The disaggregated_params a synthetic CTX would hand GEN (see SyntheticEngine._check_handoff)."""
    state = orjson.dumps({"engine": "synthetic", "prompt_len": prompt_len, "position": 1})
    return {
        "request_type": "generation_only",
        "first_gen_tokens": [FIRST_GEN_TOKEN],
        "encoded_opaque_state": pybase64.b64encode(state).decode("ascii"),
        "prompt_len": prompt_len,
    }


def gen_body(tokens: np.ndarray, kind: GenKind, max_tokens: int = 1, **extra: Any) -> bytes:
    """A /v1/completions generation_only body carrying the prompt as a list, as base64 int32, or not at all."""
    body: dict[str, Any] = {"model": SYNTHETIC_MODEL, "max_tokens": max_tokens, **extra,
                            "disaggregated_params": synthetic_handoff(int(tokens.size))}
    if kind == "list":
        body["prompt_token_ids"] = tokens.tolist()
    elif kind == "array":
        body["prompt_token_ids_b64"] = pybase64.b64encode(tokens.astype(TOKEN_DTYPE).tobytes()).decode("ascii")
    elif kind != "metadata":
        raise ValueError(f"unknown body kind {kind!r}")
    return orjson.dumps(body)


def prompt_text(chars: int, seed: int = 0) -> str:
    """ASCII text of exactly ``chars`` characters: the synthetic byte tokenizer makes it ``chars`` tokens."""
    words = ("alpha", "bravo", "charlie", "delta", "echo", "foxtrot", "golf", "hotel", "india", "juliett",
             "kilo", "lima", "mike", "november", "oscar", "papa", "quebec", "romeo", "sierra", "tango")
    rng = np.random.default_rng(seed)
    pieces: list[str] = []
    size = 0
    while size < chars:
        word = words[int(rng.integers(len(words)))] + " "
        pieces.append(word)
        size += len(word)
    return "".join(pieces)[:chars]


@functools.cache
def _stdlib_source() -> str:
    root = pathlib.Path(sysconfig.get_paths()["stdlib"])
    return "".join(path.read_text(encoding="utf-8", errors="replace") for path in sorted(root.glob("*.py")))


def corpus_text(chars: int, seed: int = 0) -> str:
    """``chars`` characters of real text: the Python standard library's own source (code, comments, docstrings in
    English: what a coding agent sends), from an offset chosen by ``seed``. What a real tokenizer pays for depends on
    the text: on ``prompt_text``'s twenty repeated words a BPE's word cache answers nearly every word, and one
    ``tokenizers`` encode of 131k tokens cost 57 ms here, against 250-630 ms on this text."""
    source = _stdlib_source()
    if chars > len(source):
        source = source * (chars // len(source) + 1)
    start = (seed * 7_919_993) % (len(source) - chars + 1)
    return source[start:start + chars]


def client_completion_body(prompt_chars: int, max_tokens: int, stream: bool = True, seed: int = 0) -> dict[str, Any]:
    return {"model": SYNTHETIC_MODEL, "prompt": prompt_text(prompt_chars, seed), "max_tokens": max_tokens,
            "temperature": 0, "stream": stream}
