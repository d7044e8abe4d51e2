"""Log lines in both formats: a request's line written straight to the installed handler's stream reads as the
formatter would have written it, carries the request id, and goes through logging when someone else set it up."""

from __future__ import annotations

import io
import logging
import re
from collections.abc import Iterator

import orjson
import pytest

from frontend import logging_setup
from frontend.logging_setup import RequestLines, configure_logging, request_id_var

FIELDS: dict[str, object] = {"event": "request", "endpoint": "chat", "status": 200, "latency_ms": 1.25,
                             "ctx_worker": "http://ctx:1", "gen_worker": None}


@pytest.fixture
def restore_logging() -> Iterator[None]:
    root = logging.getLogger()
    handlers, level, installed = root.handlers[:], root.level, logging_setup._installed
    flags = (logging._srcfile, logging.logThreads, logging.logProcesses, logging.logMultiprocessing)
    httpx_level = logging.getLogger("httpx").level
    yield
    root.handlers[:] = handlers
    root.setLevel(level)
    logging_setup._installed = installed
    logging._srcfile, logging.logThreads, logging.logProcesses, logging.logMultiprocessing = flags
    logging.getLogger("httpx").setLevel(httpx_level)


def installed_stream(log_format: logging_setup.LogFormat) -> io.StringIO:
    configure_logging("info", log_format)
    stream = io.StringIO()
    handler = logging.getLogger().handlers[0]
    assert isinstance(handler, logging.StreamHandler)
    handler.setStream(stream)
    return stream


def test_a_json_request_line_has_the_formatters_keys_and_the_fields(restore_logging: None) -> None:
    stream = installed_stream("json")
    logger = logging.getLogger("disagg_serve.test")
    token = request_id_var.set("req-1")
    try:
        RequestLines(logger).write("request done", FIELDS)
        logger.info("request done", extra=FIELDS)  # the same line through logging, for comparison
    finally:
        request_id_var.reset(token)
    direct, through_logging = (orjson.loads(line) for line in stream.getvalue().splitlines())
    assert set(direct) == set(through_logging)
    for entry in (direct, through_logging):
        assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z", entry.pop("ts"))
    assert direct == through_logging
    assert direct["request_id"] == "req-1" and direct["status"] == 200 and direct["gen_worker"] is None


def test_a_text_request_line_reads_like_the_text_format_with_its_fields(restore_logging: None) -> None:
    stream = installed_stream("text")
    logger = logging.getLogger("disagg_serve.test")
    token = request_id_var.set("req-2")
    try:
        RequestLines(logger).write("request done", FIELDS)
    finally:
        request_id_var.reset(token)
    line = stream.getvalue()
    assert re.fullmatch(r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3} INFO disagg_serve\.test: request done "
                        r"request_id=req-2 event=request endpoint=chat status=200 latency_ms=1\.25 "
                        r"ctx_worker=http://ctx:1\n", line), line


def test_under_another_logging_set_up_the_line_goes_through_logging(restore_logging: None,
                                                                     caplog: pytest.LogCaptureFixture) -> None:
    stream = installed_stream("text")
    logging.getLogger().addHandler(caplog.handler)  # the root's handlers are no longer ours alone
    logger = logging.getLogger("disagg_serve.test")
    RequestLines(logger).write("request done", FIELDS)
    assert "request done" in stream.getvalue()  # our handler still gets it, through logging
    [record] = [r for r in caplog.records if r.name == "disagg_serve.test"]
    assert record.getMessage() == "request done" and record.__dict__["status"] == 200


def test_a_level_above_info_turns_request_lines_off(restore_logging: None) -> None:
    configure_logging("warning", "text")
    assert not RequestLines(logging.getLogger("disagg_serve.test")).enabled()


def test_a_stream_that_fails_sends_the_line_through_logging_and_the_request_goes_on(restore_logging: None) -> None:
    stream = installed_stream("text")
    stream.close()  # a closed stream: writing to it raises
    errors: list[logging.LogRecord] = []
    handler = logging.getLogger().handlers[0]
    handler.handleError = errors.append  # type: ignore[method-assign,assignment]  # what logging does with a failed line
    RequestLines(logging.getLogger("disagg_serve.test")).write("request done", FIELDS)
    assert [record.getMessage() for record in errors] == ["request done"]
