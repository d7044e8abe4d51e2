"""One call written as a JSON object, ``{"name": <function>, "arguments": {...}}``, read as it is generated: the
shape every format here wraps in its own markers (Llama 3 names the arguments ``parameters``).

The call opens once its name is known and its arguments' value opens as an object; from there the arguments stream
as they come, byte for byte, and the call is complete when the outer object closes, if the object is valid JSON (a
call whose arguments turn out not to be JSON fails after its pieces went out: the answer is then incomplete). An
object written another way (its arguments first, or not an object) is read once it closes, and its arguments
re-serialised. Text that cannot be a call object, or a call to a function the request does not offer, is given back
(``failed``): the format's parser then treats it as text.
"""

from __future__ import annotations

import re
from collections.abc import Collection
from enum import Enum, auto

import orjson

# The opening up to the arguments' value: a name string first, then the arguments' key.
_HEAD = re.compile(r'\A\s*\{\s*"name"\s*:\s*("(?:[^"\\]|\\.)*")\s*,\s*"(?:arguments|parameters)"\s*:\s*\Z')
_ARGUMENT_KEYS = ("arguments", "parameters")


class _State(Enum):
    HEAD = auto()  # before the arguments' value
    ARGUMENTS = auto()  # inside the arguments object: streamed
    TAIL = auto()  # after the arguments, until the object closes
    WHOLE = auto()  # written another way: read once the object closes
    DONE = auto()
    FAILED = auto()


class JsonCall:
    """One call object's reader. ``feed`` returns the text after the object once it has closed, or from the first
    character that cannot open one where the reader failed (what it read is ``seen``), else None. ``names``: the
    functions a call may name (None: any)."""

    def __init__(self, names: Collection[str] | None = None) -> None:
        self._names = names
        self._opening = False  # the object's brace has been read
        self._head_name: str | None = None  # read from the head; the call opens once its arguments open as an object
        self._state = _State.HEAD
        self._seen: list[str] = []  # every character fed, for a call written another way, or given back
        self._depth = 0
        self._in_string = False
        self._escaped = False
        self._arguments_depth = 0  # the depth inside the arguments object; 0 until it opens
        self.name: str | None = None  # known once the call has opened
        self.pieces: list[str] = []  # the arguments' text since the last ``take_pieces``
        self.arguments_text: list[str] = []

    @property
    def opened(self) -> bool:
        return self.name is not None

    @property
    def done(self) -> bool:
        return self._state is _State.DONE

    @property
    def failed(self) -> bool:
        return self._state is _State.FAILED

    @property
    def seen(self) -> str:
        return "".join(self._seen)

    def take_pieces(self) -> list[str]:
        pieces, self.pieces = self.pieces, []
        return pieces

    def feed(self, text: str) -> str | None:
        piece: list[str] = []
        for position, char in enumerate(text):
            self._seen.append(char)
            closed = self._step(char)
            if self._state is _State.HEAD:
                if not self._seen_could_open():  # the character that cannot open a call is given back unread
                    self._seen.pop()
                    self._state = _State.FAILED
                    return text[position:]
                if char == ":" and self._depth == 1 and not self._in_string and not self._open_if_head():
                    self._state = _State.FAILED
                    return text[position + 1:]
            elif self._state is _State.ARGUMENTS:
                if self._arguments_depth == 0 and not char.isspace():
                    if char == "{":
                        self._arguments_depth = 1
                        self.name = self._head_name
                    else:  # arguments that are no object: read the call whole (this character may close it)
                        self._state = _State.WHOLE
                if self._arguments_depth:
                    piece.append(char)
                    if closed and self._depth == 1:
                        self._flush(piece)
                        self._state = _State.TAIL
            if self._depth == 0 and closed:
                self._flush(piece)
                if self._state is _State.WHOLE or self._state is _State.HEAD:
                    self._read_whole()
                else:  # the arguments streamed: the call stands if the object is JSON (else it fails, opened)
                    self._state = _State.DONE if _is_json("".join(self._seen)) else _State.FAILED
                return text[position + 1:]
        self._flush(piece)
        return None

    def _flush(self, piece: list[str]) -> None:
        if piece:
            joined = "".join(piece)
            self.pieces.append(joined)
            self.arguments_text.append(joined)
            piece.clear()

    def _step(self, char: str) -> bool:
        """Track strings and nesting; True where ``char`` closed an object or array."""
        if self._in_string:
            if self._escaped:
                self._escaped = False
            elif char == "\\":
                self._escaped = True
            elif char == '"':
                self._in_string = False
            return False
        if char == '"':
            self._in_string = True
        elif char in "{[":
            self._depth += 1
        elif char in "}]":
            self._depth -= 1
            return True
        return False

    def _seen_could_open(self) -> bool:
        """Before anything else, only whitespace and then an object (the last character is the only new one)."""
        char = self._seen[-1]
        if self._opening:
            return True
        if char == "{":
            self._opening = True
        return self._opening or char.isspace()

    def _open_if_head(self) -> bool:
        """Read the name where the head is complete; False where it names a function not offered, or no name."""
        match = _HEAD.match("".join(self._seen))
        if match is None:
            return True
        try:
            name = orjson.loads(match.group(1))
        except orjson.JSONDecodeError:  # an escape JSON has not ("\q"): no call object
            return False
        if not self._offered(name):
            return False
        self._head_name = name
        self._state = _State.ARGUMENTS
        return True

    def _offered(self, name: str) -> bool:
        return self._names is None or name in self._names

    def _read_whole(self) -> None:
        try:
            call = orjson.loads("".join(self._seen))
        except orjson.JSONDecodeError:
            self._state = _State.FAILED
            return
        name = call.get("name") if isinstance(call, dict) else None
        arguments = next((call[key] for key in _ARGUMENT_KEYS if isinstance(call, dict) and key in call), None)
        if isinstance(arguments, str):  # some models write the arguments as a JSON string
            try:
                arguments = orjson.loads(arguments)
            except orjson.JSONDecodeError:
                arguments = None
        if not isinstance(name, str) or not isinstance(arguments, dict) or not self._offered(name):
            self._state = _State.FAILED
            return
        self.name = name
        text = orjson.dumps(arguments).decode()
        self.pieces = [text]
        self.arguments_text = [text]
        self._state = _State.DONE


def _is_json(text: str) -> bool:
    try:
        orjson.loads(text)
    except orjson.JSONDecodeError:
        return False
    return True
