from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from workers.engines.reference.tokenizer import (
    ChatTemplateError,
    GGUFTokenizer,
    IncrementalDetokenizer,
    TokenizerError,
)

if TYPE_CHECKING:
    from tests.workers.engines.reference.conftest import Engine

TRICKY = [
    "Hello world",
    "  leading and trailing spaces  ",
    "tabs\tand\nnewlines\r\n\n\n",
    "naïve café — “quotes” ½ ∑",
    "emoji 😀👍🏽 family 👨‍👩‍👧 flag 🇫🇷",
    "中文字符 and 日本語 and 한국어",
    "numbers 1234567890 3.14159",
    "",
    "<|im_start|>user\nhi<|im_end|>",
]


def _stream(tok: GGUFTokenizer, ids: list[int], chunk: int, skip: bool = True) -> list[str]:
    detok = IncrementalDetokenizer(tok, skip_special_tokens=skip)
    deltas = [detok.add(ids[i : i + chunk]) for i in range(0, len(ids), chunk)]
    deltas.append(detok.flush())
    return deltas


@pytest.mark.parametrize("text", TRICKY)
def test_tiny_round_trip(tiny: Engine, text: str) -> None:
    ids = tiny.tokenizer.encode(text)
    assert ids.dtype == np.int32
    assert tiny.tokenizer.decode(ids, skip_special_tokens=False) == text


@settings(max_examples=60)
@given(text=st.text(max_size=40))
def test_tiny_round_trip_any_text(tiny: Engine, text: str) -> None:
    assert tiny.tokenizer.decode(tiny.tokenizer.encode(text), skip_special_tokens=False) == text


@pytest.mark.parametrize("text", TRICKY)
def test_tiny_token_bytes_are_each_tokens_own_bytes(tiny: Engine, text: str) -> None:
    tok = tiny.tokenizer
    ids = tok.encode(text).tolist()
    # Token by token, the bytes add up to the text (control tokens add nothing, as decode skips them), also
    # where a token holds only part of a character and its own text is U+FFFD.
    assert b"".join(tok.token_bytes(t) for t in ids) == tok.decode(ids).encode()
    if any(ord(c) > 127 for c in text):
        partial = [t for t in ids if tok.decode([t]) == "\ufffd"]
        assert partial and all(tok.token_bytes(t) != "\ufffd".encode() for t in partial)


def test_tiny_merges_digits_and_specials(tiny: Engine) -> None:
    tok = tiny.tokenizer
    meta = tiny.loaded.tokenizer
    assert len(tok.encode("Hello")) == 1 and meta.tokens[int(tok.encode("Hello")[0])] == "Hello"
    assert [meta.tokens[i] for i in tok.encode(" the")] == ["Ġthe"]
    assert len(tok.encode("12345")) == 5  # 'smollm' pre-tokenizer: every digit on its own
    assert tok.encode("<|im_start|>").tolist() == [1]
    assert tok.encode("<|im_end|><|endoftext|>").tolist() == [2, 0]
    ids = tok.encode("<|im_start|>hi<|im_end|>")
    assert tok.decode(ids) == "hi"
    assert tok.decode(ids, skip_special_tokens=False) == "<|im_start|>hi<|im_end|>"
    assert tok.eos_token_ids == frozenset({0, 2}) and tok.special_token_ids == frozenset({0, 1, 2})
    assert tok.vocab_size == tiny.loaded.config.vocab_size
    assert tok.token_text(int(tok.encode(" the")[0])) == " the"


