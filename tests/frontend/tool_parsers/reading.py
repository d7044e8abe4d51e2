"""Reading an answer with a parser the way a stream does, in pieces of every size, beside the whole answer's read."""

from __future__ import annotations

from frontend.tool_parsers.base import ArgumentsPiece, CallOpened, TextPiece, ToolCallParser, ToolEvent


def read(parser: ToolCallParser, text: str, piece: int) -> list[ToolEvent]:
    events: list[ToolEvent] = []
    for start in range(0, len(text), piece):
        events += parser.feed(text[start:start + piece])
    return [*events, *parser.finish()]


def summary(events: list[ToolEvent]) -> tuple[str, list[tuple[str, str]]]:
    """(the text, [(name, arguments)]) the events say, pieces joined."""
    text = "".join(event.text for event in events if isinstance(event, TextPiece))
    calls: list[tuple[str, str]] = []
    for event in events:
        if isinstance(event, CallOpened):
            assert event.index == len(calls)
            calls.append((event.name, ""))
        elif isinstance(event, ArgumentsPiece):
            name, arguments = calls[event.index]
            calls[event.index] = (name, arguments + event.text)
    return text, calls
