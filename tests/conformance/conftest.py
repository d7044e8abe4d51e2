"""The conformance suite's cluster: CTX, GEN and aggregated reference workers on the tiny model, and an
orchestrator in front of CTX and GEN, all real servers on loopback driven by the official ``openai`` SDK."""

from __future__ import annotations

import pathlib
from collections.abc import Iterator

import pytest

from tests.workers.engines.reference.cluster import RefCluster, reference_cluster
from tests.workers.engines.reference.tiny_model import write_tiny_model
from workers.engines.reference.options import ReferenceOptions


@pytest.fixture(scope="session")
def conformance_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RefCluster]:
    model: pathlib.Path = write_tiny_model(tmp_path_factory.mktemp("conformance") / "tiny.gguf", seed=0)
    with reference_cluster(ReferenceOptions(model_path=str(model), served_model_name="tiny", blas_threads=1)) as c:
        yield c


@pytest.fixture(scope="session")
def reuse_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RefCluster]:
    """A cluster whose workers reuse KV blocks (``--kv-block-reuse``): what the prefix cache saves is seen."""
    model: pathlib.Path = write_tiny_model(tmp_path_factory.mktemp("reuse") / "tiny.gguf", seed=0)
    options = ReferenceOptions(model_path=str(model), served_model_name="tiny", blas_threads=1, kv_block_reuse=True)
    with reference_cluster(options) as cluster:
        yield cluster
