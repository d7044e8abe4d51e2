"""The Responses API's memory at the orchestrator: continue a stored conversation, keep a new answer.

It lives here because the orchestrator alone sees both a client's request, before CTX, and its whole answer: a
follow-up is expanded into its conversation here, so workers never see ``previous_response_id``. What is kept,
when, and what a store outage does: docs/conformance.md#stored-responses."""

from __future__ import annotations

import logging
import re
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import orjson

from frontend.config import ResponseStoreConfig
from frontend.errors import (
    InvalidRequestError,
    RelayedError,
    ResponseNotFoundError,
    ResponseStoreUnavailableError,
    UnsupportedParameterError,
)
from frontend.sse import FrameSplitter, close_frames
from orchestrator.flow.request import Answer, StreamedAnswer, WholeAnswer
from orchestrator.response_store import MemoryResponseStore, ResponseStore, StoredResponse

logger = logging.getLogger(__name__)

_FINAL_EVENTS = (b"event: response.completed\n", b"event: response.incomplete\n")
_ITEM_PARAM = re.compile(r"input\.(\d+)(.*)", re.DOTALL)  # a worker's error about one input item


class ResponseMemory:
    def __init__(self, config: ResponseStoreConfig, store: ResponseStore | None = None) -> None:
        self.config = config
        self.store: ResponseStore = store if store is not None else MemoryResponseStore(config)

    async def begin(self, body: dict[str, Any], owner: str = "") -> ResponsesTurn:
        """The turn ``body`` asks for: the body the workers get (the whole conversation when it continues a
        stored one), and whether its answer is kept. ``owner``: the tenant asking ("" for none); it continues
        only what it stored, and what it stores is its own."""
        previous_id = body.get("previous_response_id")
        store = body.get("store")
        if previous_id is not None and not isinstance(previous_id, str):
            raise InvalidRequestError("'previous_response_id' must be a string", param="previous_response_id")
        if store is not None and not isinstance(store, bool):
            raise InvalidRequestError("'store' must be a boolean", param="store")
        if not self.config.enabled:
            self._refuse_when_off(previous_id, store)
        keep = self.config.enabled and (store if store is not None else self.config.store_by_default)
        if previous_id is None:
            return ResponsesTurn(body, _items_of(body.get("input")), self.store if keep else None, 0, owner=owner)
        new_items = [] if body.get("input") is None else _items_of(body["input"])
        if new_items is None:
            raise InvalidRequestError("'input' must be a string or a list of input items", param="input")
        entry = await self._entry_of(previous_id, owner)
        stored: list[Any] = orjson.loads(entry.conversation)
        continued = {name: value for name, value in body.items() if name != "previous_response_id"}
        continued["input"] = items = [*stored, *new_items]
        return ResponsesTurn(continued, items, self.store if keep else None, len(stored),
                             entry.session or previous_id, owner)

    async def stored(self, response_id: str, owner: str = "") -> StoredResponse:
        """A stored response (``GET /v1/responses/{id}``); a 404 if unknown, evicted, expired or deleted."""
        entry = await self.store.get(response_id)
        if entry is None or entry.owner != owner:  # another tenant's is as unknown as one never stored
            raise ResponseNotFoundError(f"Response with id '{response_id}' not found.")
        return entry

    async def _entry_of(self, previous_id: str, owner: str) -> StoredResponse:
        entry = await self.store.get(previous_id)
        if entry is None or entry.owner != owner:
            raise ResponseNotFoundError(f"Previous response with id '{previous_id}' not found.",
                                        param="previous_response_id", code="previous_response_not_found")
        return entry

    async def delete(self, response_id: str, owner: str = "") -> None:
        await self.stored(response_id, owner)  # another tenant's: a 404, and nothing deleted
        if not await self.store.delete(response_id):
            raise ResponseNotFoundError(f"Response with id '{response_id}' not found.")

    @staticmethod
    def _refuse_when_off(previous_id: str | None, store: bool | None) -> None:
        why = "this orchestrator stores no responses (response_store.max_entries is 0, or it runs several " \
              "front-end processes: --api-workers > 1)"
        if previous_id is not None:
            raise UnsupportedParameterError(f"'previous_response_id' cannot be used: {why}",
                                            param="previous_response_id")
        if store:
            raise UnsupportedParameterError(f"'store: true' cannot be honoured: {why}", param="store")


