"""Shared fixtures: a tiny random model (fast, most tests) and the real SmolLM2 model (loaded once)."""

from __future__ import annotations

import os
import pathlib
import resource
import time
from dataclasses import dataclass

import pytest

from tests.workers.engines.reference.tiny_model import write_tiny_model
from workers.engines.reference.model_file import LoadedModelFile, ModelFileError, load_model_file
from workers.engines.reference.tokenizer import GGUFTokenizer
from workers.engines.reference.transformer import Transformer


@dataclass(frozen=True)
class Engine:
    loaded: LoadedModelFile
    tokenizer: GGUFTokenizer
    transformer: Transformer
    load_seconds: float
    rss_mb_after_load: float


def _engine(path: pathlib.Path | None) -> Engine:
    start = time.perf_counter()
    loaded = load_model_file(path)
    seconds = time.perf_counter() - start
    return Engine(
        loaded=loaded,
        tokenizer=GGUFTokenizer(loaded.tokenizer),
        transformer=Transformer(loaded.weights),
        load_seconds=seconds,
        rss_mb_after_load=_rss_mb(),
    )


def _rss_mb() -> float:
    try:
        for line in pathlib.Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


@pytest.fixture(scope="session")
def tiny_path(tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    return write_tiny_model(tmp_path_factory.mktemp("tiny") / "tiny.gguf", seed=0)


@pytest.fixture(scope="session")
def tiny(tiny_path: pathlib.Path) -> Engine:
    return _engine(tiny_path)


@pytest.fixture(scope="session")
def real() -> Engine:
    try:
        return _engine(None)
    except ModelFileError as exc:
        if os.environ.get("CI"):
            raise  # CI installs the model package: a missing model there is a failure, not a skip
        pytest.skip(str(exc))
