"""A byte-level BPE tokenizer rebuilt from GGUF metadata, chat-template rendering and streaming decode."""

from __future__ import annotations

import dataclasses
import pathlib
from collections.abc import Sequence
from typing import Any, Protocol

import jinja2
import numpy as np
import numpy.typing as npt
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

from workers.engines.options import TokenizeConfig
from workers.engines.reference.model_file import TokenizerMetadata
from workers.tokenization.prompt_encoder import LazyPromptEncoder, TokenizeStats
from workers.tokenization.rendered_turns import ChatRenderer

I32Array = npt.NDArray[np.int32]

# GGUF token_type 3 = CONTROL: <|im_start|> and friends, matched whole in text and skippable on decode.
_CONTROL_TOKEN_TYPE = 3
# Pre-tokenizers that split every digit on its own before the GPT-2 byte-level regex.
_DIGIT_SPLITTING_PRE = frozenset({"smollm"})
# Ids that end generation besides the GGUF eos: SmolLM2 stops on <|im_end|> and <|endoftext|>.
_EXTRA_STOP_TOKENS = ("<|endoftext|>", "<|im_end|>")


def _byte_of_character() -> dict[str, int]:
    """GPT-2's byte-level alphabet read backwards: the character a vocabulary entry uses for each byte -> the byte.
    Printable bytes (not the space) are written as the Latin-1 character of the same value; every other byte, in
    byte order, as the next character from U+0100 on."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars = {byte: byte for byte in printable}
    shifted = 256
    for byte in range(256):
        if byte not in chars:
            chars[byte] = shifted
            shifted += 1
    return {chr(char): byte for byte, char in chars.items()}


_BYTE_OF_CHARACTER = _byte_of_character()


class TokenizerError(ValueError):
    """The GGUF tokenizer metadata describes a tokenizer this module cannot build."""


class ChatTemplateError(ValueError):
    """The chat template is missing or failed to render."""


def _raise_exception(message: str) -> None:
    # HF chat templates call raise_exception() to reject malformed conversations.
    raise ChatTemplateError(message)


def compile_chat_template(source: str | None, cache_bytes: int = 0) -> ChatRenderer | None:
    """The template's renderer; ``cache_bytes`` > 0: it keeps conversations' rendered turns, up to that many bytes
    (``workers.tokenization.rendered_turns``)."""
    if source is None:
        return None
    # Same environment settings as HF transformers, so templates written for it render identically;
    # the sandbox keeps a hostile template (it ships inside a model file) away from Python internals.
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.globals["raise_exception"] = _raise_exception
    try:
        return ChatRenderer(env.from_string(source), source, cache_bytes)
    except jinja2.TemplateError as exc:
        raise ChatTemplateError(f"chat template does not compile: {exc}") from exc


def rendered_turns_bytes(tokenize: TokenizeConfig | None) -> int:
    """The rendered-turns cache's bound: half the conversation cache's (``--tokenize-cache-mb``), off with it."""
    return (tokenize or TokenizeConfig()).cache_bytes // 2


def render_chat_template(template: ChatRenderer | None, messages: list[dict[str, str]],
                         add_generation_prompt: bool, bos_token: str, eos_token: str) -> str:
    if template is None:
        raise ChatTemplateError("this model has no chat template")
    try:
        return template.render(messages=messages, add_generation_prompt=add_generation_prompt,
                               bos_token=bos_token, eos_token=eos_token)
    except ChatTemplateError:
        raise
    except Exception as exc:  # a template can fail in many ways (undefined, type errors, sandbox)
        raise ChatTemplateError(f"chat template failed to render: {exc}") from exc


class TokenDecoder(Protocol):
    """What ``IncrementalDetokenizer`` needs of a tokenizer (this module's and the vllm engine's alike)."""

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str: ...


class GGUFTokenizer:
    def __init__(self, meta: TokenizerMetadata, tokenize: TokenizeConfig | None = None) -> None:
        if meta.model != "gpt2":
            raise TokenizerError(
                f"tokenizer model {meta.model!r} is not supported (only byte-level BPE 'gpt2')"
            )
        vocab = {tok: i for i, tok in enumerate(meta.tokens)}
        merges = []
        for merge in meta.merges:
            left, sep, right = merge.partition(" ")
            if not sep:
                raise TokenizerError(f"malformed merge {merge!r}")
            merges.append((left, right))
        tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False))
        byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
        if meta.pre in _DIGIT_SPLITTING_PRE:
            tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
                [pre_tokenizers.Digits(individual_digits=True), byte_level]
            )
        else:
            tokenizer.pre_tokenizer = byte_level
        tokenizer.decoder = decoders.ByteLevel()
        specials = [meta.tokens[i] for i, kind in enumerate(meta.token_types) if kind == _CONTROL_TOKEN_TYPE]
        tokenizer.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in specials])
        self._tokenizer = tokenizer
        self._tokens = list(meta.tokens)  # byte-level strings: each token's own bytes, also of a partial character
        self._vocab_size = len(meta.tokens)
        self._special_ids = frozenset(vocab[s] for s in specials)
        stops = {vocab[s] for s in _EXTRA_STOP_TOKENS if s in vocab}
        if meta.eos_token_id is not None:
            stops.add(meta.eos_token_id)
        self._eos_ids = frozenset(stops)
        self._bos_token = meta.tokens[meta.bos_token_id] if meta.bos_token_id is not None else ""
        self._eos_token = meta.tokens[meta.eos_token_id] if meta.eos_token_id is not None else ""
        self._template = compile_chat_template(meta.chat_template, rendered_turns_bytes(tokenize))
        self.chat_template: str | None = meta.chat_template  # its source (``DeclaresChatTemplate``)
        self._prompts = LazyPromptEncoder(tokenizer, tokenize)

    @property
    def vocab_size(self) -> int:
        return self._vocab_size

    @property
    def eos_token_ids(self) -> frozenset[int]:
        return self._eos_ids

    @property
    def special_token_ids(self) -> frozenset[int]:
        return self._special_ids

    def hf_json(self) -> str:
        """The tokenizer as Hugging Face tokenizers JSON (what grammar libraries build their token tables from)."""
        return str(self._tokenizer.to_str())

    def encode(self, text: str) -> I32Array:
        """Token ids for text (read-only); control tokens written in the text become their single ids. A text
        that extends one encoded recently encodes only what it adds (workers/tokenization)."""
        return self._prompts.get().encode(text, self._extended(text))

    def new_chars(self, text: str) -> int:
        """How much of ``text`` ``encode`` would encode now (``workers.engines.base.EncodesIncrementally``)."""
        return self._prompts.new_chars(text, self._extended(text))

    def _extended(self, text: str) -> str | None:
        """The earlier render ``text`` was built on, if it is the chat template's latest (its ids are then found
        without comparing texts)."""
        return self._template.extended(text) if self._template is not None else None

    def tokenize_stats(self) -> TokenizeStats | None:
        stats = self._prompts.stats()
        if stats is None or self._template is None:
            return stats
        return dataclasses.replace(stats, rendered=self._template.stats())

    def decode(
        self, ids: Sequence[int] | npt.NDArray[np.integer[Any]], skip_special_tokens: bool = True
    ) -> str:
        return self._tokenizer.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)

    def token_text(self, token_id: int) -> str:
        """Decoded text of one token (may be a partial UTF-8 character, shown as U+FFFD)."""
        return self._tokenizer.decode([int(token_id)], skip_special_tokens=False)

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes one token adds to the output (``workers.engines.base.ProvidesTokenBytes``): read from its
        byte-level vocabulary entry, so a token that is only part of a UTF-8 character gives its own bytes, where
        ``decode`` can only give U+FFFD. A control token adds nothing (``decode`` skips it)."""
        if token_id in self._special_ids or not 0 <= token_id < self._vocab_size:
            return b""
        byte_of = _BYTE_OF_CHARACTER
        # A character outside the alphabet (a user-defined token written as plain text) stands for itself.
        return b"".join(bytes((byte_of[c],)) if c in byte_of else c.encode() for c in self._tokens[token_id])

    def detokenizer(self) -> IncrementalDetokenizer:
        return IncrementalDetokenizer(self)

    def save(self, path: pathlib.Path) -> None:
        """Write the tokenizer as a Hugging Face ``tokenizer.json`` (the vllm engine's converted checkpoint)."""
        self._tokenizer.save(str(path))

    def render_chat(self, messages: list[dict[str, str]], add_generation_prompt: bool = True) -> str:
        if self._template is None:
            raise ChatTemplateError("this model file has no tokenizer.chat_template")
        return render_chat_template(self._template, messages, add_generation_prompt, self._bos_token,
                                    self._eos_token)


