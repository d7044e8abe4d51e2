"""Hermes' format (NousResearch's Hermes, Qwen 2.5 and 3, and many templates after them): each call a JSON object
in its own tags, after any text, ``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>``, one tagged
call after another for several. It is also the format this server asks for where a model's chat template declares
none (SmolLM2's): the prompt describes the tools and the tags, as earlier calls in a conversation are rendered.

``grammar`` holds an answer to text, or text and then well-formed calls: the text may not hold the opening tag
unless a call follows it, and a call is one of the tools' names with arguments valid against its parameters, so
what a small model writes in the tags parses."""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

import orjson

from frontend.structured_output import JSON_OPTIONS
from frontend.tool_parsers.base import HistoryCalls, TextPiece, ToolEvent
from frontend.tool_parsers.reader import CallsReader

OPEN = "<tool_call>"
CLOSE = "</tool_call>"
INSTRUCTIONS = f'To call a function, answer {OPEN}{{"name": <function name>, "arguments": <its arguments>}}{CLOSE}.'


def grammar(call_schemas: Sequence[dict[str, Any]], parallel: bool) -> str:
    """The llguidance grammar (Lark syntax) of an answer that is text, or text and then calls (one, unless
    ``parallel``), each call's JSON one of ``call_schemas`` (``{"name", "arguments"}`` object schemas)."""
    schema: dict[str, Any] = dict(call_schemas[0]) if len(call_schemas) == 1 else {"anyOf": list(call_schemas)}
    schema["x-guidance"] = JSON_OPTIONS  # formatted as forced calls and JSON outputs are
    more = f'("\\n"? "{OPEN}" call)*' if parallel else ""
    return "\n".join((
        "%llguidance {}",
        f"start: TEXT? | before call {more}",
        f'before[suffix="{OPEN}"]: /(.|\\n)*/',  # any text up to the first tag, ended by it
        f'call: "\\n" %json {json.dumps(schema)} "\\n{CLOSE}"',
        f"TEXT: /(.|\\n)+/ & ~/(.|\\n)*{OPEN}(.|\\n)*/",  # text alone never holds the tag
    ))


def calls_text(calls: HistoryCalls) -> str:
    """Earlier calls as an assistant turn of the history holds them, one tagged call a line."""
    return "\n".join(f"{OPEN}\n{orjson.dumps({'name': name, 'arguments': arguments}).decode()}\n{CLOSE}"
                     for name, arguments in calls)


class HermesParser(CallsReader):
    def read_text(self, final: bool) -> list[ToolEvent]:
        at = self.buffer.find(OPEN)
        if at >= 0:
            before = self.buffer[:at].rstrip()
            self.begin_call(at + len(OPEN), self.buffer[len(before):at + len(OPEN)])
            return [TextPiece(before)] if before else []
        return self.text_before(OPEN, final)

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
