"""Smoke run of ``bench.client_body_parse``: both ways of reading a body, every kind of text, a few rounds; the
figures come from ``python -m bench.client_body_parse``."""

from __future__ import annotations

import pytest

from bench import client_body_parse


def test_both_ways_are_measured_for_every_kind_of_text(capsys: pytest.CaptureFixture[str]) -> None:
    assert client_body_parse.main(["--chars", "100000", "--rounds", "2"]) == 0
    table = capsys.readouterr().out
    for kind in client_body_parse.texts(1000):
        assert f"| {kind} |" in table


def test_the_texts_are_what_they_say() -> None:
    plain, lines, quoted = client_body_parse.texts(10_000).values()
    assert len(plain) == len(lines) == len(quoted) == 10_000
    assert "\n" not in plain and lines.count("\n") == 124 and '"' not in lines
    assert quoted.count('"') == 19
