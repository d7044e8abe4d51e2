"""Anthropic Messages request models (``POST /v1/messages`` and ``/v1/messages/count_tokens``), as the official SDK
sends them. Strict as Anthropic is: an unknown field is a 400 naming it. What the API defines and this server cannot
serve (images, documents, server tools, extended thinking) is refused by name (``refuse_unservable``) before the
models see it, so the error names the field rather than a union member pydantic could not match."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import ConfigDict, Field, StrictBool, StrictInt, field_validator, model_validator

from frontend.errors import UnsupportedParameterError
from frontend.wire_model import WireModel

# The content blocks a conversation may hold here; every other type Anthropic defines is refused by name.
SERVED_BLOCKS = frozenset({"text", "tool_use", "tool_result"})
# Client tools only: a server tool (web search, code execution, ...) runs on Anthropic's side.
CLIENT_TOOL_TYPES = frozenset({"custom"})


class CacheControl(WireModel):
    """Accepted and ignored: the prefix caches apply to every prompt anyway."""

    type: Literal["ephemeral"]
    ttl: Literal["5m", "1h"] | None = None


class TextBlock(WireModel):
    type: Literal["text"]
    text: str
    cache_control: CacheControl | None = None
    citations: list[Any] | None = None  # an earlier answer's citations: history only, nothing to render


class ToolUseBlock(WireModel):
    type: Literal["tool_use"]
    id: str
    name: str
    input: dict[str, Any]
    cache_control: CacheControl | None = None
    caller: Any = None  # who made the call, as the SDK echoes it back: history only
    toolset_name: str | None = None


class ToolResultBlock(WireModel):
    type: Literal["tool_result"]
    tool_use_id: str
    content: str | list[TextBlock] | None = None
    is_error: StrictBool | None = None
    cache_control: CacheControl | None = None
    toolset_name: str | None = None

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(block.text for block in self.content)


ContentBlock = Annotated[TextBlock | ToolUseBlock | ToolResultBlock, Field(discriminator="type")]


class MessageParam(WireModel):
    role: Literal["user", "assistant"]
    content: str | list[ContentBlock]


class Tool(WireModel):
    name: Annotated[str, Field(min_length=1, max_length=128)]
    description: str | None = None
    input_schema: dict[str, Any]  # a JSON schema, kept as sent: its key order is the output's
    type: Literal["custom"] | None = None
    cache_control: CacheControl | None = None
    strict: bool | None = None  # the input is always held to its schema when a call is forced
    input_examples: list[dict[str, Any]] | None = None
    eager_input_streaming: bool | None = None
    defer_loading: bool | None = None
    allowed_callers: list[Any] | None = None

    @field_validator("input_schema")
    @classmethod
    def _an_object(cls, schema: dict[str, Any]) -> dict[str, Any]:
        if schema.get("type") != "object":
            raise ValueError("the input schema must be of type 'object'")
        return schema


class ToolChoiceAuto(WireModel):
    type: Literal["auto"]
    disable_parallel_tool_use: bool | None = None  # chat's parallel_tool_calls, negated


class ToolChoiceAny(WireModel):
    type: Literal["any"]
    disable_parallel_tool_use: bool | None = None  # a forced call is one call


class ToolChoiceTool(WireModel):
    type: Literal["tool"]
    name: str
    disable_parallel_tool_use: bool | None = None


class ToolChoiceNone(WireModel):
    type: Literal["none"]


ToolChoice = Annotated[ToolChoiceAuto | ToolChoiceAny | ToolChoiceTool | ToolChoiceNone, Field(discriminator="type")]


class JsonOutputFormat(WireModel):
    type: Literal["json_schema"]
    schema_: dict[str, Any] = Field(alias="schema")

    model_config = ConfigDict(extra="forbid", frozen=True, populate_by_name=True)


class OutputConfig(WireModel):
    format: JsonOutputFormat | None = None
    effort: Literal["low", "medium", "high", "xhigh", "max"] | None = None  # no reasoning to spend it on: ignored


class Metadata(WireModel):
    user_id: str | None = None  # the session key of cache-aware routing


class ThinkingDisabled(WireModel):
    type: Literal["disabled"]


class CountTokensRequest(WireModel):
    """``/v1/messages/count_tokens``: the fields that make the prompt."""

    model: str
    messages: Annotated[list[MessageParam], Field(min_length=1)]
    system: str | list[TextBlock] | None = None
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None
    output_config: OutputConfig | None = None
    thinking: ThinkingDisabled | None = None
    cache_control: CacheControl | None = None

    @model_validator(mode="after")
    def _tool_choice_names_a_tool(self) -> CountTokensRequest:
        choice = self.tool_choice
        if isinstance(choice, ToolChoiceAny | ToolChoiceTool) and not self.tools:
            raise UnsupportedParameterError("tool_choice forces a tool call, but no tools were given",
                                            param="tool_choice")
        if isinstance(choice, ToolChoiceTool) and choice.name not in {tool.name for tool in self.tools or ()}:
            raise UnsupportedParameterError(f"tool_choice names the tool '{choice.name}', which is not in tools",
                                            param="tool_choice.name")
        return self


class MessagesRequest(CountTokensRequest):
    """``/v1/messages``."""

    max_tokens: Annotated[StrictInt, Field(ge=1)]
    stream: StrictBool | None = None
    stop_sequences: list[str] | None = None
    temperature: Annotated[float, Field(ge=0.0, le=1.0)] | None = None  # Anthropic's default: 1.0
    top_p: Annotated[float, Field(gt=0.0, le=1.0)] | None = None
    top_k: Annotated[int, Field(ge=0)] | None = None
    metadata: Metadata | None = None
    service_tier: Literal["auto", "standard_only"] | None = None  # one tier here
    inference_geo: str | None = None  # one place here
    speed: Literal["standard"] | None = None


def refuse_unservable(body: dict[str, Any]) -> None:
    """A 400 naming the field of what Anthropic defines and this server cannot serve; checked on the raw body,
    before validation, so that the error names the field (``messages.1.content.0.type``) and says why."""
    thinking = body.get("thinking")
    if isinstance(thinking, dict) and thinking.get("type") != "disabled":
        raise UnsupportedParameterError("extended thinking is not supported: this server's engines have no "
                                        "reasoning parser", param="thinking")
    for field in ("container", "diagnostics", "mcp_servers", "context_management"):
        if body.get(field) is not None:
            raise UnsupportedParameterError(f"'{field}' is not supported by this server", param=field)
    if body.get("speed") == "fast":
        raise UnsupportedParameterError("only speed 'standard' is served here", param="speed")
    for index, tool in enumerate(_list(body.get("tools"))):
        kind = tool.get("type") if isinstance(tool, dict) else None
        if isinstance(kind, str) and kind not in CLIENT_TOOL_TYPES:
            raise UnsupportedParameterError(f"the server tool '{kind}' is not supported: only client tools "
                                            "(type 'custom' or none) are", param=f"tools.{index}.type")
    system = body.get("system")
    for index, block in enumerate(_list(system)):
        _refuse_block(block, f"system.{index}", {"text"})
    for m, message in enumerate(_list(body.get("messages"))):
        content = message.get("content") if isinstance(message, dict) else None
        for b, block in enumerate(_list(content)):
            where = f"messages.{m}.content.{b}"
            _refuse_block(block, where, SERVED_BLOCKS)
            if isinstance(block, dict) and block.get("type") == "tool_result":
                for r, part in enumerate(_list(block.get("content"))):
                    _refuse_block(part, f"{where}.content.{r}", {"text"})


def _refuse_block(block: object, where: str, served: frozenset[str] | set[str]) -> None:
    kind = block.get("type") if isinstance(block, dict) else None
    if isinstance(kind, str) and kind not in served:
        raise UnsupportedParameterError(f"content blocks of type '{kind}' are not supported here: only "
                                        f"{', '.join(sorted(served))}", param=f"{where}.type")


def _list(value: object) -> list[Any]:
    return value if isinstance(value, list) else []
