"""One call written as a JSON object, ``{"name": <function>, "arguments": {...}}``, read as it is generated: the
shape every format here wraps in its own markers (Llama 3 names the arguments ``parameters``).

The name is known once its string closes; from there the arguments object streams as it comes, byte for byte, and
the call is complete when the outer object closes. An object written another way (its arguments first, or not an
object) is read once it closes, and its arguments re-serialised. Text that cannot be a call object is given back
(``failed``): the format's parser then treats it as text.
"""

from __future__ import annotations

import re
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
    character that cannot open one where the reader failed (what it read is ``seen``), else None."""

    def __init__(self) -> None:
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
                if char == ":" and not self._in_string:
                    self._open_if_head()
            elif self._state is _State.ARGUMENTS:
                if self._arguments_depth == 0:
                    if char.isspace():
                        continue
                    if char != "{":  # arguments that are no object: read the call whole
                        self._state = _State.WHOLE
                        continue
                    self._arguments_depth = 1
                piece.append(char)
                if closed and self._depth == 1:
                    self._flush(piece)
                    self._state = _State.TAIL
            if self._depth == 0 and closed:
                self._flush(piece)
                if self._state is _State.WHOLE or (self._state is _State.HEAD and self.name is None):
                    self._read_whole()
                else:
                    self._state = _State.DONE
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
        """Before anything else, only whitespace and then an object."""
        stripped = "".join(self._seen).lstrip()
        return not stripped or stripped[0] == "{"

    def _open_if_head(self) -> None:
        match = _HEAD.match("".join(self._seen))
        if match is not None:
            self.name = orjson.loads(match.group(1))
            self._state = _State.ARGUMENTS

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
        if not isinstance(name, str) or not isinstance(arguments, dict):
            self._state = _State.FAILED
            return
        self.name = name
        text = orjson.dumps(arguments).decode()
        self.pieces = [text]
        self.arguments_text = [text]
        self._state = _State.DONE
