"""Tracing across real processes: one client request, one trace, every span parented where it belongs.

The orchestrator, a CTX and a GEN worker (reference engine, tiny model, each with its engine core) run as
``disagg-serve`` subprocesses that export to a real OTLP/HTTP receiver on loopback (tests/otlp_receiver.py).
The orchestrator is pointed at it with ``--otlp-endpoint``, the workers with the standard variables.
"""

from __future__ import annotations

import os
import secrets
import subprocess
import sys
from collections.abc import AsyncGenerator, AsyncIterator, Iterator
from pathlib import Path

import openai
import pytest

from bench.driver.common import Processes, child_env, free_port, orchestrator_config, wait_healthy, worker_args
from frontend import tracing
from tests.otlp_receiver import OtlpReceiver, ReceivedSpan, otlp_receiver
from tests.span_capture import captured_spans
from tests.waiting import eventually
from tests.workers.engines.reference.tiny_model import write_tiny_model

REPO = Path(__file__).resolve().parents[2]
_OTEL_VARIABLES = (tracing.ENDPOINT_ENV, tracing.TRACES_ENDPOINT_ENV, tracing.SERVICE_NAME_ENV)


@pytest.fixture(autouse=True)
def _no_stray_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in list(os.environ):
        if name.startswith(("DISAGG_", "OTEL_")) or name == "PROMETHEUS_MULTIPROC_DIR":
            monkeypatch.delenv(name)


