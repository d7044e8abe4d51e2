"""The tokenizer of a Hugging Face checkpoint folder, read with ``tokenizers`` (no transformers import).

The worker tokenizes, renders the chat template and detokenizes itself, and hands vLLM token ids only, so vLLM
never needs its own tokenizer (the engine starts it with ``skip_tokenizer_init``). The chat template is rendered
in the same sandbox as the reference engine's; ids that end generation come from ``generation_config.json``
(else ``config.json``), the way transformers reads them.
"""

from __future__ import annotations

import dataclasses
import json
import pathlib
from collections.abc import Sequence
from typing import Any

import numpy as np
import numpy.typing as npt
from tokenizers import Tokenizer

from workers.engines.options import TokenizeConfig
from workers.engines.reference.tokenizer import (
    IncrementalDetokenizer,
    compile_chat_template,
    render_chat_template,
    rendered_turns_bytes,
)
from workers.tokenization.prompt_encoder import LazyPromptEncoder, TokenizeStats


class CheckpointError(FileNotFoundError):
    """The folder is not a Hugging Face checkpoint this engine can serve."""


def _read_json(path: pathlib.Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    value = json.loads(path.read_text(encoding="utf-8"))
    return value if isinstance(value, dict) else {}


def _token_text(value: Any) -> str:
    # tokenizer_config.json writes special tokens as a string or as an AddedToken object.
    if isinstance(value, dict):
        return str(value.get("content", ""))
    return "" if value is None else str(value)


def _ids(value: Any) -> set[int]:
    if value is None:
        return set()
    return {int(v) for v in value} if isinstance(value, list) else {int(value)}


class HFTokenizer:
    def __init__(self, folder: pathlib.Path, tokenize: TokenizeConfig | None = None) -> None:
        path = folder / "tokenizer.json"
        if not path.is_file():
            raise CheckpointError(f"{folder} has no tokenizer.json (only fast tokenizers are supported)")
        self._tokenizer = Tokenizer.from_file(str(path))
        config = _read_json(folder / "tokenizer_config.json")
        model_config = _read_json(folder / "config.json")
        generation = _read_json(folder / "generation_config.json")
        template = config.get("chat_template")
        if isinstance(template, list):  # several named templates: the default one serves chat
            template = next((t.get("template") for t in template if t.get("name") == "default"), None)
        self._template = compile_chat_template(template, rendered_turns_bytes(tokenize))
        self.chat_template: str | None = template if isinstance(template, str) else None  # DeclaresChatTemplate
        self._bos_token = _token_text(config.get("bos_token"))
        self._eos_token = _token_text(config.get("eos_token"))
        eos = _ids(generation.get("eos_token_id")) or _ids(model_config.get("eos_token_id"))
        eos_id = self._tokenizer.token_to_id(self._eos_token) if self._eos_token else None
        if eos_id is not None:
            eos.add(eos_id)
        self._eos_ids = frozenset(eos)
        self._vocab_size = int(model_config.get("vocab_size") or self._tokenizer.get_vocab_size())
        self._prompts = LazyPromptEncoder(self._tokenizer, tokenize)

    @property
    def vocab_size(self) -> int:
        return self._vocab_size

    @property
    def eos_token_ids(self) -> frozenset[int]:
        return self._eos_ids

    def encode(self, text: str) -> npt.NDArray[np.int32]:
        # No special tokens added: a chat template writes its own BOS; a raw completion prompt is used as sent.
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

    def decode(self, ids: Sequence[int] | npt.NDArray[np.integer[Any]], skip_special_tokens: bool = True) -> str:
        return self._tokenizer.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)

    def detokenizer(self) -> IncrementalDetokenizer:
        return IncrementalDetokenizer(self)

    def render_chat(self, messages: list[dict[str, str]], add_generation_prompt: bool = True) -> str:
        return render_chat_template(self._template, messages, add_generation_prompt, self._bos_token,
                                    self._eos_token)
