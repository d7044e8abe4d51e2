"""Session-wide servers: one CTX worker, one GEN worker and an orchestrator in front of them, plus an aggregated
(role ``both``) worker as the reference output, all on the synthetic engine, on loopback."""

from __future__ import annotations

from collections.abc import Iterator

import openai
import pytest

from tests.cluster import Cluster, cluster_running


@pytest.fixture(scope="session")
def cluster() -> Iterator[Cluster]:
    with cluster_running() as running_cluster:
        yield running_cluster


@pytest.fixture(scope="session")
def client(cluster: Cluster) -> Iterator[openai.OpenAI]:
    """The official client, pointed at the orchestrator."""
    with openai.OpenAI(base_url=cluster.orchestrator.url + "/v1", api_key="test", max_retries=0,
                       timeout=30) as oai:
        yield oai


@pytest.fixture(scope="session")
def aggregated_client(cluster: Cluster) -> Iterator[openai.OpenAI]:
    """The official client, pointed straight at the aggregated worker (the reference output)."""
    with openai.OpenAI(base_url=cluster.aggregated.url + "/v1", api_key="test", max_retries=0,
                       timeout=30) as oai:
        yield oai
