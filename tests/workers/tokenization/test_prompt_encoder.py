"""The prompt encoder's ids equal one whole ``tokenizers`` encode, turn after turn, for every tokenizer we ship or test.

The property: a conversation grows turn by turn through one encoder (so its cache serves every follow-up), with
rewrites of earlier turns and regenerated answers mixed in, and every prompt's ids equal a fresh whole encode of
the same rendered text by Hugging Face ``tokenizers``."""

from __future__ import annotations

import json
import logging
import os
import pathlib
from collections.abc import Callable

import numpy as np
import pytest
from gguf import GGUFReader
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer

from tests.workers.engines.reference.tiny_model import write_tiny_model
from workers.engines.options import TokenizeConfig
from workers.engines.reference.model_file import _read_tokenizer, default_model_path
from workers.engines.reference.tokenizer import GGUFTokenizer, compile_chat_template, render_chat_template
from workers.engines.vllm.tokenizer import HFTokenizer
from workers.tokenization import prompt_encoder as prompt_encoder_module
from workers.tokenization.prompt_encoder import PARALLEL_MIN_CHARS, PromptEncoder

# Pieces of message text: words, digits, scripts, emoji, whitespace runs, code, tool calls, long runs without
# spaces, and text that spells (or almost spells) a special token.
FRAGMENTS = [
    "the", "model", " serves", "tokens", "at long prompts", "κόσμε", "日本語のテキスト", "한국어", "🙂", "👩‍👩‍👧",
    "🇫🇷", "1234567890", "3.14159", "2026-12-07", "  ", "\n", "\n\n", "\t", "   \n  ", "don't", "I'll", "foo_bar()",
    "if x == 1:\n    return x", '{"name": "get_weather", "arguments": {"city": "Paris"}}',
    "<tool_call>", "</tool_call>", "a" * 300, "x1y2z3" * 40, "<|im_end|>", "<|im_start|>", "<|endoftext|>",
    "<|im_", "im_end|>", "<", ">", "<<|im_start|>>", "naïve café", "½ ∑ —",
    "\u00a0", "a\u00a0b", "\u3000", "\r\n", "\u0085", "\u2028", " " * 40, "\t\n \n\t",
]
ROLES = ["user", "assistant", "system", "tool"]

message_text = st.lists(st.sampled_from(FRAGMENTS), min_size=0, max_size=12).map(" ".join)
messages = st.lists(st.tuples(st.sampled_from(ROLES), message_text), min_size=1, max_size=8)
# What a client does next: add a turn, rewrite an earlier one, or regenerate (replace the last answer).
edits = st.lists(st.tuples(st.sampled_from(["append", "rewrite", "regenerate"]), message_text,
                           st.integers(min_value=0, max_value=20)), min_size=1, max_size=6)

Render = Callable[[list[dict[str, str]]], str]


def _reference() -> GGUFTokenizer:
    return GGUFTokenizer(_read_tokenizer(GGUFReader(default_model_path())))


@pytest.fixture(scope="module")
def reference() -> GGUFTokenizer:
    return _reference()


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> GGUFTokenizer:
    path = write_tiny_model(tmp_path_factory.mktemp("tiny") / "tiny.gguf", seed=0)
    return GGUFTokenizer(_read_tokenizer(GGUFReader(path)))


@pytest.fixture(scope="module")
def hf_checkpoint(tmp_path_factory: pytest.TempPathFactory, reference: GGUFTokenizer) -> HFTokenizer:
    """The vllm engine's tokenizer, as it reads a checkpoint folder (the reference model converted)."""
    folder = tmp_path_factory.mktemp("checkpoint")
    reference.save(folder / "tokenizer.json")
    template = GGUFReader(default_model_path()).get_field("tokenizer.chat_template")
    assert template is not None
    (folder / "tokenizer_config.json").write_text(json.dumps({
        "chat_template": template.contents(), "bos_token": "<|im_start|>", "eos_token": "<|im_end|>"}))
    return HFTokenizer(folder)


