"""The machinery every format's parser shares: text until the format's marker, then call objects one after another
(``JsonCall``), each announced as it opens and its arguments passed on in pieces, and what follows the calls.

A format says three things (``CallsReader``'s hooks): where its calls begin in the text, what comes before each
call object, and what comes between and after them. Text after the last call is not the client's: OpenAI's and
Anthropic's answers hold text before calls, and a model that writes on after its calls is not answering.
"""

from __future__ import annotations

from abc import abstractmethod
from collections.abc import Collection
from enum import Enum, auto

from frontend.tool_parsers.base import ArgumentsPiece, CallOpened, TextPiece, ToolCallParser, ToolEvent, held_back
from frontend.tool_parsers.json_call import JsonCall


class Phase(Enum):
    TEXT = auto()  # the answer's text, until the calls begin
    CALL = auto()  # inside a call object
    BETWEEN = auto()  # after a call: the format's closing, then another call or the end
    AFTER = auto()  # the calls are over: the rest is dropped


class CallsReader(ToolCallParser):
    def __init__(self, parallel: bool, names: Collection[str] | None = None) -> None:
        """``names``: the functions a call may name (the request's tools; None: any)."""
        self.parallel = parallel
        self.names = names
        self.phase = Phase.TEXT
        self.buffer = ""  # text not yet judged
        self.calls = 0
        self._call: JsonCall | None = None
        self._call_prefix = ""  # the marker before the current call, given back as text if it is no call
        self._incomplete = False

    @property
    def incomplete(self) -> bool:
        return self._incomplete

    # -- the format's hooks -----------------------------------------------------------------------------------------
    @abstractmethod
    def read_text(self, final: bool) -> list[ToolEvent]:
        """Phase TEXT: pass on what of ``buffer`` is text, and call ``begin_call`` where a call begins."""

    @abstractmethod
    def read_between(self, final: bool) -> None:
        """Phase BETWEEN: consume the format's closing and separators; ``begin_call`` or ``end_calls``."""

    # -- what the hooks use -----------------------------------------------------------------------------------------
    def begin_call(self, consumed: int, prefix: str) -> None:
        """A call object starts after ``consumed`` characters of ``buffer``; ``prefix``: its marker, as text."""
        self.buffer = self.buffer[consumed:]
        self.phase = Phase.CALL
        self._call = JsonCall(self.names)
        self._call_prefix = prefix

    def text_before(self, marker: str, final: bool) -> list[ToolEvent]:
        """No ``marker`` in ``buffer``: pass its text on, but for an end that may be the marker's start (until
        ``final``)."""
        keep = 0 if final else held_back(self.buffer, (marker,))
        text = self.buffer[:len(self.buffer) - keep]
        if not text:
            return []
        self.buffer = self.buffer[len(text):]
        return [TextPiece(text)]

    def end_calls(self) -> None:
        self.phase = Phase.AFTER
        self.buffer = ""

    def next_call_allowed(self) -> bool:
        return self.parallel

    # -- the parser -------------------------------------------------------------------------------------------------
    def feed(self, text: str) -> list[ToolEvent]:
        self.buffer += text
        return self._run(final=False)

    def finish(self) -> list[ToolEvent]:
        events = self._run(final=True)
        call = self._call
        if self.phase is Phase.CALL and call is not None:
            if call.opened:
                self._incomplete = True  # cut short inside its arguments
            elif self.calls == 0:  # a marker and no call object after it: the model's text
                events.append(TextPiece(self._call_prefix + call.seen))
            self._call = None
        elif self.phase is Phase.TEXT and self.buffer:
            events.append(TextPiece(self.buffer))
        self.buffer = ""
        return events

    def _run(self, final: bool) -> list[ToolEvent]:
        events: list[ToolEvent] = []
        while True:
            phase, size = self.phase, len(self.buffer)
            if phase is Phase.TEXT:
                events += self.read_text(final)
            elif phase is Phase.CALL:
                events += self._read_call()
            elif phase is Phase.BETWEEN:
                self.read_between(final)
            else:
                self.buffer = ""
            if self.phase is phase and len(self.buffer) == size:
                return events

    def _read_call(self) -> list[ToolEvent]:
        call = self._call
        assert call is not None
        was_open = call.opened
        rest = call.feed(self.buffer)
        self.buffer = ""
        events: list[ToolEvent] = []
        if call.failed and not was_open:
            # No call after all: the marker and what followed it are text, and reading goes on after them (after
            # calls, text is dropped: so is this).
            if self.calls == 0:
                events.append(TextPiece(self._call_prefix + call.seen))
            self._call = None
            self.phase = Phase.TEXT if self.calls == 0 else Phase.AFTER
            self.buffer = rest or ""
            return events
        if call.opened and not was_open:
            events.append(CallOpened(self.calls, call.name or ""))
        events += [ArgumentsPiece(self.calls, piece) for piece in call.take_pieces()]
        if call.done or call.failed:
            self._incomplete = self._incomplete or call.failed
            self.calls += 1
            self._call = None
            self.phase = Phase.BETWEEN if self.next_call_allowed() and not call.failed else Phase.AFTER
            self.buffer = rest or ""
        return events
