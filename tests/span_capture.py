"""Spans captured in memory: ``frontend.tracing`` switched on for one test, with no collector involved."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import pytest
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from frontend import tracing


@contextmanager
def captured_spans(monkeypatch: pytest.MonkeyPatch) -> Iterator[InMemorySpanExporter]:
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))  # exported as each span ends: no flush to wait on
    monkeypatch.setattr(tracing, "_tracer", provider.get_tracer("test"))
    try:
        yield exporter
    finally:
        provider.shutdown()
