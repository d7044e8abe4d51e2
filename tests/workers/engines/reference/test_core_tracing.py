"""The engine core's spans, cut from its frames: the prefill, and the park of a CTX hand-off, also for n > 1."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from frontend import tracing
from tests.span_capture import captured_spans
from workers.engines.reference.core_tracing import CoreSpans


@pytest.fixture
def exported(monkeypatch: pytest.MonkeyPatch) -> Iterator[InMemorySpanExporter]:
    with captured_spans(monkeypatch) as exporter:
        yield exporter


def _submit(spans: CoreSpans, phase: str) -> str:
    worker = tracing.start("worker", None)
    assert worker is not None
    spans.submitted({"op": "submit", "id": "r1", "phase": phase, "prompt_len": 5,
                     "traceparent": tracing.traceparent_of(worker)})
    return format(worker.get_span_context().trace_id, "032x")


def test_a_ctx_request_of_n_sequences_records_the_park_its_last_first_frame_carries(
        exported: InMemorySpanExporter) -> None:
    spans = CoreSpans()
    _submit(spans, "context_only")
    spans.answered({"op": "output", "id": "r1", "index": 0, "finish": None})  # sequence 0's first token
    spans.answered({"op": "output", "id": "r1", "index": 1, "finish": None, "done": True,
                    "handoff_state": '{"n_tokens": 5}'})  # sequence 1's, with the one hand-off of both
    finished = {span.name: span for span in exported.get_finished_spans()}
    prefill, park = finished["engine_core.prefill"], finished["kv_handoff.park"]
    assert park.parent is not None and park.parent.span_id == prefill.context.span_id
    assert park.attributes is not None and park.attributes["kv.tokens"] == 5
    spans.answered({"op": "output", "id": "r1", "index": 0, "finish": None})  # nothing open any more
    assert len(exported.get_finished_spans()) == len(finished)


def test_an_aggregated_request_ends_its_prefill_at_its_first_frame_and_parks_nothing(
        exported: InMemorySpanExporter) -> None:
    spans = CoreSpans()
    _submit(spans, "aggregated")
    spans.answered({"op": "output", "id": "r1", "index": 0, "finish": None})
    spans.answered({"op": "output", "id": "r1", "index": 1, "finish": None})
    assert [span.name for span in exported.get_finished_spans()] == ["engine_core.prefill"]


def test_an_abort_between_the_first_frames_forgets_the_pending_park(exported: InMemorySpanExporter) -> None:
    spans = CoreSpans()
    _submit(spans, "context_only")
    spans.answered({"op": "output", "id": "r1", "index": 0, "finish": None})
    spans.forget("r1")
    spans.answered({"op": "output", "id": "r1", "index": 1, "finish": None, "done": True,
                    "handoff_state": '{"n_tokens": 5}'})
    assert "kv_handoff.park" not in [span.name for span in exported.get_finished_spans()]
