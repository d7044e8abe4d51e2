"""What a tool-call parser reads out of a model's answer, and the contract every format's parser keeps.

A parser reads the answer's text as it is generated (``feed``, then ``finish``) and says what it is, in order:
text for the client (``TextPiece``), a call opening once its function's name is known (``CallOpened``), and the
call's arguments in pieces as they are generated (``ArgumentsPiece``). Only what may still turn out to be part of a
call's opening marker, or whitespace before one, is held back. A whole answer is read by the same parser
(``parse_whole``), so a streamed answer and a whole one say the same: the calls' arguments are the model's own JSON
text, byte for byte, in both.

What a call's arguments do not complete (an answer cut short by ``max_tokens``) stays a call in a stream, whose
pieces are out already, and is the answer's text in a whole answer, as a forced call cut short always was.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True, slots=True)
class TextPiece:
    text: str


@dataclass(frozen=True, slots=True)
class CallOpened:
    index: int  # among this answer's calls
    name: str


@dataclass(frozen=True, slots=True)
class ArgumentsPiece:
    index: int
    text: str


ToolEvent = TextPiece | CallOpened | ArgumentsPiece
# Earlier calls as a conversation's history holds them: (name, arguments), the arguments parsed where they are JSON.
HistoryCalls = Sequence[tuple[str, Any]]


@dataclass(frozen=True, slots=True)
class ParsedCall:
    name: str
    arguments: str  # JSON text, as generated


@dataclass(frozen=True, slots=True)
class ParsedAnswer:
    """A whole answer read: its text (None when only whitespace) and the calls it made, in order."""

    content: str | None
    calls: tuple[ParsedCall, ...]


class ToolCallParser(ABC):
    """One answer's reader (one per choice): feed it the text as it comes, then ``finish`` once."""

    @abstractmethod
    def feed(self, text: str) -> list[ToolEvent]:
        """What ``text`` (the next piece of the answer) makes known."""

    @abstractmethod
    def finish(self) -> list[ToolEvent]:
        """What was held back, now that the answer has ended."""

    @property
    @abstractmethod
    def incomplete(self) -> bool:
        """The answer ended inside a call, its arguments not closed."""


def parse_whole(parser: ToolCallParser, text: str) -> ParsedAnswer | None:
    """A whole answer read by ``parser``; None when it made no complete call (the answer is its text)."""
    events = [*parser.feed(text), *parser.finish()]
    if parser.incomplete:
        return None
    texts: list[str] = []
    names: list[str] = []
    arguments: list[list[str]] = []
    for event in events:
        if isinstance(event, TextPiece):
            texts.append(event.text)
        elif isinstance(event, CallOpened):
            names.append(event.name)
            arguments.append([])
        else:
            arguments[event.index].append(event.text)
    if not names:
        return None
    content = "".join(texts)
    calls = tuple(ParsedCall(name, "".join(pieces)) for name, pieces in zip(names, arguments, strict=True))
    return ParsedAnswer(content if content.strip() else None, calls)


def held_back(text: str, markers: tuple[str, ...]) -> int:
    """How many characters at the end of ``text`` must wait: the longest that may begin one of ``markers``, and
    the whitespace before it (dropped, with the marker, if a call follows)."""
    partial = 0
    for marker in markers:
        for size in range(min(len(marker) - 1, len(text)), partial, -1):
            if text.endswith(marker[:size]):
                partial = size
                break
    body = text[:len(text) - partial]
    return len(text) - len(body.rstrip())