def test_off_by_default_no_span_is_made_and_the_sdk_is_never_imported() -> None:
    script = (
        "import sys\n"
        "import entrypoints.cli, orchestrator.server, workers.server, workers.engines.reference.core\n"
        "from frontend import tracing\n"
        "assert tracing.configure('x', 'orchestrator') is False\n"
        "assert tracing.start('a', {'traceparent': '00-' + '1' * 32 + '-' + '2' * 16 + '-01'}) is None\n"
        "with tracing.span('b') as s:\n"
        "    assert s is None\n"
        "assert tracing.current_traceparent() is None\n"
        # (FastAPI itself imports the OpenTelemetry API; the SDK and the exporter load only with an endpoint.)
        "loaded = sorted(m for m in sys.modules if m.startswith(('opentelemetry.sdk', 'opentelemetry.exporter')))\n"
        "assert loaded == [], loaded\n"
    )
    env = {k: v for k, v in child_env().items() if not k.startswith(("OTEL_", "DISAGG_"))}
    result = subprocess.run([sys.executable, "-c", script], cwd=REPO, env=env, capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 0, result.stderr


@pytest.fixture
def receiver() -> Iterator[OtlpReceiver]:
    with otlp_receiver() as running:
        yield running


def _by_name(spans: list[ReceivedSpan], role: str, name: str) -> ReceivedSpan:
    found = [s for s in spans if s.role == role and s.name == name]
    assert len(found) == 1, (role, name, [(s.role, s.name) for s in spans])
    return found[0]


def test_one_streamed_request_is_one_trace_across_orchestrator_ctx_gen_and_engine_cores(
        tmp_path: Path, receiver: OtlpReceiver) -> None:
    model = write_tiny_model(tmp_path / "tiny.gguf", seed=0)
    # Export every 50 ms instead of every 5 s: the test waits on the receiver, never on the clock.
    otel = {tracing.ENDPOINT_ENV: receiver.endpoint, "OTEL_BSP_SCHEDULE_DELAY": "50"}
    ctx_port, gen_port, orch_port = free_port(), free_port(), free_port()
    engine = ("--model", str(model), "--blas-threads", "1")
    with Processes(log_dir=tmp_path) as processes:
        ctx = processes.disagg_serve("ctx", worker_args("context", "reference", ctx_port, *engine), ctx_port,
                                     child_env(**otel))
        gen = processes.disagg_serve("gen", worker_args("generation", "reference", gen_port, *engine), gen_port,
                                     child_env(**otel, OTEL_SERVICE_NAME="gen-under-test"))
        config = orchestrator_config(tmp_path / "orchestrator.yaml", orch_port, [ctx.url], [gen.url])
        orchestrator = processes.disagg_serve(
            "orchestrator", ["--otlp-endpoint", receiver.endpoint, "orchestrator", "--config", str(config)],
            orch_port, child_env(OTEL_BSP_SCHEDULE_DELAY="50"))
        wait_healthy([ctx, gen, orchestrator], timeout_s=180)

        client_trace, client_span = secrets.token_hex(16), secrets.token_hex(8)
        with openai.OpenAI(base_url=orchestrator.url + "/v1", api_key="x", max_retries=0, timeout=120) as client:
            stream = client.chat.completions.create(
                model="tiny", messages=[{"role": "user", "content": "Hello there"}], max_tokens=6, temperature=0,
                stream=True, extra_headers={"traceparent": f"00-{client_trace}-{client_span}-01"})
            chunks = list(stream)
        assert chunks

        expected = {("orchestrator", "orchestrator chat"), ("context", "context chat"),
                    ("generation", "generation chat"), ("engine-core", "engine_core.kv_fetch"),
                    ("engine-core", "kv_handoff.park"), ("generation", "stream"), ("orchestrator", "stream")}
        assert eventually(lambda: expected <= {(s.role, s.name) for s in receiver.received()}), \
            sorted({(s.role, s.name) for s in receiver.received()})

    spans = receiver.received()
    assert {s.trace_id for s in spans} == {client_trace}  # one trace: the client's
    root = _by_name(spans, "orchestrator", "orchestrator chat")
    assert root.parent_span_id == client_span and root.service == "disagg-serve-orchestrator"
    for step in ("admission", "ctx.call", "handoff", "gen.call", "stream"):
        assert _by_name(spans, "orchestrator", step).parent_span_id == root.span_id, step

    ctx_call = _by_name(spans, "orchestrator", "ctx.call")
    ctx_server = _by_name(spans, "context", "context chat")
    assert ctx_server.parent_span_id == ctx_call.span_id and ctx_server.service == "disagg-serve-context"
    prefill = _by_name(spans, "context", "prefill")
    assert prefill.parent_span_id == ctx_server.span_id
    core_prefill = [s for s in spans if s.name == "engine_core.prefill"]
    assert [s.parent_span_id for s in core_prefill] == [prefill.span_id]
    park = _by_name(spans, "engine-core", "kv_handoff.park")
    assert park.parent_span_id == core_prefill[0].span_id and park.attributes["kv.bytes"] > 0

    handoff = _by_name(spans, "orchestrator", "handoff")
    assert handoff.attributes["disagg.carriage"] == "ctx_tokens" and handoff.attributes["disagg.prompt_b64_bytes"] > 0

    gen_call = _by_name(spans, "orchestrator", "gen.call")
    gen_server = _by_name(spans, "generation", "generation chat")
    assert gen_server.parent_span_id == gen_call.span_id and gen_server.service == "gen-under-test"
    first_token = _by_name(spans, "generation", "first_token")
    assert first_token.parent_span_id == gen_server.span_id
    fetch = _by_name(spans, "engine-core", "engine_core.kv_fetch")
    assert fetch.parent_span_id == first_token.span_id
    assert fetch.attributes["kv.bytes"] == park.attributes["kv.bytes"]  # what CTX parked is what GEN fetched
    gen_stream = _by_name(spans, "generation", "stream")
    assert gen_stream.parent_span_id == gen_server.span_id and gen_stream.attributes["disagg.stream.chunks"] > 0


async def test_a_stream_the_client_leaves_is_marked_left_not_failed(monkeypatch: pytest.MonkeyPatch) -> None:
    async def frames() -> AsyncIterator[bytes]:
        for _ in range(3):
            yield b"data: {}\n\n"

    with captured_spans(monkeypatch) as exported:
        request = tracing.start("request", None)
        stream = tracing.traced_frames("stream", request, frames())
        assert isinstance(stream, AsyncGenerator)
        assert await anext(stream) == b"data: {}\n\n"
        await stream.aclose()  # what the server does when the client disconnects
        (span,) = [span for span in exported.get_finished_spans() if span.name == "stream"]
        assert span.attributes is not None and span.attributes["disagg.client_left"] is True
        assert span.status.is_ok  # unset, not ERROR
