"""A chat template's render of a conversation, reusing what it rendered of the same conversation's earlier turns.

For a template that renders message by message (``template_shape``), a follow-up turn renders only the messages it
adds: the text is the previous render's up to the end of its loop, the new messages' pieces, and what follows the
loop. An entry is reused only when every one of its messages equals the request's message at the same place
(compared whole, so a rewritten earlier turn or another system prompt renders afresh) and the template's other
variables are the same; the text is identical to a whole render (tests/workers/tokenization). Bounded in bytes,
least recently used out first; any other template is rendered whole every time."""

from __future__ import annotations

import logging
import sys
import threading
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import jinja2

from workers.tokenization.template_shape import MessageWise, message_wise

log = logging.getLogger("disagg_serve.tokenization")

Message = Mapping[str, object]

_ENTRY_OVERHEAD_BYTES = 512  # the entry, its tuple of messages and their dicts' tables, the LRU's node
_PLAIN_VALUES = (str, bool, int, float, type(None))  # variables an entry can be compared and keyed by
_KEY_CHARS = 64  # of the first message's content, in the key that groups a conversation's entries


@dataclass(frozen=True, slots=True, eq=False)
class RenderedConversation:
    messages: tuple[dict[str, str], ...]  # the messages as rendered (copies, or an earlier entry's equal ones)
    variables: tuple[tuple[str, object], ...]  # the template's other variables but add_generation_prompt
    text: str  # the whole render (of some add_generation_prompt)
    before: str  # what precedes the loop in ``text``
    loop_end: int  # where the loop's last piece ends in ``text``
    first_piece: int  # the length of the first message's piece, as the loop renders it
    messages_bytes: int  # what the messages' strings hold
    nbytes: int = field(init=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "nbytes", sys.getsizeof(self.text) + self.messages_bytes + _ENTRY_OVERHEAD_BYTES)

    def continued_by(self, messages: Sequence[Message]) -> bool:
        """Whether ``messages`` starts with all of this entry's messages (the latest compared first: the cheap no)."""
        count = len(self.messages)
        if count > len(messages) or messages[count - 1] != self.messages[-1]:
            return False
        return self.messages == tuple(messages[:count])


@dataclass(frozen=True, slots=True)
class RenderStats:
    renders: int
    hits: int  # renders that reused an earlier turn's text
    reused_messages: int
    entries: int
    bytes: int
    max_bytes: int
    evictions: int