def _whole(tokenizer: Tokenizer, text: str) -> list[int]:
    return list(tokenizer.encode(text, add_special_tokens=False).ids)


def _apply(conversation: list[dict[str, str]], edit: tuple[str, str, int]) -> list[dict[str, str]]:
    kind, text, where = edit
    if kind == "append" or not conversation:
        role = "user" if not conversation or conversation[-1]["role"] != "user" else "assistant"
        return [*conversation, {"role": role, "content": text}]
    if kind == "rewrite":
        index = where % len(conversation)
        return [*conversation[:index], {**conversation[index], "content": text}, *conversation[index + 1:]]
    return [*conversation[:-1], {"role": conversation[-1]["role"], "content": text}]


def _check_conversation(encoder: PromptEncoder, hf: Tokenizer, render: Render,
                        start: list[tuple[str, str]], steps: list[tuple[str, str, int]]) -> None:
    conversation = [{"role": role, "content": text} for role, text in start]
    for step in [None, *steps]:
        if step is not None:
            conversation = _apply(conversation, step)
        text = render(conversation)
        ids = encoder.encode(text)
        assert ids.dtype == np.int32 and not ids.flags.writeable
        assert ids.tolist() == _whole(hf, text), text


# 40 conversations of up to 7 prompts each per test: ~15 s each here, a fraction of the suite.
PROPERTY = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


@pytest.mark.parametrize("one_call", [True, False], ids=["one_call", "pieces"])
@pytest.mark.parametrize("tokenizer", ["reference", "hf_checkpoint", "tiny"])
@PROPERTY
@given(start=messages, steps=edits)
def test_every_shipped_or_tested_tokenizer_turn_after_turn(
        tokenizer: str, one_call: bool, request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch,
        start: list[tuple[str, str]], steps: list[tuple[str, str, int]]) -> None:
    """The reference model's tokenizer, the vllm engine's (the same model as a checkpoint folder, read by
    HFTokenizer) and the tiny test model's; what a turn adds encoded in one call (its cuts read from the added ids)
    and piece by piece."""
    monkeypatch.setattr(prompt_encoder_module, "ONE_CALL_MAX_CHARS", 1 << 20 if one_call else -1)
    chosen: GGUFTokenizer | HFTokenizer = request.getfixturevalue(tokenizer)
    encoder = PromptEncoder(chosen._tokenizer, TokenizeConfig(cache_bytes=1 << 20))
    _check_conversation(encoder, chosen._tokenizer, chosen.render_chat, start, steps)


@PROPERTY
@given(start=messages, steps=edits)
def test_pieces_cut_before_spaces_for_threads_turn_after_turn(
        reference: GGUFTokenizer, monkeypatch: pytest.MonkeyPatch, start: list[tuple[str, str]],
        steps: list[tuple[str, str, int]]) -> None:
    """The cuts a long new prompt gets for the encoder's threads, on short random texts: every piece boundary the
    rule allows is tried, not only the few a 32k-character prompt has."""
    monkeypatch.setattr(prompt_encoder_module, "PARALLEL_MIN_CHARS", 8)
    encoder = PromptEncoder(reference._tokenizer, TokenizeConfig(cache_bytes=1 << 20, threads=8))
    _check_conversation(encoder, reference._tokenizer, reference.render_chat, start, steps)