class IncrementalDetokenizer:
    """Turns a stream of token ids into text deltas.

    Each step decodes only a short window: the tokens since the last emitted boundary plus a few
    tokens of left context (byte-level decoding of a token can depend on its neighbours only
    through incomplete UTF-8 sequences). Text ending in U+FFFD is held back until the character's
    remaining bytes arrive; `flush` releases whatever is left at the end of the stream.
    """

    _CONTEXT_TOKENS = 4

    def __init__(self, tokenizer: TokenDecoder, skip_special_tokens: bool = True) -> None:
        self._tokenizer = tokenizer
        self._skip = skip_special_tokens
        self._ids: list[int] = []
        self._prefix_offset = 0  # window start (left context)
        self._read_offset = 0  # everything before this has been emitted

    @property
    def token_ids(self) -> tuple[int, ...]:
        return tuple(self._ids)

    def _decode(self, ids: Sequence[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=self._skip)

    def add(self, token_ids: int | Sequence[int]) -> str:
        """Record one or more new tokens; returns the newly completed text (possibly empty)."""
        if isinstance(token_ids, int | np.integer):
            self._ids.append(int(token_ids))
        else:
            self._ids.extend(int(t) for t in token_ids)
        prefix_text = self._decode(self._ids[self._prefix_offset : self._read_offset])
        full_text = self._decode(self._ids[self._prefix_offset :])
        if len(full_text) <= len(prefix_text) or full_text.endswith("\ufffd"):
            return ""
        self._prefix_offset = max(self._read_offset, len(self._ids) - self._CONTEXT_TOKENS)
        self._read_offset = len(self._ids)
        return full_text[len(prefix_text) :]

    def flush(self) -> str:
        """Text still held back (an incomplete character at the end of the stream), emitted as-is."""
        prefix_text = self._decode(self._ids[self._prefix_offset : self._read_offset])
        full_text = self._decode(self._ids[self._prefix_offset :])
        self._prefix_offset = self._read_offset = len(self._ids)
        return full_text[len(prefix_text) :]
