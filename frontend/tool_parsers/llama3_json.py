"""Llama 3.1's, 3.2's and 3.3's JSON tool calling: an answer that is a call is nothing but the call, a JSON object
``{"name": ..., "parameters": {...}}`` (after ``<|python_tag|>`` where the model writes one), several joined by
``;``. An answer that does not open with one is text, all of it."""

from __future__ import annotations

from collections.abc import Collection

import orjson

from frontend.tool_parsers.base import HistoryCalls, TextPiece, ToolEvent
from frontend.tool_parsers.reader import CallsReader

PYTHON_TAG = "<|python_tag|>"
INSTRUCTIONS = 'To call a function, answer only {"name": <function name>, "parameters": <its arguments>}.'


def calls_text(calls: HistoryCalls) -> str:
    """Earlier calls as an assistant turn of the history holds them, joined by ``; ``."""
    return "; ".join(orjson.dumps({"name": name, "parameters": arguments}).decode() for name, arguments in calls)


class Llama3JsonParser(CallsReader):
    def __init__(self, parallel: bool, names: Collection[str] | None = None) -> None:
        super().__init__(parallel, names)
        self._text = False  # the answer is known to be text

    def read_text(self, final: bool) -> list[ToolEvent]:
        if self._text:
            text, self.buffer = self.buffer, ""
            return [TextPiece(text)] if text else []
        rest = self.buffer.lstrip()
        if rest.startswith(PYTHON_TAG):
            rest = rest[len(PYTHON_TAG):].lstrip()
        elif rest and PYTHON_TAG.startswith(rest) and not final:
            return []
        if not rest:
            if final:
                self._text = True
            return []
        if rest.startswith("{"):
            self.begin_call(len(self.buffer) - len(rest), self.buffer[:len(self.buffer) - len(rest)])
            return []
        self._text = True
        return self.read_text(final)

    def read_between(self, final: bool) -> None:
        rest = self.buffer.lstrip()
        if rest.startswith(";"):
            self.begin_call(len(self.buffer) - len(rest) + 1, "")
        elif rest or final:
            self.end_calls()