@pytest.mark.parametrize("tokenizer", ["reference", "hf_checkpoint"])
@PROPERTY
@given(start=messages, steps=edits)
def test_the_tokenizers_own_path_turn_after_turn(
        tokenizer: str, request: pytest.FixtureRequest, start: list[tuple[str, str]],
        steps: list[tuple[str, str, int]]) -> None:
    """As a worker serves a chat: the template rendered through its rendered-turns cache, the text's ids found
    from the render it was built on; the text is the whole render's and the ids one whole encode's."""
    chosen: GGUFTokenizer | HFTokenizer = request.getfixturevalue(tokenizer)
    assert chosen._template is not None and chosen._template._shape is not None
    whole_template = compile_chat_template(_reference_template(), 0)
    conversation = [{"role": role, "content": text} for role, text in start]
    for step in [None, *steps]:
        if step is not None:
            conversation = _apply(conversation, step)
        fresh = [dict(message) for message in conversation]
        text = chosen.render_chat(fresh)
        assert text == render_chat_template(whole_template, conversation, True, chosen._bos_token,
                                            chosen._eos_token)
        chosen.new_chars(text)
        assert chosen.encode(text).tolist() == _whole(chosen._tokenizer, text)


def _reference_template() -> str:
    field = GGUFReader(default_model_path()).get_field("tokenizer.chat_template")
    assert field is not None
    return str(field.contents())


# A template that renders an earlier turn differently once later turns exist (it marks only the latest user turn):
# the cache must then reuse less, never give different ids.
SHIFTING_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
    "{% if loop.index == messages|length and m['role'] == 'user' %}[latest] {% endif %}"
    "{{ m['content'] }}<|im_end|>\n{% endfor %}<|im_start|>assistant\n"
)


@PROPERTY
@given(start=messages, steps=edits)
def test_a_template_that_rewrites_earlier_turns_costs_reuse_not_exactness(
        reference: GGUFTokenizer, start: list[tuple[str, str]], steps: list[tuple[str, str, int]]) -> None:
    template = compile_chat_template(SHIFTING_TEMPLATE)
    encoder = PromptEncoder(reference._tokenizer, TokenizeConfig(cache_bytes=1 << 20))
    _check_conversation(encoder, reference._tokenizer,
                        lambda conversation: render_chat_template(template, conversation, True, "", ""),
                        start, steps)


def _long_conversation(turns: int, words_per_turn: int) -> list[dict[str, str]]:
    rng = np.random.default_rng(7)
    conversation = [{"role": "system", "content": "You are a careful assistant."}]
    for turn in range(turns):
        chosen = rng.choice(len(FRAGMENTS), size=words_per_turn)
        conversation.append({"role": "user" if turn % 2 == 0 else "assistant",
                             "content": " ".join(FRAGMENTS[i] for i in chosen)})
    return conversation


def test_a_long_new_prompt_cut_before_spaces_for_threads_is_exact(reference: GGUFTokenizer) -> None:
    encoder = PromptEncoder(reference._tokenizer, TokenizeConfig(cache_bytes=0, threads=4))
    text = reference.render_chat(_long_conversation(6, 6_000))
    pieces, _ = encoder._pieces(text, 0, encoder._rules.ends_of_added_tokens(text))
    assert len(text) > PARALLEL_MIN_CHARS and len(pieces) > 16  # cut inside turns, not only between them
    assert encoder.encode(text).tolist() == _whole(reference._tokenizer, text)


