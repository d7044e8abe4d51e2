"""Session-wide servers: one CTX worker, one GEN worker and an orchestrator in front of them, plus an aggregated
(role ``both``) worker as the reference output, all on the synthetic engine, on loopback."""

from __future__ import annotations

import os
from collections.abc import Iterator

import openai
import pytest
from hypothesis import HealthCheck, settings

from bench.driver.redis_server import RedisMissingError, RedisServer, redis_running
from tests.cluster import Cluster, cluster_running

# One Hypothesis profile for the whole suite. No wall-clock deadline: a property test's examples run in
# microseconds alone and in hundreds of milliseconds on a busy 2-core machine, and the deadline then fails a
# correct test at random. Derandomized under CI (CI=true), so a CI run explores the same examples every time;
# no example database (nothing carried between runs). Tests set only max_examples (and health checks) themselves.
settings.register_profile(
    "disagg-serve",
    deadline=None,
    derandomize=os.environ.get("CI", "").lower() == "true",
    database=None,
    suppress_health_check=[HealthCheck.too_slow],
    print_blob=True,
)
settings.load_profile("disagg-serve")


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


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    """One real Redis for the session's tests (started on first use, always stopped)."""
    try:
        with redis_running(tmp_path_factory.mktemp("redis")) as server:
            yield server
    except RedisMissingError as exc:
        pytest.fail(str(exc))


@pytest.fixture
def redis_url(redis_server: RedisServer) -> str:
    """The session's Redis, emptied for this test."""
    with redis_server.client() as client:
        client.flushall()
    return redis_server.url
