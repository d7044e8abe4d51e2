"""The answer dialects side by side, and the one place that chooses between them (``WorkerService.dialect_of``)."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest

from frontend.disaggregated_params import DisaggregatedParams
from frontend.errors import UnsupportedParameterError
from frontend.internal_secret import INTERNAL_TOKEN_HEADER, InternalSecret
from frontend.metrics import Metrics
from frontend.openai_models import CompletionRequest
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


def wire(**fields: object) -> CompletionRequest:
    return CompletionRequest.model_validate({"model": "m", "prompt": "hi", **fields})


async def test_n_above_1_is_refused_only_where_tensorrt_llms_hand_off_cannot_carry_it(service: WorkerService) -> None:
    trtllm = service.dialect_of(params(request_type="context_only"))
    for phase in Phase:
        NATIVE.refuse_unservable(wire(), SamplingParams(n=2), phase)
    trtllm.refuse_unservable(wire(), SamplingParams(n=2), Phase.AGGREGATED)
    trtllm.refuse_unservable(wire(), SamplingParams(n=1), Phase.CONTEXT_ONLY)
    for phase in (Phase.CONTEXT_ONLY, Phase.GENERATION_ONLY):
        with pytest.raises(UnsupportedParameterError):
            trtllm.refuse_unservable(wire(), SamplingParams(n=2), phase)


async def test_only_tensorrt_llms_gen_answers_from_first_tokens_that_used_up_the_budget(service: WorkerService) -> None:
    spent = params(request_type="generation_only", first_gen_tokens=[5, 6])
    trtllm = service.dialect_of(spent)
    assert trtllm.answered_at_context(spent, SamplingParams(max_tokens=2))
    # budget left: a broken hand-off, refused later by its field
    assert not trtllm.answered_at_context(spent, SamplingParams(max_tokens=3))
    assert not trtllm.answered_at_context(params(request_type="generation_only", first_gen_tokens=[5, 6],
                                                 encoded_opaque_state="a3Y="), SamplingParams(max_tokens=2))
    assert not NATIVE.answered_at_context(spent, SamplingParams(max_tokens=2))


@pytest.mark.parametrize(("sampling", "param"), [
    (SamplingParams(max_tokens=1, echo=True, logprobs=1, prompt_logprobs=1), "echo"),
    (SamplingParams(max_tokens=1, prompt_logprobs=0), "prompt_logprobs"),
])
async def test_a_first_tokens_answer_that_would_lose_the_prompts_logprobs_is_refused(
        service: WorkerService, sampling: SamplingParams, param: str) -> None:
    """TensorRT-LLM's hand-off has no field for the prompt's scores: answered from CTX's first token alone, every
    prompt token's logprob would read null, so the request is refused instead, naming what needed them."""
    spent = params(request_type="generation_only", first_gen_tokens=[5])
    with pytest.raises(UnsupportedParameterError) as refused:
        service.dialect_of(spent).answered_at_context(spent, sampling)
    assert refused.value.param == param and "native wire" in str(refused.value)


async def test_prompt_logprobs_are_kept_for_our_own_callers_and_never_dropped_silently_for_others(
        service: WorkerService) -> None:
    gen = params(request_type="generation_only")
    theirs, ours = service.dialect_of(gen), service.dialect_of(gen, from_our_process=True)
    asked = SamplingParams(prompt_logprobs=1)
    with pytest.raises(UnsupportedParameterError) as refused:  # a whole answer that would lose them
        theirs.refuse_unservable(wire(prompt_logprobs=1), asked, Phase.GENERATION_ONLY)
    assert refused.value.param == "prompt_logprobs"
    theirs.refuse_unservable(wire(prompt_logprobs=1, stream=True), asked, Phase.GENERATION_ONLY)  # streams keep them
    theirs.refuse_unservable(wire(prompt_logprobs=1), asked, Phase.CONTEXT_ONLY)  # GEN answers the client
    ours.refuse_unservable(wire(prompt_logprobs=1), asked, Phase.GENERATION_ONLY)

    def whole(finish: str) -> dict[str, object]:
        return {"system_fingerprint": "fp", "choices": [{"finish_reason": finish, "prompt_logprobs": [None]}]}

    for dialect, finish, kept in ((ours, "length", True), (theirs, "stop", True), (theirs, "length", False),
                                  (theirs, "not_finished", False)):
        body = whole(finish)
        dialect.finish_whole(body)
        assert "system_fingerprint" not in body
        assert ("prompt_logprobs" in body["choices"][0]) is kept  # type: ignore[index]


async def test_a_caller_proves_it_is_ours_with_the_deployment_secret() -> None:
    """The Trtllm dialect that keeps prompt_logprobs is chosen for a request carrying the deployment secret; without
    it (or with a wrong one) a whole answer asking for them is refused before the engine runs."""
    secret = InternalSecret("s" * 32)
    service = WorkerService(SyntheticEngine(), WorkerSettings(internal_secret=secret), Metrics())
    body = {"model": service.engine.info.model, "prompt": "hi", "max_tokens": 1, "prompt_logprobs": 1,
            "disaggregated_params": {"request_type": "context_and_generation"}}
    try:
        for headers in ({}, {INTERNAL_TOKEN_HEADER: "t" * 32}):
            with pytest.raises(UnsupportedParameterError) as refused:
                await service.prepare(dict(body), CompletionRequest, headers=headers)
            assert refused.value.param == "prompt_logprobs"
        prepared = await service.prepare(dict(body), CompletionRequest, headers=secret.headers())
        assert isinstance(prepared.dialect, Trtllm) and prepared.dialect.keeps_prompt_logprobs
    finally:
        await service.lifecycle.aclose()
