"""Hermes' tagged calls read out of an answer, streamed in pieces of any size as whole."""

from __future__ import annotations

import pytest

from frontend.tool_parsers.base import ArgumentsPiece, CallOpened, ParsedAnswer, ParsedCall, TextPiece, parse_whole
from frontend.tool_parsers.hermes import HermesParser
from tests.frontend.tool_parsers.reading import read, summary

TWO_CALLS = ('Let me check.\n<tool_call>\n{"name": "weather", "arguments": {"city": "Paris", "days": [1, {"a": "}"}]}}'
             '\n</tool_call>\n<tool_call>{"name": "time", "arguments": {}}</tool_call>')
WEATHER = ("weather", '{"city": "Paris", "days": [1, {"a": "}"}]}')


@pytest.mark.parametrize("piece", [1, 2, 3, 7, 1000])
def test_text_then_several_calls_in_pieces_of_any_size(piece: int) -> None:
    assert summary(read(HermesParser(parallel=True), TWO_CALLS, piece)) == \
        ("Let me check.", [WEATHER, ("time", "{}")])


def test_the_arguments_stream_as_they_come_not_once_complete() -> None:
    parser = HermesParser(parallel=True)
    assert parser.feed("Hi <tool_c") == [TextPiece("Hi")]  # a possible marker, and the space before it, wait
    assert parser.feed('all>{"name": "f", "argu') == []
    assert parser.feed('ments": {"x"') == [CallOpened(0, "f"), ArgumentsPiece(0, '{"x"')]
    assert parser.feed(": 1") == [ArgumentsPiece(0, ": 1")]
    assert parser.feed("}}</tool_call>") == [ArgumentsPiece(0, "}")]
    assert parser.finish() == [] and not parser.incomplete


def test_one_call_when_parallel_calls_are_off() -> None:
    assert parse_whole(HermesParser(parallel=False), TWO_CALLS) == \
        ParsedAnswer("Let me check.", (ParsedCall(*WEATHER),))


@pytest.mark.parametrize("text", ["plain text", "a < b and <tool_ maybe", "<tool_call> not json",
                                  'x <tool_call>["name"]</tool_call>', "<tool_call>{\"name\": 3, \"arguments\": {}}"])
def test_text_that_holds_no_call_is_text_as_written(text: str) -> None:
    for piece in (1, 4, 100):
        assert summary(read(HermesParser(parallel=True), text, piece)) == (text, [])
    assert parse_whole(HermesParser(parallel=True), text) is None


def test_a_call_written_another_way_is_read_once_whole() -> None:
    parsed = parse_whole(HermesParser(parallel=True), '<tool_call>{"arguments": {"x": 1}, "name": "f"}</tool_call>')
    assert parsed == ParsedAnswer(None, (ParsedCall("f", '{"x":1}'),))
    as_string = '<tool_call>{"name": "f", "arguments": "{\\"x\\": 1}"}</tool_call>'
    assert parse_whole(HermesParser(parallel=True), as_string) == ParsedAnswer(None, (ParsedCall("f", '{"x":1}'),))


def test_an_answer_cut_short_inside_a_call_is_incomplete() -> None:
    parser = HermesParser(parallel=True)
    events = read(parser, '<tool_call>{"name": "f", "arguments": {"x": 1', 3)
    assert parser.incomplete and summary(events) == ("", [("f", '{"x": 1')])
    assert parse_whole(HermesParser(parallel=True), '<tool_call>{"name": "f", "arguments": {"x"') is None


def test_text_after_the_calls_is_not_the_clients() -> None:
    answer = '<tool_call>{"name": "f", "arguments": {}}</tool_call> and then I said more'
    parsed = parse_whole(HermesParser(parallel=True), answer)
    assert parsed == ParsedAnswer(None, (ParsedCall("f", "{}"),))


def test_a_call_right_after_a_tag_with_no_call_is_still_read() -> None:
    text = '<tool_call> <tool_call>{"name": "f", "arguments": {}}</tool_call>'
    for piece in (1, 5, 100):
        assert summary(read(HermesParser(parallel=True), text, piece)) == ("<tool_call> ", [("f", "{}")])


def test_a_tag_with_no_call_after_the_calls_is_dropped_with_the_rest() -> None:
    text = '<tool_call>{"name": "f", "arguments": {}}</tool_call>\n<tool_call> not a call'
    for piece in (1, 4, 100):
        assert summary(read(HermesParser(parallel=True), text, piece)) == ("", [("f", "{}")])
    cut = '<tool_call>{"name": "f", "arguments": {}}</tool_call>\n<tool_call> {"na'
    assert summary(read(HermesParser(parallel=True), cut, 3)) == ("", [("f", "{}")])


@pytest.mark.parametrize("arguments", ['{"a": }', '{"a": [1}}', '{"a": 1,}', '{"a": NaN}'])
def test_arguments_that_are_not_json_are_no_call(arguments: str) -> None:
    """Pieces that went out stay out, but the answer is incomplete (no tool_calls finish); where nothing had gone
    out yet (the call in one piece, or whole), it is the answer's text."""
    text = f'Sure <tool_call>\n{{"name": "f", "arguments": {arguments}}}\n</tool_call>'
    for piece in (1, 3):
        parser = HermesParser(parallel=True)
        read(parser, text, piece)
        assert parser.incomplete
    assert summary(read(HermesParser(parallel=True), text, len(text))) == (text, [])
    assert parse_whole(HermesParser(parallel=True), text) is None


def test_a_name_with_an_escape_json_has_not_is_text() -> None:
    text = '<tool_call>{"name": "\\q", "arguments": {}}</tool_call>'
    for piece in (1, 100):
        assert summary(read(HermesParser(parallel=True), text, piece)) == (text, [])


@pytest.mark.parametrize("arguments", ["null", "3", '"not json"', "[1]"])
def test_arguments_that_are_no_object_are_no_call_streamed_or_whole(arguments: str) -> None:
    """Nothing is announced before the arguments show an object: a stream says what the whole answer says."""
    text = f'x <tool_call>\n{{"name": "f", "arguments": {arguments}}}\n</tool_call>'
    for piece in (1, 3, 1000):
        assert summary(read(HermesParser(parallel=True), text, piece)) == (text, [])
    assert parse_whole(HermesParser(parallel=True), text) is None


def test_a_call_to_a_function_not_among_the_tools_is_text() -> None:
    names = frozenset({"weather", "time"})
    text = 'Hm <tool_call>{"name": "nope", "arguments": {"x": 1}}</tool_call>'
    for piece in (1, 3, 1000):
        assert summary(read(HermesParser(True, names), text, piece)) == (text, [])
        assert summary(read(HermesParser(True, names), TWO_CALLS, piece)) == \
            ("Let me check.", [WEATHER, ("time", "{}")])
    written_another_way = '<tool_call>{"arguments": {"x": 1}, "name": "nope"}</tool_call>'
    assert parse_whole(HermesParser(True, names), written_another_way) is None
    assert parse_whole(HermesParser(True, names), text) is None


@pytest.mark.parametrize("arguments", ["}", "]", "null}"])
def test_a_call_that_closes_where_its_arguments_should_be_gives_its_text_back_at_once(arguments: str) -> None:
    """Not held to the answer's end: the object closed, so what it was is known, and the text after it streams."""
    text = f'<tool_call>{{"name": "f", "arguments": {arguments}</tool_call> then more'
    parser = HermesParser(parallel=True)
    assert summary(parser.feed(text)) == (text, [])
