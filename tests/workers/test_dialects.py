"""The answer dialects side by side, and the one place that chooses between them (``WorkerService.dialect_of``)."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest

from frontend.disaggregated_params import DisaggregatedParams
from frontend.errors import UnsupportedParameterError
from frontend.metrics import Metrics
from frontend.sampling import SamplingParams
from workers.dialects import NATIVE
from workers.engines.request import Phase
from workers.engines.synthetic import SyntheticEngine
from workers.service import WorkerService
from workers.settings import WorkerSettings
from workers.trtllm.answers import Trtllm


@pytest.fixture
async def service() -> AsyncIterator[WorkerService]:
    service = WorkerService(SyntheticEngine(), WorkerSettings(role="generation"), Metrics())
    yield service
    await service.lifecycle.aclose()


def params(**fields: object) -> DisaggregatedParams:
    return DisaggregatedParams.model_validate(fields)


async def test_tensorrt_llms_shape_is_chosen_only_for_a_caller_that_did_not_ask_for_ours(
        service: WorkerService) -> None:
    assert service.dialect_of(None) is NATIVE
    assert service.dialect_of(params(request_type="context_only", native_extensions=True)) is NATIVE
    assert isinstance(service.dialect_of(params(request_type="context_only")), Trtllm)
    assert isinstance(service.dialect_of(params(request_type="context_and_generation")), Trtllm)


async def test_n_above_1_is_refused_only_where_tensorrt_llms_hand_off_cannot_carry_it(service: WorkerService) -> None:
    trtllm = service.dialect_of(params(request_type="context_only"))
    for phase in Phase:
        NATIVE.refuse_unservable(SamplingParams(n=2), phase)
    trtllm.refuse_unservable(SamplingParams(n=2), Phase.AGGREGATED)
    trtllm.refuse_unservable(SamplingParams(n=1), Phase.CONTEXT_ONLY)
    for phase in (Phase.CONTEXT_ONLY, Phase.GENERATION_ONLY):
        with pytest.raises(UnsupportedParameterError):
            trtllm.refuse_unservable(SamplingParams(n=2), phase)


async def test_only_tensorrt_llms_gen_answers_from_first_tokens_that_used_up_the_budget(service: WorkerService) -> None:
    spent = params(request_type="generation_only", first_gen_tokens=[5, 6])
    trtllm = service.dialect_of(spent)
    assert trtllm.answered_at_context(spent, 2)
    assert not trtllm.answered_at_context(spent, 3)  # budget left: a broken hand-off, refused later by its field
    assert not trtllm.answered_at_context(params(request_type="generation_only", first_gen_tokens=[5, 6],
                                                 encoded_opaque_state="a3Y="), 2)
    assert not NATIVE.answered_at_context(spent, 2)
