"""Distributed tracing with OpenTelemetry: opt-in, and free when off.

Until ``configure`` finds an OTLP endpoint the SDK is not imported and every hook returns at its first line. Spans
are parented explicitly (by a span, or the carrier it arrived in), never through ambient state, except ``use``,
which makes a span current for the engine adapter below it. See docs/observability.md."""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import os
from collections.abc import AsyncIterator, Mapping
from contextlib import AbstractContextManager
from types import TracebackType
from typing import TYPE_CHECKING, Any

from frontend.sse import close_frames

if TYPE_CHECKING:
    from opentelemetry.trace import Span, Tracer

TRACEPARENT = "traceparent"
ENDPOINT_ENV = "OTEL_EXPORTER_OTLP_ENDPOINT"
TRACES_ENDPOINT_ENV = "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"
SERVICE_NAME_ENV = "OTEL_SERVICE_NAME"

_tracer: Tracer | None = None
_shutdown: list[Any] = []  # the provider's shutdown, once configured


def configure(service_name: str, role: str, endpoint: str | None = None) -> bool:
    """Turn tracing on for this process if an endpoint is known; True when on.

    ``endpoint`` is the collector's base URL (``http://collector:4318``; spans go to ``/v1/traces``), as the
    standard variable is. ``OTEL_SERVICE_NAME`` overrides ``service_name``; ``role`` is kept as the resource
    attribute ``disagg.role`` so processes stay apart even when they share one service name.
    """
    global _tracer
    if _tracer is not None:
        return True
    if not (endpoint or os.environ.get(ENDPOINT_ENV) or os.environ.get(TRACES_ENDPOINT_ENV)):
        return False
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    name = os.environ.get(SERVICE_NAME_ENV) or service_name
    provider = TracerProvider(resource=Resource.create({"service.name": name, "disagg.role": role}))
    # Given explicitly, the exporter takes the URL as it is; otherwise it reads the standard variables itself.
    exporter = OTLPSpanExporter(endpoint=endpoint.rstrip("/") + "/v1/traces") if endpoint else OTLPSpanExporter()
    provider.add_span_processor(BatchSpanProcessor(exporter))  # exports from its own thread, never the loop's
    _tracer = provider.get_tracer("disagg-serve")
    _shutdown.append(provider.shutdown)
    atexit.register(shutdown)
    return True


def enabled() -> bool:
    return _tracer is not None


def shutdown() -> None:
    """Export what is buffered and stop (a process's last act; also at exit)."""
    global _tracer
    _tracer = None
    while _shutdown:
        _shutdown.pop()()


def start(name: str, parent: Any = None, attributes: Mapping[str, Any] | None = None, *,
          server: bool = False, client: bool = False) -> Span | None:
    """A started span (end it with ``end``), or None when tracing is off. ``parent``: a span of this process,
    or where a remote one arrived: request headers, or a ``traceparent`` string (from an IPC frame)."""
    if _tracer is None:
        return None
    from opentelemetry.trace import SpanKind

    kind = SpanKind.SERVER if server else SpanKind.CLIENT if client else SpanKind.INTERNAL
    return _tracer.start_span(name, context=_context_of(parent), kind=kind, attributes=attributes)


def end(span: Span | None, attributes: Mapping[str, Any] | None = None,
        error: BaseException | str | None = None) -> None:
    if span is None:
        return
    if attributes:
        span.set_attributes(attributes)
    if error is not None:
        from opentelemetry.trace import Status, StatusCode

        text = error if isinstance(error, str) else f"{type(error).__name__}: {error}"
        span.set_status(Status(StatusCode.ERROR, text[:200]))
    span.end()


class _Scope:
    """``with`` one span: ended on the way out, marked failed if an exception escaped."""

    __slots__ = ("span",)

    def __init__(self, span: Span | None) -> None:
        self.span = span

    def __enter__(self) -> Span | None:
        return self.span

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None,
                 traceback: TracebackType | None) -> None:
        end(self.span, error=error)


_OFF = _Scope(None)  # one shared instance: a hook costs no allocation when tracing is off


def span(name: str, parent: Any = None, attributes: Mapping[str, Any] | None = None, *,
         headers: dict[str, str] | None = None, client: bool = False) -> AbstractContextManager[Span | None]:
    """``with tracing.span(...) as s:`` a child of ``parent``; with ``headers``, the span's ``traceparent`` is
    written into them for the call it wraps."""
    if _tracer is None:
        return _OFF
    started = start(name, parent, attributes, client=client)
    if headers is not None:
        inject(started, headers)
    return _Scope(started)


def traced_frames(name: str, parent: Span | None, frames: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
    """``frames`` under a span that ends with the stream (``frames`` itself when there is no parent span)."""
    if parent is None:
        return frames
    return _traced_frames(name, parent, frames)


async def _traced_frames(name: str, parent: Span, frames: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
    stream = start(name, parent)
    count, size, failure, left = 0, 0, None, False
    try:
        async for frame in frames:
            count += 1
            size += len(frame)
            yield frame
    except (GeneratorExit, asyncio.CancelledError):
        left = True  # the client went away: the stream ended early, but nothing failed
        raise
    except BaseException as exc:
        failure = exc
        raise
    finally:
        end(stream, {"disagg.stream.chunks": count, "disagg.stream.bytes": size, "disagg.client_left": left},
            failure)
        await close_frames(frames)


def set_attributes(span: Span | None, attributes: Mapping[str, Any]) -> None:
    if span is not None:
        span.set_attributes(attributes)


def inject(span: Span | None, headers: dict[str, str]) -> None:
    """Write ``span``'s ``traceparent`` into outgoing ``headers`` (nothing when tracing is off)."""
    if span is not None:
        headers[TRACEPARENT] = traceparent_of(span)


def traceparent_of(span: Span) -> str:
    context = span.get_span_context()
    return f"00-{context.trace_id:032x}-{context.span_id:016x}-{int(context.trace_flags):02x}"


def use(span: Span | None) -> AbstractContextManager[None]:
    """Make ``span`` current for code below an interface that cannot carry it (the engine adapter)."""
    return _OFF_USE if span is None else _Current(span)


class _Current:
    __slots__ = ("span", "token")

    def __init__(self, span: Span) -> None:
        self.span = span
        self.token: object = None

    def __enter__(self) -> None:
        from opentelemetry import context, trace

        self.token = context.attach(trace.set_span_in_context(self.span))

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None,
                 traceback: TracebackType | None) -> None:
        from opentelemetry import context

        context.detach(self.token)  # type: ignore[arg-type]


_OFF_USE = contextlib.nullcontext()


def current_traceparent() -> str | None:
    """The current span's ``traceparent`` (see ``use``), or None: for IPC frames to an engine core."""
    if _tracer is None:
        return None
    from opentelemetry import trace

    span = trace.get_current_span()
    return traceparent_of(span) if span.get_span_context().is_valid else None


def _context_of(parent: Any) -> Any:
    from opentelemetry import trace
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

    if parent is None:
        return None
    if isinstance(parent, trace.Span):
        return trace.set_span_in_context(parent)
    if isinstance(parent, str):
        parent = {TRACEPARENT: parent}
    value = parent.get(TRACEPARENT)  # Starlette's headers are case-insensitive; plain dicts use this name
    if value is None:
        return None
    return TraceContextTextMapPropagator().extract({TRACEPARENT: value})
