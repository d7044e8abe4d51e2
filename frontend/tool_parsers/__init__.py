"""Tool-call parsers, one module per model family's format, chosen here by name or from the chat template.

``--tool-call-parser NAME`` names one (vLLM's names where vLLM has the same format); without it the worker reads
its model's chat template: a template that writes calls in a format here gets that format, one that knows nothing
of tools (SmolLM2's) gets ``hermes``, which the prompt then asks for, and one that writes calls in a format no
parser here reads gets none: ``tool_choice: "auto"`` is then refused with a 400 that says to name a parser."""

from __future__ import annotations

from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass
from typing import Any

from frontend.tool_parsers import hermes, llama3_json, mistral
from frontend.tool_parsers.base import HistoryCalls, ToolCallParser
from frontend.tool_parsers.hermes import HermesParser
from frontend.tool_parsers.llama3_json import Llama3JsonParser
from frontend.tool_parsers.mistral import MistralParser


@dataclass(frozen=True, slots=True)
class ToolCallFormat:
    name: str
    instructions: str  # how the prompt asks for a call, where the template does not say
    # A reader for one answer; its arguments: several calls allowed, the functions a call may name (None: any).
    parser: Callable[[bool, Collection[str] | None], ToolCallParser]
    template_markers: tuple[str, ...]  # text a chat template that writes calls this way holds
    calls_text: Callable[[HistoryCalls], str]  # earlier calls as the history's assistant turn holds them
    # The grammar (llguidance's Lark) of an answer that is text or well-formed calls, from the calls' object
    # schemas and whether several are allowed; None: the answer is read, not held to one.
    grammar: Callable[[Sequence[dict[str, Any]], bool], str] | None = None


FORMATS: dict[str, ToolCallFormat] = {
    "hermes": ToolCallFormat("hermes", hermes.INSTRUCTIONS, HermesParser, (hermes.OPEN,), hermes.calls_text,
                             hermes.grammar),
    "llama3_json": ToolCallFormat("llama3_json", llama3_json.INSTRUCTIONS, Llama3JsonParser,
                                  (llama3_json.PYTHON_TAG,), llama3_json.calls_text),
    "mistral": ToolCallFormat("mistral", mistral.INSTRUCTIONS, MistralParser, (mistral.MARKER,), mistral.calls_text),
}
DEFAULT_FORMAT = "hermes"  # asked for in the prompt where the template declares no format


class UnknownToolCallParser(ValueError):
    pass


def format_named(name: str) -> ToolCallFormat:
    try:
        return FORMATS[name]
    except KeyError:
        raise UnknownToolCallParser(f"unknown tool-call parser {name!r}: one of {', '.join(sorted(FORMATS))}") \
            from None


def format_of_template(template: str | None) -> ToolCallFormat | None:
    """The format a chat template writes calls in; ``hermes`` for one that knows no tools; None for one whose
    calls no parser here reads."""
    if not template:
        return FORMATS[DEFAULT_FORMAT]
    for candidate in FORMATS.values():
        if any(marker in template for marker in candidate.template_markers):
            return candidate
    return None if "tool" in template else FORMATS[DEFAULT_FORMAT]


def choose_format(flag: str | None, template: str | None) -> ToolCallFormat | None:
    """``flag`` (``--tool-call-parser``) if given, else what the template says."""
    return format_named(flag) if flag else format_of_template(template)
