"""A prompt's text -> its int32 ids: what the conversation cache holds, plus the rest encoded in exact pieces.

The ids equal one whole ``tokenizers`` encode of the text (``add_special_tokens=False``, as the worker always
encodes a rendered chat or a raw completion prompt), by the rules of ``cut_rules``; tests/workers/tokenization hold
that over random conversations for every tokenizer the project ships or tests.
"""

from __future__ import annotations

import itertools
import logging
import os
import re
import threading
from dataclasses import dataclass

import numpy as np
from tokenizers import Tokenizer

from frontend.token_codec import TOKEN_DTYPE, TokenArray
from workers.engines.options import TokenizeConfig
from workers.tokenization.conversation_cache import CachedPrompt, CacheStats, ConversationCache, Cuts, Reuse
from workers.tokenization.cut_rules import CutRules, cut_rules_of
from workers.tokenization.piece_encoder import PieceEncoder, load_piece_encoder
from workers.tokenization.rendered_turns import RenderStats

log = logging.getLogger("disagg_serve.tokenization")

# Below this many new characters a prompt is encoded as its pieces between added tokens: splitting it further for
# threads costs more than it gives. Past it, long pieces are cut before spaces into about four pieces per thread.
PARALLEL_MIN_CHARS = 32_768
# Up to this many new characters (a follow-up turn's) are encoded in one call, not piece by piece: a batch wakes
# the encoder's threads, which costs more than such a text's BPE.
ONE_CALL_MAX_CHARS = 4_096


@dataclass(frozen=True, slots=True)
class TokenizeStats:
    encoder: str  # fastokens or tokenizers
    prompts: int
    encoded_tokens: int  # ids the encoder produced (the rest came from the cache)
    cache: CacheStats | None  # None: no cache (off, or this tokenizer has no exact cut)
    rendered: RenderStats | None = None  # the chat template's rendered-turns cache, where the tokenizer has one


