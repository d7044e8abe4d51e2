"""docs/engines.md's example engine is real: its code, taken from the page, registered with one line and served
by a real worker."""

from __future__ import annotations

import re
from pathlib import Path

import httpx
import pytest

from frontend.metrics import Metrics
from tests.servers import running
from workers.engines import factory
from workers.engines.base import Engine, HealthCheck, KVHandoffStore, ProvidesTokenizer
from workers.engines.options import EngineOptions
from workers.server import create_worker_app
from workers.settings import WorkerSettings

DOC = Path(__file__).parents[3] / "docs" / "engines.md"


def example_engine_source() -> str:
    section = DOC.read_text().split("## Adding an engine", 1)[1]
    match = re.search(r"```python\n(.*?)```", section, re.DOTALL)
    assert match is not None, "docs/engines.md lost its example engine"
    return match.group(1)


@pytest.fixture
def reverse_engine(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Engine:
    (tmp_path / "reverse_engine_from_the_docs.py").write_text(example_engine_source())
    monkeypatch.syspath_prepend(str(tmp_path))
    # The one line of registration the page describes.
    monkeypatch.setitem(factory.ENGINES, "reverse", "reverse_engine_from_the_docs")
    return factory.create_engine("reverse", EngineOptions(served_model_name="backwards"))


def test_the_example_has_only_the_capability_it_claims(reverse_engine: Engine) -> None:
    assert isinstance(reverse_engine, ProvidesTokenizer)
    assert not isinstance(reverse_engine, KVHandoffStore)
    assert not isinstance(reverse_engine, HealthCheck)


def test_the_example_engine_serves_through_a_real_worker(reverse_engine: Engine) -> None:
    app = create_worker_app(reverse_engine, WorkerSettings(role="both"), Metrics())
    with running(app) as url, httpx.Client(base_url=url, timeout=30) as client:
        answer = client.post("/v1/completions", json={"model": "backwards", "prompt": "stressed", "max_tokens": 20})
        assert answer.status_code == 200, answer.text
        choice = answer.json()["choices"][0]
        assert (choice["text"], choice["finish_reason"]) == ("desserts", "stop")
        cut = client.post("/v1/completions", json={"model": "backwards", "prompt": "stressed", "max_tokens": 3})
        assert cut.json()["choices"][0]["text"] == "des"
        assert cut.json()["choices"][0]["finish_reason"] == "length"
        # Without the optional capabilities the worker still answers: healthy once started, nothing to release.
        assert client.get("/health").status_code == 200
        released = client.post("/v1/disagg/release", json={"ctx_request_id": "x", "encoded_opaque_state": "AAAA"})
        assert released.json() == {"released": False}
        assert client.get("/metrics").status_code == 200


def test_an_unknown_engine_name_lists_the_known_ones() -> None:
    with pytest.raises(ValueError, match="reference, synthetic"):
        factory.create_engine("nope", EngineOptions())


def test_the_synthetic_engine_is_built_through_the_registry() -> None:
    engine = factory.create_engine("synthetic", EngineOptions(served_model_name="served"))
    assert engine.info.engine == "synthetic" and engine.info.model == "served"
