"""Tool calls: how tools reach the prompt, how a request's answer is read for calls (``ToolCalling``), and how the
calls read become OpenAI's ``message.tool_calls``.

The tools are described in the system prompt (SmolLM2's chat template has no notion of tools), with how to call
one: in the model's tool-call format (``frontend.tool_parsers``) when the model chooses (``tool_choice: "auto"``),
as the bare ``{"name", "arguments"}`` object the grammar holds it to when a call is forced. Earlier calls in the
history are written in the model's format (``workers.request_builder.template_message``).
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import llguidance
import orjson

from frontend.errors import InvalidRequestError
from frontend.openai_models import ChatCompletionRequest, ChatTool, GenerationWireRequest, ResponsesRequest
from frontend.structured_output import OutputConstraint, call_schema, tools_in_prompt
from frontend.tool_parsers import ToolCallFormat, forced
from frontend.tool_parsers.base import ParsedCall, ToolCallParser
from frontend.tool_parsers.forced import ForcedCallParser

logger = logging.getLogger("disagg_serve.tool_calls")


@dataclass(frozen=True, slots=True)
class ToolCalling:
    """How one request's answer is read for calls: a forced call, or the model's own format when it chooses."""

    format: ToolCallFormat | None  # None: the call is forced
    parallel: bool = True  # several calls in one answer (``parallel_tool_calls``); a forced call is one
    # The format's grammar of text or well-formed calls (``SamplingParams.grammar``), where it has one and every
    # tool's parameters compile; a forced call's grammar is the request's JSON schema instead.
    grammar: str | None = None
    names: frozenset[str] | None = None  # the functions a call may name (the tools offered); None: any

    @property
    def forced(self) -> bool:
        return self.format is None

    @property
    def instructions(self) -> str:
        return forced.INSTRUCTIONS if self.format is None else self.format.instructions

    def parser(self) -> ToolCallParser:
        """A reader for one answer (one per choice)."""
        return ForcedCallParser() if self.format is None else self.format.parser(self.parallel, self.names)


FORCED = ToolCalling(None, parallel=False)


def tool_calling_for(wire: GenerationWireRequest, constraint: OutputConstraint | None,
                     model_format: ToolCallFormat | None) -> ToolCalling | None:
    """How the answer to ``wire`` is read for calls; None: it is text. ``model_format``: the worker's format
    (``frontend.tool_parsers.choose_format``), None where no parser reads its model's calls."""
    if constraint is not None:  # a forced call, or a JSON output format: the grammar decides what the answer is
        return FORCED if constraint.tool_call else None
    if not tools_in_prompt(wire):
        return None
    if model_format is None:
        if isinstance(wire, ChatCompletionRequest | ResponsesRequest) and wire.tool_choice == "auto":
            raise InvalidRequestError(
                "tool_choice 'auto' needs a tool-call parser, and none reads this model's tool calls: start the "
                "worker with --tool-call-parser NAME, or force a call with 'required' or a named function",
                param="tool_choice")
        return None  # the tools are described and the answer is text, as without a parser
    parallel = getattr(wire, "parallel_tool_calls", None) is not False
    tools = tools_in_prompt(wire)
    grammar = None
    if model_format.grammar is not None:
        grammar = model_format.grammar([call_schema(tool) for tool in tools], parallel)
        if not _compiles(grammar):  # parameters the grammar compiler refuses: the answer is read, not held
            grammar = None
    # A "call" naming no tool offered is the answer's text (a JSON answer about a person named in "name").
    return ToolCalling(model_format, parallel, grammar, frozenset(tool.function.name for tool in tools))


@functools.lru_cache(maxsize=256)
def _compiles(grammar: str) -> bool:
    """Whether llguidance compiles ``grammar`` (once per distinct grammar: a client sends the same tools again)."""
    try:
        error = llguidance.LLMatcher.validate_grammar(llguidance.LLMatcher.grammar_from_lark(grammar))
    except ValueError as exc:
        error = str(exc)
    if error:
        logger.info("tool_choice auto: the tools' grammar does not compile, answers are read without it: %s",
                    error.splitlines()[0])
    return not error


def tools_system_text(tools: list[ChatTool], instructions: str = forced.INSTRUCTIONS) -> str:
    lines = [f"{instructions} Functions:"]
    for tool in tools:
        function = tool.function
        described: dict[str, Any] = {"name": function.name}
        if function.description:
            described["description"] = function.description
        described["parameters"] = function.parameters or {"type": "object", "properties": {}}
        lines.append(orjson.dumps(described).decode())
    return "\n".join(lines)


def with_tools_prompt(messages: list[dict[str, str]], tools: list[ChatTool],
                      instructions: str = forced.INSTRUCTIONS) -> list[dict[str, str]]:
    """The template's messages with the tools described in the system message (added first when there is none);
    ``instructions``: how to call one (``ToolCalling.instructions``)."""
    if not tools:
        return messages
    text = tools_system_text(tools, instructions)
    if messages and messages[0]["role"] == "system":
        first = dict(messages[0])
        first["content"] = f"{first['content']}\n\n{text}" if first["content"] else text
        return [first, *messages[1:]]
    return [{"role": "system", "content": text}, *messages]


def openai_tool_calls(calls: Sequence[ParsedCall], call_id: str) -> list[dict[str, Any]]:
    """Calls read from an answer as OpenAI's ``tool_calls``; the first's id is ``call_id``, the next ones'
    ``call_id`` and their index (``call_id_of``)."""
    return [{"id": call_id_of(call_id, index), "type": "function",
             "function": {"name": call.name, "arguments": call.arguments}} for index, call in enumerate(calls)]


def call_id_of(call_id: str, index: int) -> str:
    return call_id + (f"-{index}" if index else "")  # "_" + the choice's index ends a choice's call_id


def as_tool_call_message(body: dict[str, Any], calls: list[dict[str, Any]], content: str | None,
                         index: int = 0) -> None:
    """Choice ``index`` of a whole chat answer as the calls it made, after the text before them, as OpenAI answers
    a call."""
    choice = body["choices"][index]
    choice["message"] = {"role": "assistant", "content": content, "tool_calls": calls}
    choice["finish_reason"] = "tool_calls"
