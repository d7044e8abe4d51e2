"""The Responses API's ``tools`` and ``tool_choice``: function tools only.

A function tool is chat's tool with its fields flat (``{"type": "function", "name", "parameters"}``); the request
hands it to the same structured-output machinery as chat (``frontend.structured_output``). A built-in tool (web
search, file search, code interpreter, MCP, ...) would need the server to run it: it is a 400 naming
``tools.N.type`` and the tool's type, never dropped. Every other field the SDK can put in a function tool is
accepted null."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BeforeValidator, ConfigDict, Field, StrictBool

from frontend.errors import InvalidRequestError, UnsupportedParameterError
from frontend.wire_model import WireModel


class ResponsesFunctionTool(WireModel):
    model_config = ConfigDict(extra="forbid", frozen=True, populate_by_name=True)

    type: Literal["function"]
    name: Annotated[str, Field(min_length=1)]
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: StrictBool | None = None
    # Tool search and programmatic calling: features of OpenAI's own runtime, accepted when unset.
    allowed_callers: None = None
    async_: None = Field(default=None, alias="async")
    defer_loading: Literal[False] | None = None
    output_schema: None = None

    def echoed(self) -> dict[str, Any]:
        """The tool as the Response object repeats it (the SDK's ``FunctionTool``)."""
        return {"type": "function", "name": self.name, "description": self.description,
                "parameters": self.parameters, "strict": self.strict}


def _tool_type(tool: Any) -> Any:
    return tool.get("type") if isinstance(tool, dict) else None


def _refuse_built_in_tools(tools: Any) -> Any:
    # Checked before the model so the 400 names the tool's type and says why, not pydantic's literal mismatch.
    if isinstance(tools, list):
        for index, tool in enumerate(tools):
            kind = _tool_type(tool)
            if kind == "function" and isinstance(tool, dict) and "function" in tool and "name" not in tool:
                raise InvalidRequestError(
                    "a Responses function tool is flat: {'type': 'function', 'name': ..., 'parameters': ...}, "
                    "not chat's nested 'function' object", param=f"tools.{index}.name")
            if isinstance(kind, str) and kind != "function":
                raise UnsupportedParameterError(
                    f"tool type {kind!r} is not supported by this server: it runs no built-in tools, only "
                    "'function' tools, which the client runs", param=f"tools.{index}.type")
    return tools


ResponsesTools = Annotated[list[ResponsesFunctionTool], BeforeValidator(_refuse_built_in_tools)]


class ResponsesNamedToolChoice(WireModel):
    """``{"type": "function", "name": ...}``: that function must be called."""

    type: Literal["function"]
    name: str


def _refuse_other_tool_choices(choice: Any) -> Any:
    kind = _tool_type(choice)
    if isinstance(kind, str) and kind != "function":
        raise UnsupportedParameterError(
            f"tool_choice of type {kind!r} is not supported by this server: only 'none', 'auto', 'required' or "
            "{'type': 'function', 'name': ...}", param="tool_choice")
    return choice


ResponsesToolChoice = Annotated[Literal["none", "auto", "required"] | ResponsesNamedToolChoice,
                                BeforeValidator(_refuse_other_tool_choices)]
