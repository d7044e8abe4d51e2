"""Generation first on its own: which GEN request comes first, and the board CTX posts hand-offs on."""

from __future__ import annotations

from frontend.disaggregated_params import DisaggregatedParams
from workers.trtllm.generation_first import HandoffBoard, comes_first


def test_only_a_generation_first_gen_request_without_a_hand_off_comes_first() -> None:
    def params(**fields: object) -> DisaggregatedParams:
        return DisaggregatedParams.model_validate({"request_type": "generation_only", "schedule_style": 1, **fields})

    assert comes_first(params())
    assert not comes_first(None)
    assert not comes_first(params(schedule_style=0))
    assert not comes_first(params(request_type="context_only"))
    assert not comes_first(params(first_gen_tokens=[1]))  # CTX's answer reached it through its orchestrator
    assert not comes_first(params(encoded_opaque_state="a3Y="))


async def test_a_hand_off_is_taken_once_and_only_with_its_claim() -> None:
    board = HandoffBoard(ttl_s=60.0, clock=lambda: 0.0)
    assert board.post(7, {"first_gen_tokens": [1]}, claim="attempt")
    assert await board.claim(7, wait_s=0.0, presented="another") is None  # left for the GEN granted it
    assert await board.claim(7, wait_s=0.0, presented="attempt") == {"first_gen_tokens": [1]}
    assert await board.claim(7, wait_s=0.0, presented="attempt") is None


async def test_a_hand_off_older_than_the_ttl_is_forgotten() -> None:
    now = [0.0]
    board = HandoffBoard(ttl_s=60.0, clock=lambda: now[0])
    board.post(7, {"first_gen_tokens": [1]})
    now[0] = 61.0
    board.post(8, {"first_gen_tokens": [2]})  # each post forgets what has expired
    assert await board.claim(7, wait_s=0.0) is None
    assert await board.claim(8, wait_s=0.0) == {"first_gen_tokens": [2]}
