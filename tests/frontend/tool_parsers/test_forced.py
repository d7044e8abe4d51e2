"""A forced call: the answer is one bare call object from its first character, its arguments streamed."""

from __future__ import annotations

from frontend.tool_parsers.base import ArgumentsPiece, CallOpened, ParsedAnswer, ParsedCall, parse_whole
from frontend.tool_parsers.forced import ForcedCallParser
from tests.frontend.tool_parsers.reading import read, summary


def test_the_arguments_stream_in_the_pieces_they_are_generated_in() -> None:
    events = read(ForcedCallParser(), '{"name": "f", "arguments": {"city": "Oslo"}}', 8)
    assert events[0] == CallOpened(0, "f")
    assert [e.text for e in events if isinstance(e, ArgumentsPiece)] == ['{"cit', 'y": "Osl', 'o"}']
    assert parse_whole(ForcedCallParser(), '{"name": "f", "arguments": {}}') == \
        ParsedAnswer(None, (ParsedCall("f", "{}"),))


def test_a_call_cut_short_is_incomplete_and_its_whole_answer_is_text() -> None:
    parser = ForcedCallParser()
    assert summary(read(parser, '{"name": "f", "arguments": {"ci', 4)) == ("", [("f", '{"ci')])
    assert parser.incomplete
    assert parse_whole(ForcedCallParser(), '{"name": "f", "argu') is None
