"""Mistral's ``[TOOL_CALLS]`` list read out of an answer."""

from __future__ import annotations

import pytest

from frontend.tool_parsers.base import ParsedAnswer, ParsedCall, parse_whole
from frontend.tool_parsers.mistral import MistralParser
from tests.frontend.tool_parsers.reading import read, summary

LISTED = 'Sure. [TOOL_CALLS][{"name": "f", "arguments": {"x": [1, 2]}}, {"name": "g", "arguments": {}}]'


@pytest.mark.parametrize("piece", [1, 2, 5, 1000])
def test_text_then_a_list_of_calls_in_pieces_of_any_size(piece: int) -> None:
    assert summary(read(MistralParser(parallel=True), LISTED, piece)) == \
        ("Sure.", [("f", '{"x": [1, 2]}'), ("g", "{}")])


def test_one_call_when_parallel_calls_are_off_and_a_bare_object_is_one_call() -> None:
    assert parse_whole(MistralParser(parallel=False), LISTED) == \
        ParsedAnswer("Sure.", (ParsedCall("f", '{"x": [1, 2]}'),))
    bare = '[TOOL_CALLS] {"name": "f", "arguments": {}}'
    assert parse_whole(MistralParser(parallel=True), bare) == ParsedAnswer(None, (ParsedCall("f", "{}"),))


@pytest.mark.parametrize("text", ["no calls [TOOL", "[TOOL_CALLS] nothing", "[TOOL_CALLS][1]"])
def test_text_that_holds_no_call_is_text_as_written(text: str) -> None:
    for piece in (1, 3, 100):
        assert summary(read(MistralParser(parallel=True), text, piece)) == (text, [])


def test_a_marker_with_no_list_after_it_keeps_the_space_before_it_however_it_is_split() -> None:
    text = "Hello [TOOL_CALLS] not a list"
    for piece in (1, 3, 18, 100):  # (18: the first piece ends at the marker's end)
        assert summary(read(MistralParser(parallel=True), text, piece)) == (text, [])
