"""The engine core's spans, children of the worker's engine span whose ``traceparent`` came in the submit frame.

The core sees a request only as frames, so a span opens when a traced request's ``submit`` arrives and closes at its
first ``output`` or ``error``: ``engine_core.prefill``, ``kv_handoff.park`` and ``engine_core.kv_fetch``
(docs/observability.md). An untraced request costs one dict check per frame."""

from __future__ import annotations

from typing import TYPE_CHECKING

import orjson

from frontend import tracing
from workers.engines.reference.ipc import Header
from workers.engines.reference.kv_store import KVStore

if TYPE_CHECKING:
    from opentelemetry.trace import Span

SERVICE_NAME = "disagg-serve-engine-core"


class CoreSpans:
    def __init__(self) -> None:
        self._open: dict[str, Span] = {}  # request id -> its first span, until the first answer
        self._contexts: set[str] = set()  # open CTX requests: their hand-off is parked after the first answer
        # CTX requests of n > 1: the prefill span ended at the first sequence's frame, the hand-off state comes
        # with the last sequence's first frame.
        self._parking: dict[str, Span] = {}
        self.store: KVStore | None = None  # where CTX's hand-offs are parked (for their size)

    def submitted(self, header: Header) -> None:
        traceparent = header.get("traceparent")
        if traceparent is None or not tracing.enabled():
            return
        fetches = header.get("phase") == "generation_only"
        span = tracing.start("engine_core.kv_fetch" if fetches else "engine_core.prefill", str(traceparent),
                             {"disagg.engine_request_id": str(header.get("id")),
                              "disagg.prompt_tokens": int(header.get("prompt_len") or 0)})
        if span is not None:
            self._open[str(header.get("id"))] = span
            if header.get("phase") == "context_only":
                self._contexts.add(str(header.get("id")))

    def answered(self, header: Header) -> None:
        """Every frame the scheduler emits passes here (once per token): one dict check when nothing is open."""
        if not self._open and not self._parking:
            return
        request_id = str(header.get("id"))
        span = self._open.pop(request_id, None)
        if span is None:
            span = self._parking.pop(request_id, None)
            if span is not None:
                self._park_if_parked(span, request_id, header)
            return
        context = request_id in self._contexts
        self._contexts.discard(request_id)
        if header.get("op") == "error":
            tracing.end(span, {"disagg.error_kind": str(header.get("kind"))}, str(header.get("message")))
            return
        if header.get("handoff_bytes") is not None:
            span.set_attribute("kv.bytes", int(header["handoff_bytes"]))
        tracing.end(span)
        if not self._park_if_parked(span, request_id, header) and context and not header.get("done"):
            self._parking[request_id] = span  # n > 1: the state comes with a later sequence's first frame

    def _park_if_parked(self, prefill: Span, request_id: str, header: Header) -> bool:
        state = header.get("handoff_state")
        if isinstance(state, str) and header.get("op") == "output":
            self._parked(prefill, request_id, state)
            return True
        return False

    def _parked(self, prefill: Span, request_id: str, state: str) -> None:
        attributes: dict[str, int | str] = {}
        size = self.store.entry_bytes(request_id) if self.store is not None else None
        if size is not None:
            attributes["kv.bytes"] = size
        try:
            parsed = orjson.loads(state)
            attributes["kv.tokens"] = int(parsed["n_tokens"])
        except (orjson.JSONDecodeError, KeyError, TypeError, ValueError):
            pass  # the size is what matters; a state of another shape still gets its span
        tracing.end(tracing.start("kv_handoff.park", prefill, attributes))

    def forget(self, request_id: str) -> None:
        """An aborted request: its span ends, marked as such."""
        self._contexts.discard(request_id)
        self._parking.pop(request_id, None)
        span = self._open.pop(request_id, None)
        if span is not None:
            tracing.end(span, {"disagg.aborted": True})