class ChatRenderer:
    """``render`` takes the variables ``jinja2.Template.render`` takes; thread-safe."""

    def __init__(self, template: jinja2.Template, source: str, max_bytes: int) -> None:
        self._template = template
        shape = message_wise(template.environment, source) if max_bytes > 0 else "the cache is off"
        self._shape: MessageWise | None = shape if isinstance(shape, MessageWise) else None
        if isinstance(shape, str) and max_bytes > 0:
            log.info("the chat template is rendered whole for every turn: %s", shape)
        self._max_bytes = max_bytes
        self._lock = threading.Lock()
        # key of a conversation's first message -> its entries; and every entry, least recently used first
        self._groups: dict[tuple[str, ...], list[RenderedConversation]] = {}
        self._lru: OrderedDict[int, tuple[tuple[str, ...], RenderedConversation]] = OrderedDict()
        self._ends: dict[tuple[object, ...], tuple[str, str]] = {}  # (before, after) per variables
        self._bytes = 0
        self._renders = self._hits = self._reused = self._evictions = 0
        # (the latest text built as an earlier render plus what follows it, that earlier render): one slot, read by
        # identity, so that the encoder finds the earlier render's ids without comparing texts
        self._last_extension: tuple[str, str] | None = None

    def render(self, *, messages: Sequence[Message], add_generation_prompt: bool = False, **variables: object) -> str:
        shape = self._shape
        if shape is None or not _plain(messages) or not all(type(v) in _PLAIN_VALUES for v in variables.values()):
            return self._template.render(messages=messages, add_generation_prompt=add_generation_prompt,
                                         **variables)
        ordered = tuple(sorted(variables.items()))
        key = _key(messages[0])
        before, after = self._ends_of(shape, add_generation_prompt, ordered, variables)
        earlier = self._find(key, messages, ordered, before)
        if earlier is None:
            pieces = shape.loop.render(messages=messages, **variables)
            first_piece = len(shape.loop.render(messages=messages[:1], **variables))
            text = before + pieces + after
            kept: tuple[dict[str, str], ...] = ()
            kept_bytes = 0
        else:
            kept, kept_bytes = earlier.messages, earlier.messages_bytes  # equal to the request's first messages
            added = shape.loop.render(messages=[messages[0], *messages[len(kept):]], **variables)
            first_piece = earlier.first_piece
            tail = added[first_piece:] + after
            earlier_after = earlier.text[earlier.loop_end:]
            if tail.startswith(earlier_after):  # e.g. the generation prompt, then the answer: one copy, no slice
                text = earlier.text + tail[len(earlier_after):]
                self._last_extension = (text, earlier.text)
            else:
                text = earlier.text[:earlier.loop_end] + tail
        loop_end = len(text) - len(after)
        new = tuple({name: str(value) for name, value in message.items()} for message in messages[len(kept):])
        new_bytes = sum(sys.getsizeof(value) for message in new for value in message.values())
        self._store(key, RenderedConversation(kept + new, ordered, text, before, loop_end, first_piece,
                                              kept_bytes + new_bytes), earlier)
        return text

    def extended(self, text: str) -> str | None:
        """The earlier render ``text`` starts with, when ``text`` is this renderer's latest answer built on it (by
        construction, not by comparison); None otherwise."""
        last = self._last_extension
        return last[1] if last is not None and last[0] is text else None

    def stats(self) -> RenderStats:
        with self._lock:
            return RenderStats(self._renders, self._hits, self._reused, len(self._lru), self._bytes,
                               self._max_bytes, self._evictions)

    def _ends_of(self, shape: MessageWise, add_generation_prompt: bool, ordered: tuple[tuple[str, object], ...],
                 variables: Mapping[str, object]) -> tuple[str, str]:
        """What precedes and follows the loop: they read no message, so one render per set of variables."""
        memo_key = (add_generation_prompt, ordered)
        ends = self._ends.get(memo_key)
        if ends is None:
            ends = (shape.before.render(add_generation_prompt=add_generation_prompt, **variables),
                    shape.after.render(add_generation_prompt=add_generation_prompt, **variables))
            with self._lock:
                if len(self._ends) < 64:  # a handful of variable sets in practice; never unbounded
                    self._ends[memo_key] = ends
        return ends

    def _find(self, key: tuple[str, ...], messages: Sequence[Message], ordered: tuple[tuple[str, object], ...],
              before: str) -> RenderedConversation | None:
        """The entry with the most messages that ``messages`` continues, rendered with the same variables and the
        same text before its loop (None: none)."""
        with self._lock:
            self._renders += 1
            candidates = list(self._groups.get(key, ()))
        best = None
        for entry in candidates:
            if (best is None or len(entry.messages) > len(best.messages)) and entry.variables == ordered \
                    and entry.before == before and entry.continued_by(messages):
                best = entry
        if best is not None:
            with self._lock:
                self._hits += 1
                self._reused += len(best.messages)
        return best

    def _store(self, key: tuple[str, ...], entry: RenderedConversation, earlier: RenderedConversation | None) -> None:
        """Keep ``entry``; the one it continues goes (the same conversation, a turn earlier)."""
        if entry.nbytes > self._max_bytes:
            return
        with self._lock:
            group = self._groups.setdefault(key, [])
            if earlier is not None and id(earlier) in self._lru:
                self._remove(earlier)
                group = self._groups.setdefault(key, [])
            group.append(entry)
            self._lru[id(entry)] = (key, entry)
            self._bytes += entry.nbytes
            while self._bytes > self._max_bytes:
                _, oldest = next(iter(self._lru.values()))
                self._remove(oldest)
                self._evictions += 1

    def _remove(self, entry: RenderedConversation) -> None:
        key, _ = self._lru.pop(id(entry))
        group = self._groups[key]
        del group[next(i for i, held in enumerate(group) if held is entry)]
        if not group:
            del self._groups[key]
        self._bytes -= entry.nbytes


def _plain(messages: Sequence[Message]) -> bool:
    """Whether the messages are dicts of strings (any other is rendered whole, never cached)."""
    if not messages:
        return False
    for message in messages:
        if type(message) is not dict:
            return False
        for value in message.values():
            if type(value) is not str:
                return False
    return True


def _key(first: Message) -> tuple[str, ...]:
    """A conversation's group: its first message's role and the ends of its content (cheap; the match is exact)."""
    content = str(first.get("content", ""))
    return (str(first.get("role", "")), str(len(content)), content[:_KEY_CHARS], content[-_KEY_CHARS:])
