"""The client's body as the orchestrator holds it: parsed, except its long prompt strings, which stay the JSON bytes
they came in as (``RawText``, a view of the body: no copy).

The orchestrator reads no more of a prompt than its first characters and its size, so a long literal at a prompt
position is found by bytes and never parsed; the rest goes to orjson, and each worker body is written around the
literal as a chunk of its own. Anything unexpected is parsed whole, so an error says what the full parse says. How
the literals are found, and what is left to the worker to check: docs/architecture.md, "The client's body"."""

from __future__ import annotations

import secrets
from typing import Any

import numpy as np
import orjson

from frontend.http import parse_json_object
from orchestrator.upstream.base import Body

MIN_BODY = 64 * 1024  # smaller bodies parse in a few tens of microseconds: nothing to win
MIN_LITERAL = 16 * 1024
_PROMPT_KEYS = (b"prompt", b"content", b"text")
_QUOTE, _BACKSLASH = 0x22, 0x5C
_FINDS_PER_LITERAL = 16  # escaped quotes ended by bytes.find before numpy takes over
_LONGEST_RUN = 8  # backslashes before a quote; a longer run (rare in text) and the body is parsed whole
_NUMPY_SCANS = 8  # strings of many escaped quotes per body ended with numpy; past that the body is parsed whole
_FIRST_WINDOW = 4096
# A marker a client cannot write by chance: unique to this process.
_MARK = f"\x00disagg-raw-text:{secrets.token_hex(8)}:"
_MARK_LITERAL = orjson.dumps(_MARK)[:-1]  # '"\u0000disagg-raw-text:...:' without the closing quote
_PLACEHOLDER_LITERAL = orjson.dumps(_MARK + "here")  # where encode() puts a literal
_PLACEHOLDER = orjson.Fragment(_PLACEHOLDER_LITERAL)


class RawText:
    """A long prompt string of the client's body, kept as its JSON literal: never decoded, sent on as it came."""

    __slots__ = ("literal",)

    def __init__(self, literal: memoryview) -> None:
        self.literal = literal  # a view of the client's body: quotes, escapes and UTF-8 as the client wrote them

    @property
    def size(self) -> int:
        """Bytes between the quotes: the text's characters for ASCII (an escape counts its bytes), its UTF-8 size
        otherwise; the routers' token estimate reads it like a length."""
        return len(self.literal) - 2

    def prefix(self, chars: int) -> str:
        """The text's first ``chars`` characters, decoded from the literal's first bytes only."""
        if chars <= 0:
            return ""
        last = len(self.literal) - 1  # the closing quote
        # ASCII first; then room for the widest character: 12 bytes of literal (a surrogate pair of \u escapes).
        for budget in (chars + 16, 12 * chars + 12):
            end = min(last, 1 + budget)
            text = self._decoded_before(end)
            if len(text) >= chars or end == last:
                break
        return text[:chars]

    def _decoded_before(self, end: int) -> str:
        for cut in range(end, max(1, end - 12), -1):  # back off a cut inside an escape or a UTF-8 sequence
            try:
                return str(orjson.loads(bytes(self.literal[:cut]) + b'"'))
            except orjson.JSONDecodeError:
                continue
        # Not a valid string (the worker will refuse it): a best-effort key, so that routing still works.
        return bytes(self.literal[1:end]).decode("utf-8", "replace")

    def __repr__(self) -> str:
        return f"RawText({self.size} bytes)"


def parse_client_body(raw: bytes) -> dict[str, Any]:
    """The client's JSON object, its long prompt strings as ``RawText``; ``InvalidRequestError`` as
    ``frontend.http.parse_json_object`` says."""
    if len(raw) >= MIN_BODY:
        parsed = _parse_keeping_literals(raw)
        if parsed is not None:
            return parsed
    return parse_json_object(raw)


def encode(body: Any) -> Body:
    """``body`` as JSON: bytes, or chunks with each ``RawText``'s literal as a chunk of its own, never copied."""
    texts: list[RawText] = []

    def placeholder(value: object) -> orjson.Fragment:
        if isinstance(value, RawText):
            texts.append(value)  # in the order orjson writes them
            return _PLACEHOLDER
        raise TypeError(f"{type(value).__name__} is not JSON serializable")

    encoded = orjson.dumps(body, default=placeholder)
    if not texts:
        return encoded
    chunks: list[bytes | memoryview] = []
    at = 0
    for text in texts:
        where = encoded.index(_PLACEHOLDER_LITERAL, at)
        chunks += [encoded[at:where], text.literal]
        at = where + len(_PLACEHOLDER_LITERAL)
    chunks.append(encoded[at:])
    return tuple(chunks)


def _parse_keeping_literals(raw: bytes) -> dict[str, Any] | None:
    spans = _long_prompt_literals(raw)
    if not spans:
        return None
    pieces: list[bytes] = []
    at = 0
    for index, (start, end) in enumerate(spans):
        pieces += [raw[at:start], _MARK_LITERAL, str(index).encode(), b'"']
        at = end + 1
    pieces.append(raw[at:])
    try:
        parsed = orjson.loads(b"".join(pieces))
    except orjson.JSONDecodeError:
        return None  # the full parse says what is wrong
    if not isinstance(parsed, dict):
        return None
    view = memoryview(raw)
    texts = [RawText(view[start:end + 1]) for start, end in spans]
    return parsed if _put_back(parsed, texts) else None


