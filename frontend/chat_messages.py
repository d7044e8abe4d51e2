"""A chat's messages on the OpenAI wire: their roles, content parts and the tool calls they carry.

Chat messages take every field the official SDK can put in one (``model_dump()`` of a reply included): an
assistant's ``tool_calls`` and ``function_call`` and a tool message's ``tool_call_id`` are rendered into the chat
template; ``refusal``, ``annotations`` and ``reasoning_content`` are read as history and ``audio`` must be null.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Field

from frontend.wire_model import WireModel


class TextContentPart(WireModel):
    type: Literal["text", "input_text", "output_text"]
    text: str


class ImageContentPart(WireModel):
    type: Literal["image_url", "input_image"]
    image_url: Any = None


class AudioContentPart(WireModel):
    type: Literal["input_audio"]
    input_audio: Any = None


class FileContentPart(WireModel):
    type: Literal["file"]
    file: Any = None


class RefusalContentPart(WireModel):
    """An assistant turn's refusal, as the SDK writes it back into the history."""

    type: Literal["refusal"]
    refusal: str


ContentPart = Annotated[
    TextContentPart | ImageContentPart | AudioContentPart | FileContentPart | RefusalContentPart,
    Field(discriminator="type"),
]
_TEXT_PARTS = (TextContentPart, RefusalContentPart)


class FunctionCall(WireModel):
    name: str
    arguments: str


class ToolCall(WireModel):
    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(WireModel):
    role: Literal["system", "developer", "user", "assistant", "tool", "function"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    # Assistant history, as ``reply.choices[0].message.model_dump()`` gives it back.
    refusal: str | None = None
    tool_calls: list[ToolCall] | None = None
    function_call: FunctionCall | None = None
    audio: dict[str, Any] | None = None  # a reference to generated audio: only null can be honoured
    annotations: list[Any] | None = None  # citations of the answer: output only, nothing to render
    reasoning_content: str | None = None  # vLLM's reasoning field: earlier reasoning is not fed back
    reasoning: str | None = None
    # A tool's answer.
    tool_call_id: str | None = None

    @property
    def has_media(self) -> bool:
        return isinstance(self.content, list) and any(not isinstance(p, _TEXT_PARTS) for p in self.content)

    def text(self) -> str:
        if self.content is None:
            return self.refusal or ""
        if isinstance(self.content, str):
            return self.content
        return "".join(p.text if isinstance(p, TextContentPart) else p.refusal
                       for p in self.content if isinstance(p, _TEXT_PARTS))

    def calls(self) -> list[FunctionCall]:
        """The function calls this (assistant) message made, the deprecated ``function_call`` included."""
        calls = [call.function for call in self.tool_calls or ()]
        return [*calls, self.function_call] if self.function_call is not None else calls
