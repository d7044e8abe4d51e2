"""Smoke run of ``bench.loopback_floor``: real processes and sockets, a few rounds; the figures come from
``python -m bench.loopback_floor``."""

from __future__ import annotations

import pytest

from bench import loopback_floor


def test_the_floor_is_measured_and_printed(capsys: pytest.CaptureFixture[str]) -> None:
    assert loopback_floor.measure(100_000, rounds=20) >= 0.0
    assert loopback_floor.main(["--rounds", "5"]) == 0
    table = capsys.readouterr().out
    assert "| metadata-only at 131k (524 KB in, 524 KB out) | 524,366 |" in table
    assert "| b64 relay at 131k (1.2 MB in, 1.2 MB out) | 1,223,418 |" in table