def test_a_follow_up_turn_encodes_only_what_it_adds(reference: GGUFTokenizer,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    encoder = PromptEncoder(reference._tokenizer, TokenizeConfig())
    conversation = _long_conversation(20, 400)
    first = reference.render_chat(conversation)
    first_ids = encoder.encode(first)
    encoded: list[int] = []
    original = encoder._encoder.encode_pieces

    def counting(pieces: list[str]) -> object:
        encoded.append(sum(len(p) for p in pieces))
        return original(pieces)

    monkeypatch.setattr(encoder._encoder, "encode_pieces", counting)
    follow_up = reference.render_chat([*conversation, {"role": "assistant", "content": "Sure."},
                                       {"role": "user", "content": "And then?"}])
    ids = encoder.encode(follow_up)
    assert ids.tolist() == _whole(reference._tokenizer, follow_up)
    assert sum(encoded) < 100  # the new turns and the generation prompt, not the 20 turns before them
    stats = encoder.stats()
    assert stats.cache is not None and stats.cache.hits == 1 and stats.cache.entries == 1  # the turn replaced it
    assert stats.cache.reused_tokens == first_ids.size - 3  # all but "assistant\n", which follows the last cut


def test_a_text_built_on_a_held_one_finds_its_ids_without_comparing(reference: GGUFTokenizer,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    encoder = PromptEncoder(reference._tokenizer, TokenizeConfig())
    cache = encoder._cache
    assert cache is not None
    first = reference.render_chat(_long_conversation(6, 200))
    encoder.encode(first)
    turn = "Sure.<|im_end|>\n<|im_start|>user\nMore?<|im_end|>\n<|im_start|>assistant\n"
    follow_up = first + turn
    best = cache._best

    def no_comparing(text: str) -> object:
        raise AssertionError("the texts were compared")

    monkeypatch.setattr(cache, "_best", no_comparing)
    assert encoder.encode(follow_up, extends=first).tolist() == _whole(reference._tokenizer, follow_up)
    stats = cache.stats()
    assert stats.hits == 1 and stats.entries == 1  # the follow-up took its entry's place
    monkeypatch.setattr(cache, "_best", best)
    # An equal text that is another object (not what the cache holds) is compared as before: still exact.
    again = follow_up + turn
    assert encoder.encode(again, extends="".join(list(follow_up))).tolist() == _whole(reference._tokenizer, again)
    assert cache.stats().hits == 2


def test_a_turn_whose_ids_hold_an_added_id_no_match_made_is_encoded_piece_by_piece(
        reference: GGUFTokenizer, monkeypatch: pytest.MonkeyPatch) -> None:
    """Were BPE to make an added token's id out of plain text, the added ids would not say where the cuts are: the
    stretch is then encoded piece by piece (here an ordinary word's id is marked as added to stand for that)."""
    encoder = PromptEncoder(reference._tokenizer, TokenizeConfig())
    first = reference.render_chat(_long_conversation(4, 100))
    encoder.encode(first)
    word = int(reference._tokenizer.encode("hello", add_special_tokens=False).ids[0])
    encoder._is_added[word] = True
    calls: list[int] = []
    original = encoder._encoder.encode_pieces

    def counting(pieces: list[str]) -> object:
        calls.append(len(pieces))
        return original(pieces)

    monkeypatch.setattr(encoder._encoder, "encode_pieces", counting)
    follow_up = first + "hello<|im_end|>\n<|im_start|>user\nhello again<|im_end|>\n<|im_start|>assistant\n"
    assert encoder.encode(follow_up).tolist() == _whole(reference._tokenizer, follow_up)
    assert calls[0] == 1 and calls[1] > 1  # one call, refused, then the pieces
    encoder._is_added[word] = False
    again = follow_up + "Sure.<|im_end|>\n<|im_start|>user\nMore?<|im_end|>\n<|im_start|>assistant\n"
    assert encoder.encode(again).tolist() == _whole(reference._tokenizer, again)  # the cuts kept were right
    assert calls[2:] == [1]


def test_the_cache_stays_within_its_bytes_least_recently_used_out_first(reference: GGUFTokenizer) -> None:
    encoder = PromptEncoder(reference._tokenizer, TokenizeConfig(cache_bytes=200_000))
    texts = [reference.render_chat([{"role": "user", "content": f"conversation {i} " + "word " * 4000}])
             for i in range(6)]
    for text in texts:
        encoder.encode(text)
    stats = encoder.stats().cache
    assert stats is not None and stats.bytes <= 200_000 and stats.evictions > 0

    def reused_by(text: str) -> int:
        before = encoder.stats().cache.reused_tokens  # type: ignore[union-attr]
        encoder.encode(text)
        return encoder.stats().cache.reused_tokens - before  # type: ignore[union-attr]

    assert reused_by(texts[-1] + "more") > 4000  # the newest is still held whole
    assert reused_by(texts[0] + "more") < 100  # of the oldest, only the system prompt all of them share


def test_off_means_no_cache_and_still_exact(reference: GGUFTokenizer) -> None:
    encoder = PromptEncoder(reference._tokenizer, TokenizeConfig(cache_bytes=0))
    text = reference.render_chat(_long_conversation(4, 50))
    assert encoder.encode(text).tolist() == encoder.encode(text).tolist() == _whole(reference._tokenizer, text)
    assert encoder.stats().cache is None


def test_fastokens_builds_no_python_list_of_ids(reference: GGUFTokenizer, monkeypatch: pytest.MonkeyPatch) -> None:
    encoder = PromptEncoder(reference._tokenizer, TokenizeConfig(cache_bytes=0))
    assert encoder.encoder_name == "fastokens"

    def no_list(*args: object, **kwargs: object) -> object:
        raise AssertionError("tokenizers was asked for a list of ids")

    monkeypatch.setattr(Tokenizer, "encode", no_list)
    monkeypatch.setattr(Tokenizer, "encode_batch", no_list)
    ids = encoder.encode("Hello, world! " * 100 + "<|im_end|>")
    assert ids.size > 0 and isinstance(ids.base, bytes | np.ndarray)


def test_a_tokenizer_fastokens_cannot_load_keeps_tokenizers_and_says_so(
        reference: GGUFTokenizer, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    import fastokens

    def refuse(*args: object, **kwargs: object) -> object:
        raise ValueError("unsupported component")

    monkeypatch.setattr(fastokens.Tokenizer, "from_json_str", refuse)
    with caplog.at_level(logging.WARNING, logger="disagg_serve.tokenization"):
        encoder = PromptEncoder(reference._tokenizer, TokenizeConfig())
    assert encoder.encoder_name == "tokenizers"
    assert [r.getMessage() for r in caplog.records if "fastokens cannot load" in r.getMessage()]
    text = reference.render_chat(_long_conversation(3, 40))
    assert encoder.encode(text).tolist() == _whole(reference._tokenizer, text)


def test_the_tokenizers_backend_is_the_baseline_one_whole_encode(reference: GGUFTokenizer,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    encoder = PromptEncoder(reference._tokenizer, TokenizeConfig(backend="tokenizers"))
    assert encoder.encoder_name == "tokenizers" and encoder.stats().cache is None
    calls: list[list[str]] = []
    original = encoder._encoder.encode_pieces

    def recording(pieces: list[str]) -> object:
        calls.append(list(pieces))
        return original(pieces)

    monkeypatch.setattr(encoder._encoder, "encode_pieces", recording)
    text = reference.render_chat(_long_conversation(6, 40))
    assert encoder.encode(text).tolist() == _whole(reference._tokenizer, text)
    assert calls == [[text]]  # the whole prompt in one call, as vLLM's server encodes it


def _with_added_token_flags(tokenizer: Tokenizer, tmp_path: pathlib.Path, **flags: object) -> Tokenizer:
    spec = json.loads(tokenizer.to_str())
    for token in spec["added_tokens"]:
        token.update(flags)
    path = tmp_path / "tokenizer.json"
    path.write_text(json.dumps(spec))
    return Tokenizer.from_file(str(path))


@pytest.mark.parametrize("flags", [{"rstrip": True}, {"lstrip": True}, {"single_word": True}])
def test_added_tokens_that_absorb_neighbours_are_never_cut_after(
        reference: GGUFTokenizer, tmp_path: pathlib.Path, flags: dict[str, object],
        caplog: pytest.LogCaptureFixture) -> None:
    tokenizer = _with_added_token_flags(reference._tokenizer, tmp_path, **flags)
    with caplog.at_level(logging.WARNING, logger="disagg_serve.tokenization"):
        encoder = PromptEncoder(tokenizer, TokenizeConfig())
    assert encoder.stats().cache is None
    assert [r for r in caplog.records if "encoded whole" in r.getMessage()]
    conversation = _long_conversation(4, 60)
    for end in range(1, len(conversation) + 1):
        text = reference.render_chat(conversation[:end]) + "  <|im_end|>  x"
        assert encoder.encode(text).tolist() == _whole(tokenizer, text)


def test_a_first_piece_pre_tokenizer_is_never_cut(tmp_path: pathlib.Path, reference: GGUFTokenizer) -> None:
    spec = json.loads(reference._tokenizer.to_str())
    spec["pre_tokenizer"] = {"type": "Metaspace", "replacement": "▁", "prepend_scheme": "first", "split": True}
    path = tmp_path / "tokenizer.json"
    path.write_text(json.dumps(spec))
    encoder = PromptEncoder(Tokenizer.from_file(str(path)), TokenizeConfig())
    assert encoder.stats().cache is None
    assert any("Metaspace" in r for r in encoder._rules.refusals)


def test_encoder_threads_follow_the_host(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1, 2})
    assert prompt_encoder_module.host_threads() == 3


def test_a_prompt_fastokens_refuses_is_encoded_by_tokenizers(reference: GGUFTokenizer,
                                                             caplog: pytest.LogCaptureFixture) -> None:
    """fastokens' regex engine gives up on a run of a million whitespace characters (a backtracking limit); the
    prompt still gets tokenizers' ids, not an error."""
    encoder = PromptEncoder(reference._tokenizer, TokenizeConfig())
    text = reference.render_chat([{"role": "user", "content": "look:" + " \n\t\u00a0" * 250_000 + "done"}])
    with caplog.at_level(logging.WARNING, logger="disagg_serve.tokenization"):
        ids = encoder.encode(text)
    assert ids.tolist() == _whole(reference._tokenizer, text)


def test_truncation_or_padding_in_the_tokenizer_means_no_cuts(reference: GGUFTokenizer,
                                                            tmp_path: pathlib.Path) -> None:
    """Applied to each piece, a saved truncation would cut inside the prompt and padding would pad inside it: such a
    tokenizer is encoded whole, as it always was."""
    for setting in ({"truncation": {"max_length": 16, "stride": 0, "strategy": "LongestFirst",
                                    "direction": "Right"}},
                    {"padding": {"strategy": {"Fixed": 64}, "direction": "Right", "pad_to_multiple_of": None,
                                 "pad_id": 0, "pad_type_id": 0, "pad_token": "<|endoftext|>"}}):
        spec = {**json.loads(reference._tokenizer.to_str()), **setting}
        path = tmp_path / "tokenizer.json"
        path.write_text(json.dumps(spec))
        tokenizer = Tokenizer.from_file(str(path))
        encoder = PromptEncoder(tokenizer, TokenizeConfig())
        assert encoder.stats().cache is None, setting
        text = reference.render_chat(_long_conversation(4, 30))
        assert encoder.encode(text).tolist() == _whole(tokenizer, text), setting


def test_the_caches_byte_count_is_what_its_entries_hold(reference: GGUFTokenizer) -> None:
    """Each entry's size is counted once, when stored, and taken off as counted: a text whose UTF-8 form was asked
    for later (tokenizers does) grows, and the count must not drift below what is held."""
    encoder = PromptEncoder(reference._tokenizer, TokenizeConfig(cache_bytes=300_000))
    for i in range(40):
        text = reference.render_chat([{"role": "user", "content": f"κόσμε {i} " + "mot " * (200 * (i % 7))}])
        encoder.encode(text)
        _whole(reference._tokenizer, text)  # asks the str for its UTF-8 form
    cache = encoder._cache
    assert cache is not None
    stats = cache.stats()
    assert stats.evictions > 0 and stats.bytes == sum(entry.nbytes for entry in cache._entries) <= 300_000
