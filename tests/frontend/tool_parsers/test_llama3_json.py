"""Llama 3's JSON calls: an answer that is nothing but calls, or text."""

from __future__ import annotations

import pytest

from frontend.tool_parsers.base import ParsedAnswer, ParsedCall, parse_whole
from frontend.tool_parsers.llama3_json import Llama3JsonParser
from tests.frontend.tool_parsers.reading import read, summary

CALLS = '<|python_tag|>{"name": "f", "parameters": {"x": 1}}; {"name": "g", "parameters": {}}'


@pytest.mark.parametrize("piece", [1, 2, 5, 1000])
def test_calls_joined_by_semicolons_in_pieces_of_any_size(piece: int) -> None:
    assert summary(read(Llama3JsonParser(parallel=True), CALLS, piece)) == ("", [("f", '{"x": 1}'), ("g", "{}")])
    assert summary(read(Llama3JsonParser(parallel=True), CALLS.removeprefix("<|python_tag|>"), piece)) == \
        ("", [("f", '{"x": 1}'), ("g", "{}")])


def test_one_call_when_parallel_calls_are_off() -> None:
    assert parse_whole(Llama3JsonParser(parallel=False), CALLS) == ParsedAnswer(None, (ParsedCall("f", '{"x": 1}'),))


@pytest.mark.parametrize("text", ["The call would be {\"name\": \"f\", \"parameters\": {}}", "<|python", "{not json"])
def test_an_answer_that_does_not_open_with_a_call_is_text(text: str) -> None:
    for piece in (1, 3, 100):
        assert summary(read(Llama3JsonParser(parallel=True), text, piece)) == (text, [])


def test_a_json_answer_that_names_no_tool_is_text() -> None:
    """A JSON answer whose "name" is data (a person), not one of the request's functions, is no call."""
    text = '{"name": "Bob", "parameters": {"age": 3}}'
    for piece in (1, 3, 100):
        assert summary(read(Llama3JsonParser(True, frozenset({"f"})), text, piece)) == (text, [])
    assert parse_whole(Llama3JsonParser(True, frozenset({"f"})), text) is None
    assert parse_whole(Llama3JsonParser(True, frozenset({"Bob"})), text) == \
        ParsedAnswer(None, (ParsedCall("Bob", '{"age": 3}'),))
