"""A GEN answer's account of its prompt, as written by the worker and read by the orchestrator."""

from __future__ import annotations

import pytest

from frontend.prompt_report import PromptReport, read_prompt_report


def test_a_report_reads_back_as_written() -> None:
    report = PromptReport(received=4096, computed=17)
    assert report.header_value() == "received=4096, computed=17"
    assert read_prompt_report(report.header_value()) == report
    assert read_prompt_report(report.header_value().encode("latin-1")) == report


@pytest.mark.parametrize("value", [None, "", "received=1", "received=1, computed=x", "received=-1, computed=0",
                                   "received=1, computed=2, extra=3", "computed 2", "received=1; computed=2",
                                   # digits int() refuses: a superscript (a latin-1 byte), more than it reads
                                   b"received=1, computed=\xb2", "received=1, computed=" + "9" * 5000])
def test_anything_else_is_no_report_rather_than_an_error(value: str | bytes | None) -> None:
    # A worker of another make sends none, and a malformed one must never fail the client's answer.
    assert read_prompt_report(value) is None