def _put_back(body: dict[str, Any], texts: list[RawText]) -> bool:
    """Each marker replaced by its text, at a prompt position; False unless every text went back exactly once."""
    placed: set[int] = set()

    def text_for(value: object) -> RawText | None:
        if not (isinstance(value, str) and value.startswith(_MARK)):
            return None
        index = int(value[len(_MARK):])
        if index in placed:
            raise ValueError("a marker twice")
        placed.add(index)
        return texts[index]

    try:
        found = text_for(body.get("prompt"))
        if found is not None:
            body["prompt"] = found
        messages = body.get("messages")
        for message in messages if isinstance(messages, list) else ():
            if not isinstance(message, dict):
                continue
            content = message.get("content")
            found = text_for(content)
            if found is not None:
                message["content"] = found
            elif isinstance(content, list):
                for part in content:
                    if isinstance(part, dict) and (found := text_for(part.get("text"))) is not None:
                        part["text"] = found
    except (ValueError, IndexError):
        return False
    return len(placed) == len(texts)


def _long_prompt_literals(raw: bytes) -> list[tuple[int, int]] | None:
    """(opening quote, closing quote) of each long literal that is the value of a prompt-ish key, in order; None
    when the body is better parsed whole (``_Walk`` says when)."""
    try:
        return _Walk(raw).long_prompt_literals()
    except _GiveUp:
        return None


class _GiveUp(Exception):
    """The walk stops and the body is parsed whole: that is cheaper, or the only reading that is surely right."""


class _Walk:
    """From literal to literal through a body, within a budget that keeps it cheaper than parsing whole whatever
    the client sent: one ``find`` per literal and per escaped quote, on average no more than one per 512 bytes;
    no run of more than ``_LONGEST_RUN`` backslashes before a quote; at most ``_NUMPY_SCANS`` strings of many
    escaped quotes, each scanned in windows that start small and double (so a short one costs little and a long one
    in proportion to its length). Past any of these it gives up."""

    def __init__(self, raw: bytes) -> None:
        self.raw = raw
        self.finds_left = max(64, len(raw) >> 9)
        self.numpy_scans_left = _NUMPY_SCANS
        self._data: np.ndarray[Any, np.dtype[np.uint8]] | None = None

    def long_prompt_literals(self) -> list[tuple[int, int]]:
        raw = self.raw
        spans: list[tuple[int, int]] = []
        previous_start = previous_end = -1  # the literal before: the key, when this one is a member's value
        at = 0
        while True:
            start = self._find_quote(at)
            if start < 0:
                return spans
            end = self.closing_quote(start)
            if (end - start > MIN_LITERAL and raw[previous_end + 1:start].strip() == b":"
                    and raw[previous_start + 1:previous_end] in _PROMPT_KEYS):
                spans.append((start, end))
            previous_start, previous_end = start, end
            at = end + 1

    def closing_quote(self, opening: int) -> int:
        """The ``"`` that ends the literal opened at ``opening``: the first that a backslash does not escape."""
        raw = self.raw
        at = opening + 1
        for _ in range(_FINDS_PER_LITERAL):
            quote = self._find_quote(at)
            if quote < 0:
                raise _GiveUp  # unterminated: the full parse says so
            run = 0
            while raw[quote - 1 - run] == _BACKSLASH:  # raw[opening] is a quote: no run reaches past it
                run += 1
                if run > _LONGEST_RUN:
                    raise _GiveUp
            if run % 2 == 0:
                return quote
            at = quote + 1
        return self.closing_quote_by_numpy(opening, at)

    def closing_quote_by_numpy(self, opening: int, at: int) -> int:
        """``closing_quote`` from ``at`` on for a text with many escaped quotes: each window's quotes found at
        once, and for each the run of backslashes before it."""
        self.numpy_scans_left -= 1
        if self.numpy_scans_left < 0:
            raise _GiveUp
        if self._data is None:
            self._data = np.frombuffer(self.raw, np.uint8)
        data = self._data
        window = _FIRST_WINDOW
        while at < data.size:
            end = min(data.size, at + window)
            quotes = np.flatnonzero(data[at:end] == _QUOTE) + at
            if quotes.size:
                escaped = np.zeros(quotes.size, dtype=bool)
                in_run = np.ones(quotes.size, dtype=bool)
                for back in range(1, _LONGEST_RUN + 2):
                    in_run &= data[np.maximum(quotes - back, opening)] == _BACKSLASH  # data[opening] is a quote
                    if not in_run.any():
                        break
                    if back <= _LONGEST_RUN:
                        escaped ^= in_run
                # A quote after a longer run is not counted: the walk gives up if the answer depends on it.
                settled = np.flatnonzero(~(escaped | in_run))
                unsettled = np.flatnonzero(in_run)
                if unsettled.size and (not settled.size or unsettled[0] < settled[0]):
                    raise _GiveUp
                if settled.size:
                    return int(quotes[settled[0]])
                at = int(quotes[-1]) + 1
            else:
                at = end
            window *= 2
        raise _GiveUp  # unterminated

    def _find_quote(self, at: int) -> int:
        self.finds_left -= 1
        if self.finds_left < 0:
            raise _GiveUp  # many short strings or escaped quotes: parsing whole is cheaper
        return self.raw.find(b'"', at)
