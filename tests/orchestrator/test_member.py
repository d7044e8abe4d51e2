"""A pool member's own state: the health state machine with its thresholds, load counting, and engine facts."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest

from orchestrator.member import UNKNOWN_ENGINE_FACTS, PoolMember
from orchestrator.upstream.base import WorkerTimeouts
from orchestrator.upstream.choice import make_transport


@pytest.fixture
async def member() -> AsyncIterator[PoolMember]:
    transport = make_transport("http://w:1", WorkerTimeouts())  # never called here, only closed
    yield PoolMember(transport)
    await transport.aclose()


def test_health_thresholds(member: PoolMember) -> None:
    assert member.healthy is False
    member.record_health(True, failure_threshold=2, recovery_threshold=2)
    assert member.healthy is False
    member.record_health(True, 2, 2)
    assert member.healthy is True
    member.record_health(False, 2, 2)
    assert member.healthy is True  # one failed check is not enough
    member.record_health(True, 2, 2)
    member.record_health(False, 2, 2)
    assert member.healthy is True  # the failures must be in a row
    member.record_health(False, 2, 2)
    assert member.healthy is False
    member.mark_unreachable()
    assert member.healthy is False


def test_a_refused_connection_takes_a_member_out_at_once(member: PoolMember) -> None:
    member.record_health(True, 2, 1)
    assert member.healthy is True
    member.mark_unreachable()
    assert member.healthy is False
    member.record_health(True, 2, 2)
    assert member.healthy is False  # the recovery count starts again from zero
    member.record_health(True, 2, 2)
    assert member.healthy is True


def test_unknown_engine_facts_are_the_restrictive_ones(member: PoolMember) -> None:
    assert member.facts is None
    assert member.engine_facts is UNKNOWN_ENGINE_FACTS
    assert member.engine_facts.kv_block_reuse is True
    assert member.engine_facts.prompt_tokens_in_handoff is False


def test_carrying_counts_a_request_and_its_prompt_tokens_until_it_ends(member: PoolMember) -> None:
    with member.carrying(100):
        assert (member.inflight, member.inflight_prompt_tokens) == (1, 100)
        with member.carrying(20):
            assert (member.inflight, member.inflight_prompt_tokens) == (2, 120)
    assert (member.inflight, member.inflight_prompt_tokens) == (0, 0)
    with pytest.raises(RuntimeError), member.carrying(7):
        raise RuntimeError("the request failed")
    assert (member.inflight, member.inflight_prompt_tokens) == (0, 0)
