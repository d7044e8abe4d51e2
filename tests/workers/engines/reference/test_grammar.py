"""The engine core's grammar: masks that keep the output valid, states replayed over tokens chosen elsewhere, and a
bounded cache of compiled schemas keyed by the schema text. The tiny model's real byte-level vocab is enough."""

from __future__ import annotations

import numpy as np
import orjson
import pytest

from frontend.tool_parsers import hermes
from tests.workers.engines.reference.conftest import Engine
from workers.engines.reference.grammar import GrammarCompiler, GrammarError

SCHEMA = orjson.dumps({"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
                       "additionalProperties": False}).decode()
EOS = 2


@pytest.fixture
def compiler(tiny: Engine) -> GrammarCompiler:
    return GrammarCompiler(tiny.tokenizer, tiny.loaded.config.vocab_size, capacity=2)


def greedy_under(compiler: GrammarCompiler, schema: str, tiny: Engine, prefer: list[int]) -> list[int]:
    """Walk the grammar choosing, at each step, the allowed token that ranks first in ``prefer`` order."""
    constraint = compiler.constraint(schema)
    rank = np.full(tiny.loaded.config.vocab_size, len(prefer), np.int64)
    rank[prefer] = np.arange(len(prefer))
    out: list[int] = []
    for _ in range(64):
        allowed = constraint.allowed()
        token = int(np.flatnonzero(allowed)[np.argmin(rank[allowed])])
        if token in tiny.tokenizer.eos_token_ids:
            return out
        constraint.advance(token)
        out.append(token)
    raise AssertionError("the grammar never allowed EOS")


def test_the_mask_admits_only_valid_continuations_and_eos_once_complete(compiler: GrammarCompiler,
                                                                        tiny: Engine) -> None:
    constraint = compiler.constraint(SCHEMA)
    allowed = constraint.allowed()
    assert allowed.dtype == np.bool_ and allowed.shape == (tiny.loaded.config.vocab_size,)
    assert not allowed[EOS] and not constraint.complete
    texts = {tiny.tokenizer.token_text(int(t)) for t in np.flatnonzero(allowed)}
    assert texts and all("{".startswith(t) or t.startswith("{") for t in texts)
    for token in tiny.tokenizer.encode('{"ok": true}').tolist():
        constraint.advance(token)
    assert constraint.complete and constraint.allowed()[EOS]


def test_whatever_is_preferred_the_walk_ends_in_valid_json(compiler: GrammarCompiler, tiny: Engine) -> None:
    rng = np.random.default_rng(0)
    for _ in range(3):
        prefer = rng.permutation(tiny.loaded.config.vocab_size).tolist()
        text = tiny.tokenizer.decode(greedy_under(compiler, SCHEMA, tiny, prefer))
        assert set(orjson.loads(text)) == {"ok"}


def test_a_replayed_state_continues_exactly_where_the_first_stopped(compiler: GrammarCompiler,
                                                                    tiny: Engine) -> None:
    first = compiler.constraint(SCHEMA)
    tokens = tiny.tokenizer.encode('{"ok":').tolist()
    for token in tokens:
        first.advance(token)
    second = compiler.constraint(SCHEMA)  # what a GEN worker builds from the request
    second.advance_all(tokens)
    assert np.array_equal(first.allowed(), second.allowed())


def test_a_token_the_grammar_forbids_is_an_error(compiler: GrammarCompiler, tiny: Engine) -> None:
    constraint = compiler.constraint(SCHEMA)
    with pytest.raises(GrammarError, match="not allowed"):
        constraint.advance_all(tiny.tokenizer.encode("hello").tolist())
    with pytest.raises(GrammarError, match="cannot continue"):  # never an empty mask for the sampler
        constraint.allowed()


def test_an_invalid_schema_is_a_grammar_error(compiler: GrammarCompiler) -> None:
    with pytest.raises(GrammarError, match="invalid JSON schema"):
        compiler.constraint('{"type": "nope"}')


def test_the_cache_compiles_a_schema_once_and_stays_bounded(compiler: GrammarCompiler) -> None:
    other = '{"type": "array"}'
    compiler.constraint(SCHEMA)
    compiler.constraint(SCHEMA)
    assert compiler.compilations == 1
    compiler.constraint(other)
    compiler.constraint(SCHEMA)  # most recently used: the next newcomer evicts `other`
    compiler.constraint('{"type": "string"}')
    assert compiler.cached == 2 and compiler.compilations == 3
    compiler.constraint(SCHEMA)
    assert compiler.compilations == 3
    compiler.constraint(other)
    assert compiler.compilations == 4


def test_states_from_one_compiled_schema_are_independent(compiler: GrammarCompiler, tiny: Engine) -> None:
    a, b = compiler.constraint(SCHEMA), compiler.constraint(SCHEMA)
    a.advance_all(tiny.tokenizer.encode('{"ok": ').tolist())
    assert not np.array_equal(a.allowed(), b.allowed())


def test_a_fork_is_an_independent_state_at_the_same_place(compiler: GrammarCompiler, tiny: Engine) -> None:
    # n > 1: every sequence continues its own fork of the state the prompt left.
    original = compiler.constraint(SCHEMA)
    original.advance_all(tiny.tokenizer.encode('{"ok": ').tolist())
    fork = original.fork()
    assert np.array_equal(original.allowed(), fork.allowed())
    original.advance_all(tiny.tokenizer.encode("true}").tolist())
    assert original.complete and not fork.complete
    fork.advance_all(tiny.tokenizer.encode("false}").tolist())
    assert fork.complete


def test_a_lark_grammar_is_compiled_and_cached_apart_from_a_schema(compiler: GrammarCompiler, tiny: Engine) -> None:
    # tool_choice auto's grammar (frontend.tool_parsers.hermes): text, or text then a well-formed call.
    call = {"type": "object", "properties": {"name": {"const": "f"}, "arguments": orjson.loads(SCHEMA)},
            "required": ["name", "arguments"], "additionalProperties": False}
    lark = hermes.grammar([call], parallel=False)

    def accepts(text: str) -> bool:
        constraint = compiler.constraint(lark, lark=True)
        try:
            constraint.advance_all(tiny.tokenizer.encode(text).tolist())
        except GrammarError:
            return False
        return constraint.complete

    assert accepts("Just text, even with a < b in it.")
    assert accepts('Let me see.<tool_call>\n{"name": "f", "arguments": {"ok": true}}\n</tool_call>')
    assert not accepts('<tool_call>\n{"name": "g", "arguments": {"ok": true}}\n</tool_call>')  # no such tool
    assert not accepts('<tool_call>\n{"name": "f", "arguments": {"ok": 1}}\n</tool_call>')  # invalid arguments
    assert not accepts("text that opens <tool_call> and never calls")
    with pytest.raises(GrammarError):
        compiler.constraint("start: (", lark=True)
