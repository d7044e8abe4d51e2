"""The Responses API's ``input`` items, and the chat conversation they mean.

Each item type this server can render is modelled with every field the SDK can put in it; an item of any other type
is a 400 naming ``input.N``, never dropped. The conversation is written as chat messages, so one renderer serves
chat and Responses alike."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Annotated, Any, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Discriminator, Field, Tag

from frontend.errors import UnsupportedParameterError

ItemStatus = Literal["in_progress", "completed", "incomplete"]


class _Item(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class InputText(_Item):
    type: Literal["input_text"]
    text: str
    prompt_cache_breakpoint: dict[str, Any] | None = None  # a caching hint: changes nothing of the answer


class OutputText(_Item):
    """The server's own text, replayed: annotations and logprobs are history, not prompt."""

    type: Literal["output_text"]
    text: str
    annotations: list[Any] | None = None
    logprobs: list[Any] | None = None


class Refusal(_Item):
    type: Literal["refusal"]
    refusal: str


class InputImage(_Item):
    type: Literal["input_image"]
    image_url: str | None = None
    file_id: str | None = None
    detail: str | None = None
    prompt_cache_breakpoint: dict[str, Any] | None = None


class InputFile(_Item):
    type: Literal["input_file"]
    file_data: str | None = None
    file_id: str | None = None
    file_url: str | None = None
    filename: str | None = None
    detail: str | None = None
    prompt_cache_breakpoint: dict[str, Any] | None = None


class InputAudio(_Item):
    type: Literal["input_audio"]
    input_audio: dict[str, Any] | None = None


ContentPart = Annotated[
    InputText | OutputText | Refusal | InputImage | InputFile | InputAudio, Field(discriminator="type")
]


def _str_or_list(value: Any) -> str:
    return "str" if isinstance(value, str) else "list"


# Text, or a list of parts. Tagged so that a bad part is reported as the part's own error, not as "should be a
# valid string" (the tags are pydantic's type names, which error locations leave out).
Content = Annotated[
    Annotated[str, Tag("str")] | Annotated[list[ContentPart], Tag("list")], Discriminator(_str_or_list)
]


class MessageItem(_Item):
    """An easy message, a typed input message, or one of the server's own output messages."""

    type: Literal["message"] | None = None
    role: Literal["user", "assistant", "system", "developer"]
    content: Content
    id: str | None = None
    status: ItemStatus | None = None
    phase: Literal["commentary", "final_answer"] | None = None  # a hint for other models' follow-ups


class FunctionCallItem(_Item):
    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str
    id: str | None = None
    status: ItemStatus | None = None
    namespace: str | None = None
    caller: dict[str, Any] | None = None
    async_: bool | None = Field(default=None, alias="async")  # a reserved word in Python


class FunctionCallOutputItem(_Item):
    type: Literal["function_call_output"]
    output: Content
    call_id: str | None = None
    id: str | None = None
    status: ItemStatus | None = None
    name: str | None = None
    namespace: str | None = None
    caller: dict[str, Any] | None = None


def _item_type(item: Any) -> str:
    kind = item.get("type") if isinstance(item, dict) else getattr(item, "type", None)
    return kind or "message"  # an easy message may leave its type out


def _item_tag(item: Any) -> str:
    # Written like pydantic's own union tags ('list[...]'), which error locations leave out: a bad item's param
    # reads 'input.0.content', not 'input.0.message.content'.
    return f"item[{_item_type(item)}]"


RENDERED_ITEM_TYPES = ("message", "function_call", "function_call_output")


def _refuse_unrendered_items(items: Any) -> Any:
    # Checked before the union so the 400 names the item and says why, rather than pydantic's tag mismatch.
    if isinstance(items, list):
        for index, item in enumerate(items):
            kind = _item_type(item)
            if kind not in RENDERED_ITEM_TYPES:
                raise UnsupportedParameterError(
                    f"input item type {kind!r} is not supported by this server; it renders "
                    + ", ".join(RENDERED_ITEM_TYPES) + " items",
                    param=f"input.{index}",
                )
    return items


InputItem = Annotated[
    Annotated[MessageItem, Tag("item[message]")]
    | Annotated[FunctionCallItem, Tag("item[function_call]")]
    | Annotated[FunctionCallOutputItem, Tag("item[function_call_output]")],
    Discriminator(_item_tag),
]
InputItems = Annotated[list[InputItem], BeforeValidator(_refuse_unrendered_items), Field(min_length=1)]
# What ``ResponsesRequest.input`` takes: text, or items (tagged as ``Content`` is).
ResponsesInput = Annotated[
    Annotated[str, Tag("str")] | Annotated[InputItems, Tag("list")], Discriminator(_str_or_list)
]


def _chat_part(part: ContentPart) -> dict[str, Any]:
    """A Responses content part as the chat wire writes it."""
    if isinstance(part, InputText | OutputText):
        return {"type": "text", "text": part.text}
    if isinstance(part, Refusal):
        return {"type": "refusal", "refusal": part.refusal}
    if isinstance(part, InputImage):
        return {"type": "input_image", "image_url": part.image_url or part.file_id}
    if isinstance(part, InputFile):
        return {"type": "file", "file": part.model_dump(exclude={"type"}, exclude_none=True)}
    return {"type": "input_audio", "input_audio": part.input_audio}


def _chat_content(content: str | list[ContentPart]) -> str | list[dict[str, Any]]:
    return content if isinstance(content, str) else [_chat_part(p) for p in content]


def chat_turns(items: Sequence[MessageItem | FunctionCallItem | FunctionCallOutputItem]) -> list[dict[str, Any]]:
    """The conversation ``items`` mean, as chat messages (dicts in the chat wire shape)."""
    turns: list[dict[str, Any]] = []
    for item in items:
        if isinstance(item, MessageItem):
            turns.append({"role": item.role, "content": _chat_content(item.content)})
        elif isinstance(item, FunctionCallItem):
            call = {"id": item.call_id, "type": "function",
                    "function": {"name": item.name, "arguments": item.arguments}}
            if turns and turns[-1]["role"] == "assistant":
                # The model's text and its calls are one assistant turn in chat; Responses lists them apart.
                turns[-1].setdefault("tool_calls", []).append(call)
            else:
                turns.append({"role": "assistant", "content": None, "tool_calls": [call]})
        else:
            turns.append({"role": "tool", "tool_call_id": item.call_id, "content": _chat_content(item.output)})
    return turns
