"""Hermes' format (NousResearch's Hermes, Qwen 2.5 and 3, and many templates after them): each call a JSON object
in its own tags, after any text, ``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>``, one tagged
call after another for several. It is also the format this server asks for where a model's chat template declares
none (SmolLM2's): the prompt describes the tools and the tags, as earlier calls in a conversation are rendered."""

from __future__ import annotations

from frontend.tool_parsers.base import TextPiece, ToolEvent, held_back
from frontend.tool_parsers.reader import CallsReader

OPEN = "<tool_call>"
CLOSE = "</tool_call>"
INSTRUCTIONS = f'To call a function, answer {OPEN}{{"name": <function name>, "arguments": <its arguments>}}{CLOSE}.'


def call_text(name_and_arguments: str) -> str:
    """A call as this format writes it, from its ``{"name", "arguments"}`` JSON text."""
    return f"{OPEN}\n{name_and_arguments}\n{CLOSE}"


class HermesParser(CallsReader):
    def read_text(self, final: bool) -> list[ToolEvent]:
        at = self.buffer.find(OPEN)
        if at >= 0:
            before = self.buffer[:at].rstrip()
            self.begin_call(at + len(OPEN), self.buffer[len(before):at + len(OPEN)])
            return [TextPiece(before)] if before else []
        keep = 0 if final else held_back(self.buffer, (OPEN,))
        text = self.buffer[:len(self.buffer) - keep]
        if not text:
            return []
        self.buffer = self.buffer[len(text):]
        return [TextPiece(text)]

    def read_between(self, final: bool) -> None:
        rest = self.buffer.lstrip()
        if rest.startswith(CLOSE):
            self.buffer = rest[len(CLOSE):]
            return
        if rest.startswith(OPEN):
            self.begin_call(len(self.buffer) - len(rest) + len(OPEN), OPEN)
            return
        if rest and not final and (CLOSE.startswith(rest) or OPEN.startswith(rest)):
            return  # a marker may be coming
        if rest or final:
            self.end_calls()
