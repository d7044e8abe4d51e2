"""Mistral's format (its instruct models' v3 tokenizer and templates): text, then ``[TOOL_CALLS]`` and the calls as
one JSON list, ``[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]``. ``[TOOL_CALLS]`` is a control token in
Mistral's tokenizers: the engine's detokenizer must keep it in the text for this parser to see it."""

from __future__ import annotations

from collections.abc import Collection

import orjson

from frontend.tool_parsers.base import HistoryCalls, TextPiece, ToolEvent
from frontend.tool_parsers.reader import CallsReader

MARKER = "[TOOL_CALLS]"
INSTRUCTIONS = f'To call functions, answer {MARKER}[{{"name": <function name>, "arguments": <its arguments>}}].'


def calls_text(calls: HistoryCalls) -> str:
    """Earlier calls as an assistant turn of the history holds them: the marker, then the list."""
    return MARKER + orjson.dumps([{"name": name, "arguments": arguments} for name, arguments in calls]).decode()


class MistralParser(CallsReader):
    def __init__(self, parallel: bool, names: Collection[str] | None = None) -> None:
        super().__init__(parallel, names)
        self._listed = False  # the calls are in a list (else one bare object followed the marker)

    def read_text(self, final: bool) -> list[ToolEvent]:
        at = self.buffer.find(MARKER)
        if at >= 0:
            events: list[ToolEvent] = []
            before = self.buffer[:at].rstrip()
            if before:
                events.append(TextPiece(before))
            rest = self.buffer[at + len(MARKER):]
            stripped = rest.lstrip()
            if not stripped and not final:
                self.buffer = self.buffer[len(before):]  # wait for the list (the space before the marker kept)
                return events
            self._listed = stripped.startswith("[")
            skip = len(rest) - len(stripped) + (1 if self._listed else 0)
            prefix = self.buffer[len(before):at + len(MARKER)] + rest[:skip]
            self.buffer = rest
            self.begin_call(skip, prefix)
            return events
        return self.text_before(MARKER, final)

    def read_between(self, final: bool) -> None:
        rest = self.buffer.lstrip()
        if rest.startswith(",") and self._listed:
            self.begin_call(len(self.buffer) - len(rest) + 1, "")
        elif rest or final:
            self.end_calls()
