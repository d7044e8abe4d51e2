"""Constrained decoding in the engine core: a JSON schema (or a grammar in llguidance's Lark syntax) becomes a
per-step mask of the tokens that keep the output valid, computed by llguidance over this model's tokenizer
(docs/engines.md says why llguidance).

A request gets a ``deep_copy`` of a cached compiled matcher, which shares its lexer and parser tables; the cache is
bounded and keyed by the schema's compact JSON text (or the grammar's text). The llguidance tokenizer is built on
the first grammar request."""

from __future__ import annotations

import collections
import threading
from collections.abc import Iterable

import llguidance
import llguidance.numpy
import numpy as np
import numpy.typing as npt

from frontend.structured_output import json_grammar
from workers.engines.reference.tokenizer import GGUFTokenizer

BoolArray = npt.NDArray[np.bool_]

# Distinct schemas kept compiled; a compiled JSON schema is small (tens of KB), but clients can send many.
DEFAULT_CACHE_SIZE = 64


class GrammarError(ValueError):
    """A schema that does not compile, or output tokens the grammar does not allow."""


class TokenConstraint:
    """One request's grammar state: which tokens may come next, advanced token by token."""

    def __init__(self, matcher: llguidance.LLMatcher, vocab_size: int) -> None:
        self._matcher = matcher
        self._vocab_size = vocab_size
        self._bitmask = llguidance.numpy.allocate_token_bitmask(1, vocab_size)

    def allowed(self) -> BoolArray:
        """A boolean mask over the vocabulary: True where the token keeps the output valid (EOS once complete)."""
        if self._matcher.is_error():
            # An empty mask would leave the sampler nothing but -inf: fail the request instead.
            raise GrammarError(f"the grammar cannot continue: {self._matcher.get_error()}")
        llguidance.numpy.fill_next_token_bitmask(self._matcher, self._bitmask)
        bits = np.unpackbits(self._bitmask[0].view(np.uint8), bitorder="little")[: self._vocab_size]
        return bits.view(np.bool_)

    def advance(self, token_id: int) -> None:
        if not self._matcher.consume_token(token_id):
            raise GrammarError(f"token {token_id} is not allowed by the grammar: {self._matcher.get_error()}")

    def advance_all(self, token_ids: Iterable[int]) -> None:
        """Replay output chosen elsewhere (the CTX worker's first token) so this state continues after it."""
        for token_id in token_ids:
            self.advance(token_id)

    def fork(self) -> TokenConstraint:
        """An independent copy of this state: one per sequence of a request for n > 1."""
        return TokenConstraint(self._matcher.deep_copy(), self._vocab_size)

    @property
    def complete(self) -> bool:
        """The output so far is a whole valid document."""
        return bool(self._matcher.is_accepting())


class GrammarCompiler:
    """Compiles JSON schemas for one tokenizer and hands out fresh ``TokenConstraint`` states."""

    def __init__(self, tokenizer: GGUFTokenizer, vocab_size: int, capacity: int = DEFAULT_CACHE_SIZE) -> None:
        self._hf_tokenizer = tokenizer
        self._vocab_size = vocab_size
        self._capacity = capacity
        self._ll_tokenizer: llguidance.LLTokenizer | None = None
        self._compiled: collections.OrderedDict[str, llguidance.LLMatcher] = collections.OrderedDict()
        self._lock = threading.Lock()  # the scheduler thread compiles; a stats reader may look at the cache
        self.compilations = 0

    def _tokenizer(self) -> llguidance.LLTokenizer:
        if self._ll_tokenizer is None:
            self._ll_tokenizer = llguidance.LLTokenizer(
                self._hf_tokenizer.hf_json(), n_vocab=self._vocab_size,
                eos_token=sorted(self._hf_tokenizer.eos_token_ids),
            )
        return self._ll_tokenizer

    def constraint(self, text: str, lark: bool = False) -> TokenConstraint:
        """A fresh state of the JSON schema ``text`` (or, ``lark``, of the Lark grammar ``text``)."""
        key = ("lark:" if lark else "json:") + text
        with self._lock:
            compiled = self._compiled.get(key)
            if compiled is None:
                compiled = self._compile(text, lark)
                self._compiled[key] = compiled
                while len(self._compiled) > self._capacity:
                    self._compiled.popitem(last=False)
            else:
                self._compiled.move_to_end(key)
            return TokenConstraint(compiled.deep_copy(), self._vocab_size)

    def _compile(self, text: str, lark: bool) -> llguidance.LLMatcher:
        what = "grammar" if lark else "JSON schema"
        try:
            grammar = llguidance.LLMatcher.grammar_from_lark(text) if lark else json_grammar(text)
        except ValueError as exc:
            raise GrammarError(f"invalid {what}: {exc}") from exc
        matcher = llguidance.LLMatcher(self._tokenizer(), grammar, log_level=0)
        if matcher.is_error():
            raise GrammarError(f"invalid {what}: {matcher.get_error()}")
        self.compilations += 1
        return matcher

    @property
    def cached(self) -> int:
        return len(self._compiled)
