"""A forced call (``tool_choice`` ``required`` or a named function; Anthropic's ``any`` or ``tool``): the grammar
holds the whole answer to one ``{"name": ..., "arguments": {...}}`` object, whatever the model's own format, so the
answer is read as that object from its first character, its arguments streamed as they are generated."""

from __future__ import annotations

from frontend.tool_parsers.base import TextPiece, ToolEvent
from frontend.tool_parsers.reader import CallsReader

INSTRUCTIONS = 'To call a function, answer only {"name": <function name>, "arguments": <its arguments>}.'


class ForcedCallParser(CallsReader):
    def __init__(self) -> None:
        super().__init__(parallel=False)
        self.begin_call(0, "")

    def read_text(self, final: bool) -> list[ToolEvent]:
        # Not a call object (never, where the engine enforces the grammar): the rest is text.
        text, self.buffer = self.buffer, ""
        return [TextPiece(text)] if text else []

    def read_between(self, final: bool) -> None:
        self.end_calls()