def test_tiny_chat_template(tiny: Engine) -> None:
    tok = tiny.tokenizer
    text = tok.render_chat([{"role": "user", "content": "hi"}])
    assert text == (
        "<|im_start|>system\nYou are a tiny test model.<|im_end|>\n"
        "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    )
    own_system = tok.render_chat(
        [{"role": "system", "content": "S"}, {"role": "user", "content": "u"}], add_generation_prompt=False
    )
    assert own_system == "<|im_start|>system\nS<|im_end|>\n<|im_start|>user\nu<|im_end|>\n"
    assert tok.encode(text)[:1].tolist() == [1]


def test_chat_template_errors(tiny: Engine) -> None:
    meta = tiny.loaded.tokenizer
    with pytest.raises(ChatTemplateError, match=r"no tokenizer\.chat_template"):
        GGUFTokenizer(dataclasses.replace(meta, chat_template=None)).render_chat(
            [{"role": "user", "content": "x"}]
        )
    with pytest.raises(ChatTemplateError, match="does not compile"):
        GGUFTokenizer(dataclasses.replace(meta, chat_template="{% for %}"))
    raising = GGUFTokenizer(
        dataclasses.replace(meta, chat_template="{{ raise_exception('no system role') }}")
    )
    with pytest.raises(ChatTemplateError, match="no system role"):
        raising.render_chat([])
    failing = GGUFTokenizer(dataclasses.replace(meta, chat_template="{{ messages[0]['content'] }}"))
    with pytest.raises(ChatTemplateError, match="failed to render"):
        failing.render_chat([])
    # The sandbox refuses to reach into Python internals from a template shipped in a model file.
    sneaky = GGUFTokenizer(
        dataclasses.replace(meta, chat_template="{{ ''.__class__.__mro__[1].__subclasses__() }}")
    )
    with pytest.raises(ChatTemplateError):
        sneaky.render_chat([])


def test_non_bpe_tokenizer_rejected(tiny: Engine) -> None:
    with pytest.raises(TokenizerError, match="'llama'"):
        GGUFTokenizer(dataclasses.replace(tiny.loaded.tokenizer, model="llama"))


@pytest.mark.parametrize("chunk", [1, 2, 3, 7])
@pytest.mark.parametrize("text", TRICKY)
def test_incremental_detokenizer_matches_decode(tiny: Engine, text: str, chunk: int) -> None:
    ids = tiny.tokenizer.encode(text).tolist()
    deltas = _stream(tiny.tokenizer, ids, chunk)
    assert "".join(deltas) == tiny.tokenizer.decode(ids)
    assert not any("\ufffd" in d for d in deltas)  # partial characters are held back, never emitted


@settings(max_examples=60)
@given(text=st.text(max_size=30), chunk=st.integers(1, 4), skip=st.booleans())
def test_incremental_detokenizer_any_text(tiny: Engine, text: str, chunk: int, skip: bool) -> None:
    ids = tiny.tokenizer.encode(text).tolist()
    deltas = _stream(tiny.tokenizer, ids, chunk, skip)
    assert "".join(deltas) == tiny.tokenizer.decode(ids, skip_special_tokens=skip)


def test_incremental_detokenizer_holds_back_split_character(tiny: Engine) -> None:
    tok = tiny.tokenizer
    ids = tok.encode("a😀").tolist()
    assert len(ids) == 5  # 'a' + the emoji's four bytes, one byte-level token each
    detok = IncrementalDetokenizer(tok)
    assert detok.add(ids[0]) == "a"
    assert [detok.add(i) for i in ids[1:4]] == ["", "", ""]
    assert detok.add(ids[4]) == "😀"
    # A stream that ends mid-character releases the replacement character on flush.
    detok = IncrementalDetokenizer(tok)
    assert detok.add(ids[0]) == "a" and detok.add(ids[1:3]) == ""
    assert detok.flush() == "\ufffd"


def test_incremental_detokenizer_decodes_a_bounded_window(
    tiny: Engine, monkeypatch: pytest.MonkeyPatch
) -> None:
    tok = tiny.tokenizer
    ids = tok.encode("the cat is here and the world is big 😀 " * 20).tolist()
    sizes: list[int] = []
    real_decode = tok.decode

    def spy(window: list[int], skip_special_tokens: bool = True) -> str:
        sizes.append(len(window))
        text: str = real_decode(window, skip_special_tokens)
        return text

    monkeypatch.setattr(tok, "decode", spy)
    detok = IncrementalDetokenizer(tok)
    text = "".join(detok.add(i) for i in ids)
    monkeypatch.undo()
    assert text == tok.decode(ids) and len(ids) > 200
    assert max(sizes) <= 8  # O(window) per step, independent of the output length


@pytest.mark.real_model
def test_real_tokenizer_facts(real: Engine) -> None:
    tok = real.tokenizer
    assert tok.encode("Hello").tolist() == [19556]
    assert tok.encode("<|im_start|>").tolist() == [1]
    assert tok.eos_token_ids == frozenset({0, 2}) and tok.vocab_size == 49152
    prompt = tok.render_chat([{"role": "user", "content": "What is the capital of France?"}])
    assert "You are a helpful AI assistant named SmolLM" in prompt and prompt.endswith(
        "<|im_start|>assistant\n"
    )
    assert len(tok.encode(prompt)) == 37


@pytest.mark.real_model
@pytest.mark.parametrize("text", TRICKY)
def test_real_round_trip(real: Engine, text: str) -> None:
    ids = real.tokenizer.encode(text)
    assert real.tokenizer.decode(ids, skip_special_tokens=False) == text
    assert "".join(_stream(real.tokenizer, ids.tolist(), 1)) == real.tokenizer.decode(ids)