def host_threads() -> int:
    """The cores this process may run on (its affinity, which a container's cpuset narrows)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


class PromptEncoder:
    def __init__(self, tokenizer: Tokenizer, config: TokenizeConfig | None = None) -> None:
        config = config or TokenizeConfig()
        self._rules: CutRules = cut_rules_of(tokenizer.to_str())
        if getattr(tokenizer, "encode_special_tokens", False):  # a runtime flag tokenizer.json does not carry
            self._rules = CutRules(None, False, ("the tokenizer encodes special tokens as text",))
        self._encoder: PieceEncoder = load_piece_encoder(tokenizer, config.backend, config.threads)
        self._threads = config.threads or host_threads()
        # backend "tokenizers" is today's cost, kept as the baseline: one whole encode of every prompt, as vLLM's
        # and trtllm-serve's servers do (no cache, no pieces). The exact fallback of "auto" (a tokenizer fastokens
        # cannot load) keeps both: only the encoder changes there.
        self._whole = config.backend == "tokenizers"
        self._cache: ConversationCache | None = None
        if config.cache_bytes > 0 and self._rules.added_tokens is not None and not self._whole:
            self._cache = ConversationCache(config.cache_bytes)
        if self._rules.refusals and not self._whole:
            log.warning("this tokenizer is encoded whole on every request, with no conversation cache and no "
                        "parallel pieces: %s", "; ".join(self._rules.refusals))
        # Whether each id is an added token's: where the cuts fall in the ids of a text encoded in one call.
        self._is_added = np.zeros(max(tokenizer.get_vocab_size(with_added_tokens=True), 1), dtype=bool)
        self._is_added[list(tokenizer.get_added_tokens_decoder())] = True
        self._lock = threading.Lock()
        self._prompts = self._encoded = 0
        # new_chars' last answer, for the encode of the same string that follows it (one slot: a look-up is cheap,
        # and a slot overwritten by another request's only costs that look-up again)
        self._last_found: tuple[str, Reuse | None] | None = None

    @property
    def encoder_name(self) -> str:
        return self._encoder.name

    def encode(self, text: str, extends: str | None = None) -> TokenArray:
        """The ids of ``text`` (read-only int32), equal to one whole encode of it. ``extends``: a text ``text`` is
        known to start with, by construction (``ChatRenderer.extended``): its cached ids are found without comparing
        texts."""
        if not text:
            return np.empty(0, dtype=TOKEN_DTYPE)
        if self._rules.added_tokens is None or self._whole:
            ids, _ = self._encoder.encode_pieces([text])
            self._count(int(ids.size))
            return _read_only(ids)
        reuse = None
        if self._cache is not None:
            reuse = self._found_for(text, extends)
            self._cache.taken(reuse)
        start = reuse.chars if reuse is not None else 0
        ends = self._rules.ends_of_added_tokens(text, start)
        new_ids, tokens_at = self._encode_from(text, start, ends)
        self._count(int(new_ids.size))
        ids = new_ids if reuse is None else np.concatenate((reuse.ids, new_ids))
        if self._cache is not None and ends and tokens_at is not None:
            self._remember(text, ids, reuse, ends, tokens_at)
        return _read_only(ids)

    def _encode_from(self, text: str, start: int, ends: list[int]) -> tuple[TokenArray, Cuts | None]:
        """The ids of ``text[start:]`` (``start`` is a cut) and how many of them precede each cut in ``ends``."""
        if start == len(text):
            return np.empty(0, TOKEN_DTYPE), None
        if len(text) - start <= ONE_CALL_MAX_CHARS:
            # The pieces' ids one after another are the whole stretch's (the cuts are exact), and each added-token
            # match is one added id: if the ids hold no more added ids than ``ends`` has matches (BPE made none),
            # the k-th added id ends the k-th match.
            new_ids, _ = self._encoder.encode_pieces([text[start:]])
            after_added = np.flatnonzero(self._is_added[new_ids]) + 1
            if after_added.size == len(ends):
                return new_ids, after_added.astype(np.int64)
        pieces, cut_pieces = self._pieces(text, start, ends)
        if not pieces:
            return np.empty(0, TOKEN_DTYPE), None
        new_ids, offsets = self._encoder.encode_pieces(pieces)
        return new_ids, offsets[np.asarray(cut_pieces, dtype=np.int64) + 1].astype(np.int64)

    def new_chars(self, text: str, extends: str | None = None) -> int:
        """How much of ``text`` an ``encode`` now would encode (the rest is cached): what decides whether encoding it
        is worth a thread hop. A look-up only, no encoding."""
        if self._cache is None:
            return len(text)
        reuse = self._cache.find(text, extends)
        self._last_found = (text, reuse)  # the encode that usually follows looks it up no second time
        return len(text) - (reuse.chars if reuse is not None else 0)

    def _found_for(self, text: str, extends: str | None) -> Reuse | None:
        last = self._last_found
        if last is not None and last[0] is text:  # this very string was just looked up (by new_chars)
            self._last_found = None
            return last[1]
        assert self._cache is not None
        return self._cache.find(text, extends)

    def stats(self) -> TokenizeStats:
        with self._lock:
            prompts, encoded = self._prompts, self._encoded
        return TokenizeStats(self._encoder.name, prompts, encoded,
                             self._cache.stats() if self._cache is not None else None)

    def _count(self, encoded: int) -> None:
        with self._lock:
            self._prompts += 1
            self._encoded += encoded

    def _pieces(self, text: str, start: int, ends: list[int]) -> tuple[list[str], list[int]]:
        """``text[start:]`` in pieces: cut after every added token and, when long, before spaces too. Returns the
        pieces and the indices of those that end right after an added token (the cuts the cache keeps)."""
        bounds = [start, *ends]
        if bounds[-1] != len(text):
            bounds.append(len(text))
        cut_ends = set(ends)
        split_long = (self._rules.cut_before_spaces and self._threads > 1
                      and len(text) - start >= PARALLEL_MIN_CHARS)
        target = max((len(text) - start) // (self._threads * 4), PARALLEL_MIN_CHARS // 4)
        pieces: list[str] = []
        cut_pieces: list[int] = []
        for left, right in itertools.pairwise(bounds):
            if split_long and right - left > target:
                for sub_left, sub_right in _space_cuts(text, left, right, target):
                    pieces.append(text[sub_left:sub_right])
            else:
                pieces.append(text[left:right])
            if right in cut_ends:
                cut_pieces.append(len(pieces) - 1)
        return pieces, cut_pieces

    def _remember(self, text: str, ids: TokenArray, reuse: Reuse | None, ends: list[int], tokens_at: Cuts) -> None:
        base_tokens = 0 if reuse is None else int(reuse.ids.size)
        char_cuts = np.asarray(ends, dtype=np.int64)
        token_cuts = tokens_at.astype(np.int64) + base_tokens
        if reuse is not None:
            char_cuts = np.concatenate((reuse.char_cuts, char_cuts))
            token_cuts = np.concatenate((reuse.token_cuts, token_cuts))
        kept = _read_only(ids[: int(token_cuts[-1])])
        assert self._cache is not None
        # The view keeps the whole array alive (a completion prompt may run long after its last cut): counted whole.
        self._cache.store(CachedPrompt(text, kept, char_cuts, token_cuts, held_ids_bytes=ids.nbytes),
                          reuse.entry if reuse is not None and reuse.extends else None)


class LazyPromptEncoder:
    """A tokenizer's ``PromptEncoder``, built on the first prompt: the engine core and checkpoint conversion build
    tokenizers too, and never encode a prompt, so they never pay for loading the encoder."""

    def __init__(self, tokenizer: Tokenizer, config: TokenizeConfig | None) -> None:
        self._tokenizer = tokenizer
        self._config = config
        self._encoder: PromptEncoder | None = None
        self._lock = threading.Lock()

    def get(self) -> PromptEncoder:
        encoder = self._encoder
        if encoder is None:
            with self._lock:
                if self._encoder is None:
                    self._encoder = PromptEncoder(self._tokenizer, self._config)
                encoder = self._encoder
        return encoder

    def stats(self) -> TokenizeStats | None:
        """None until the first prompt."""
        return None if self._encoder is None else self._encoder.stats()

    def new_chars(self, text: str, extends: str | None = None) -> int:
        """``PromptEncoder.new_chars``; before the encoder is built, all of ``text`` (so that the first prompt, which
        builds it, ~0.3 s with fastokens' load and probe, does so off the event loop)."""
        encoder = self._encoder
        return len(text) if encoder is None else encoder.new_chars(text, extends)


_SPACE_AFTER_NON_SPACE = re.compile(r"(?<=\S) ")


def _space_cuts(text: str, left: int, right: int, target: int) -> list[tuple[int, int]]:
    """``text[left:right]`` cut before spaces that follow a non-space character, about ``target`` apart."""
    spans: list[tuple[int, int]] = []
    start = left
    while right - start > target:
        found = _SPACE_AFTER_NON_SPACE.search(text, start + target, right)
        if found is None:
            break
        cut = found.start()
        spans.append((start, cut))
        start = cut
    spans.append((start, right))
    return spans


def _read_only(ids: TokenArray) -> TokenArray:
    if ids.flags.writeable:
        ids.setflags(write=False)
    return ids