def _items_of(value: Any) -> list[Any] | None:
    """A request's input as a list of items (a string is one user message); None if it is neither."""
    if isinstance(value, str):
        return [{"role": "user", "content": value}]
    return value if isinstance(value, list) else None


@dataclass(frozen=True, slots=True)
class ResponsesTurn:
    body: dict[str, Any]  # what the workers get
    input_items: list[Any] | None  # the conversation up to this turn's answer
    store: ResponseStore | None  # where its answer is kept; None: not kept
    stored_items: int  # how many of ``input_items`` came from the store, before the client's own
    # The conversation's key for routing (its first response's id); None for a first turn, whose answer
    # starts one.
    session: str | None = None
    owner: str = ""  # the tenant whose turn it is: its answer is stored as theirs

    async def answer(self, run: Callable[[], Awaitable[Answer]]) -> Answer:
        """``run``'s answer, kept once complete. A worker's error about an item names it as the client counted
        it: the worker counted the stored items first."""
        try:
            answer = await run()
        except RelayedError as exc:
            raise self._counted_as_sent(exc) from exc
        return await self.remember(answer)

    def _counted_as_sent(self, error: RelayedError) -> RelayedError:
        try:
            body = orjson.loads(error.content)
            fields = body["error"]
            param = fields["param"]
        except (orjson.JSONDecodeError, KeyError, TypeError):
            return error
        item = _ITEM_PARAM.fullmatch(param) if self.stored_items and isinstance(param, str) else None
        if item is None or int(item[1]) < self.stored_items:
            return error
        fields["param"] = renamed = f"input.{int(item[1]) - self.stored_items}{item[2]}"
        if isinstance(fields.get("message"), str):
            fields["message"] = fields["message"].replace(param, renamed)
        return RelayedError(error.status_code, orjson.dumps(body))

    async def remember(self, answer: Answer) -> Answer:
        """``answer``, kept in the store once complete (a stream: as its final event passes)."""
        if self.store is None or self.input_items is None:
            return answer
        if isinstance(answer, WholeAnswer):
            await self._keep(answer.content)
            return answer
        return StreamedAnswer(self._kept_when_complete(answer.frames), answer.close_upstream)

    async def _kept_when_complete(self, frames: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
        splitter = FrameSplitter()
        try:
            async for chunk in frames:
                for frame in splitter.feed(chunk):
                    if frame.startswith(_FINAL_EVENTS):
                        await self._keep_event(frame)
                yield chunk
        finally:
            await close_frames(frames)

    async def _keep_event(self, frame: bytes) -> None:
        try:
            event = orjson.loads(frame.split(b"\ndata: ", 1)[1])
            response = event["response"]
        except (IndexError, KeyError, TypeError, orjson.JSONDecodeError):
            logger.warning("a Responses stream ended with an unreadable final event; the response is not stored")
            return
        await self._keep(orjson.dumps(response), response)

    async def _keep(self, content: bytes, response: Any = None) -> None:
        assert self.store is not None and self.input_items is not None
        if response is None:
            response = orjson.loads(content)
        response_id, output = response.get("id"), response.get("output")
        if not isinstance(response_id, str) or not isinstance(output, list):
            logger.warning("a Responses answer without an id or output list; it is not stored")
            return
        try:
            kept = await self.store.put(response_id, content, orjson.dumps([*self.input_items, *output]),
                                        self.session or "", self.owner)
        except ResponseStoreUnavailableError:
            return  # the answer is delivered all the same; the store logged and counted its failure
        if not kept:
            logger.warning("response %s is larger than response_store.max_bytes; it is not stored", response_id)
