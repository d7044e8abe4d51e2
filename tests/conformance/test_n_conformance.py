"""Item 3: ``n`` > 1 for chat and completions, whole and streamed: one choice per sequence with its ``index``, its
own ``finish_reason`` and logprobs, usage counting every choice; one prefill (CTX parks one hand-off for all n);
the disaggregated answer equal to the aggregated one for the same seed, and sequence i equal to a lone request with
seed + i. ``best_of`` stays refused, and the Responses API (which has no ``n``) refuses n > 1."""

from __future__ import annotations

from dataclasses import dataclass

import httpx
import openai
import pytest
from openai.types.chat import ChatCompletionMessageParam

from tests.workers.engines.reference.cluster import RefCluster, RefNode
from tests.workers.engines.reference.ledger import assert_ledger_balances

USER: list[ChatCompletionMessageParam] = [{"role": "user", "content": "Tell me a story"}]
PROMPT = "Once upon a time"
SEED = 4242
# The tiny model's favourite tokens are bytes that decode to no text; a bias towards the lower-case letters (token id
# 3 + byte) makes its sampled answers readable, so that choices can be told apart and stop strings found in them.
LETTERS = {str(3 + byte): 50 for byte in range(ord("a"), ord("z") + 1)}


@dataclass(frozen=True)
class Choice:
    text: str
    finish_reason: str | None
    logprobs: tuple[float, ...] = ()


@dataclass(frozen=True)
class Answer:
    choices: dict[int, Choice]
    completion_tokens: int


def ask(node: RefNode, endpoint: str, streamed: bool, **options: object) -> Answer:
    """One request through the official SDK, whole or streamed, read back as choices by index."""
    body: dict[str, object] = {"model": "tiny", "temperature": 2.0, "seed": SEED, "max_tokens": 6,
                               "logit_bias": LETTERS, **options}
    with node.client() as client:
        if endpoint == "chat":
            create = client.chat.completions.create
            body["messages"] = USER
        else:
            create = client.completions.create  # type: ignore[assignment]
            body["prompt"] = PROMPT
        if not streamed:
            reply = create(**body)  # type: ignore[call-overload]
            assert reply.usage is not None
            return Answer({c.index: _choice(endpoint, c) for c in reply.choices}, reply.usage.completion_tokens)
        chunks = list(create(**body, stream=True, stream_options={"include_usage": True}))  # type: ignore[call-overload]
    texts: dict[int, str] = {}
    finishes: dict[int, str | None] = {}
    logprobs: dict[int, tuple[float, ...]] = {}
    for chunk in chunks:
        for c in chunk.choices:
            piece = c.delta.content if endpoint == "chat" else c.text
            texts[c.index] = texts.get(c.index, "") + (piece or "")
            logprobs[c.index] = logprobs.get(c.index, ()) + _logprob_values(endpoint, c.logprobs)
            if c.finish_reason is not None:
                assert c.index not in finishes, "a choice finished twice"
                finishes[c.index] = c.finish_reason
    usage = chunks[-1].usage
    assert usage is not None
    return Answer({i: Choice(texts[i], finishes.get(i), logprobs[i]) for i in texts}, usage.completion_tokens)


def _choice(endpoint: str, choice: object) -> Choice:
    text = choice.message.content if endpoint == "chat" else choice.text  # type: ignore[attr-defined]
    return Choice(text or "", choice.finish_reason, _logprob_values(endpoint, choice.logprobs))  # type: ignore[attr-defined]


def _logprob_values(endpoint: str, logprobs: object) -> tuple[float, ...]:
    if logprobs is None:
        return ()
    if endpoint == "chat":
        return tuple(entry.logprob for entry in logprobs.content or ())  # type: ignore[attr-defined]
    return tuple(v for v in logprobs.token_logprobs or () if v is not None)  # type: ignore[attr-defined]


ENDPOINTS = ["chat", "completions"]


@pytest.mark.parametrize("streamed", [False, True], ids=["whole", "streamed"])
@pytest.mark.parametrize("endpoint", ENDPOINTS)
def test_n_choices_disaggregated_equal_aggregated(conformance_cluster: RefCluster, endpoint: str,
                                                  streamed: bool) -> None:
    before = assert_ledger_balances(conformance_cluster.ctx.url)["totals"]
    disaggregated = ask(conformance_cluster.orchestrator, endpoint, streamed, n=3)
    aggregated = ask(conformance_cluster.aggregated, endpoint, streamed, n=3)
    assert sorted(disaggregated.choices) == [0, 1, 2]
    assert disaggregated == aggregated
    assert len({c.text for c in disaggregated.choices.values()}) > 1  # three sequences, not one three times
    assert all(c.finish_reason in ("stop", "length") for c in disaggregated.choices.values())
    assert disaggregated.completion_tokens > 6  # counts every choice, not only the first
    after = assert_ledger_balances(conformance_cluster.ctx.url)["totals"]
    # One prefill on CTX, one hand-off for the three sequences, taken once by GEN.
    assert after["parked"] == before["parked"] + 1
    assert after["taken"] == before["taken"] + 1


@pytest.mark.parametrize("endpoint", ENDPOINTS)
def test_sequence_i_draws_as_a_lone_request_seeded_seed_plus_i(conformance_cluster: RefCluster,
                                                               endpoint: str) -> None:
    together = ask(conformance_cluster.orchestrator, endpoint, False, n=3)
    for index in range(3):
        alone = ask(conformance_cluster.orchestrator, endpoint, False, seed=SEED + index)
        assert alone.choices[0] == together.choices[index]


@pytest.mark.parametrize("streamed", [False, True], ids=["whole", "streamed"])
def test_each_choice_has_its_own_logprobs(conformance_cluster: RefCluster, streamed: bool) -> None:
    for endpoint, options in (("chat", {"logprobs": True, "top_logprobs": 2}), ("completions", {"logprobs": 2})):
        disaggregated = ask(conformance_cluster.orchestrator, endpoint, streamed, n=2, **options)
        aggregated = ask(conformance_cluster.aggregated, endpoint, streamed, n=2, **options)
        assert disaggregated == aggregated
        assert all(c.logprobs for c in disaggregated.choices.values())
        assert disaggregated.choices[0].logprobs != disaggregated.choices[1].logprobs


@pytest.mark.parametrize("streamed", [False, True], ids=["whole", "streamed"])
def test_echo_opens_every_choice_with_the_prompt(conformance_cluster: RefCluster, streamed: bool) -> None:
    disaggregated = ask(conformance_cluster.orchestrator, "completions", streamed, n=2, echo=True, logprobs=1)
    aggregated = ask(conformance_cluster.aggregated, "completions", streamed, n=2, echo=True, logprobs=1)
    assert disaggregated == aggregated
    assert all(c.text.startswith(PROMPT) for c in disaggregated.choices.values())
    assert disaggregated.choices[0].text != disaggregated.choices[1].text


@pytest.mark.parametrize("streamed", [False, True], ids=["whole", "streamed"])
def test_a_stop_string_ends_only_the_choices_that_meet_it(conformance_cluster: RefCluster, streamed: bool) -> None:
    free = ask(conformance_cluster.aggregated, "completions", False, n=3, max_tokens=12)
    text = free.choices[1].text
    stop = text[len(text) // 2 : len(text) // 2 + 2]
    expected = {}
    for index, choice in free.choices.items():
        if stop in choice.text:
            expected[index] = Choice(choice.text[: choice.text.index(stop)], "stop")
        else:
            expected[index] = choice
    for node in (conformance_cluster.orchestrator, conformance_cluster.aggregated):
        stopped = ask(node, "completions", streamed, n=3, max_tokens=12, stop=[stop])
        assert stopped.choices == expected
    assert expected[1].finish_reason == "stop"


@pytest.mark.parametrize("streamed", [False, True], ids=["whole", "streamed"])
@pytest.mark.parametrize("endpoint", ENDPOINTS)
def test_n_choices_that_ctx_finishes_by_itself(conformance_cluster: RefCluster, endpoint: str,
                                               streamed: bool) -> None:
    """max_tokens 1: CTX chooses every first token and finishes the request; GEN is never called."""
    before = assert_ledger_balances(conformance_cluster.ctx.url)["totals"]
    disaggregated = ask(conformance_cluster.orchestrator, endpoint, streamed, n=3, max_tokens=1)
    aggregated = ask(conformance_cluster.aggregated, endpoint, streamed, n=3, max_tokens=1)
    assert disaggregated == aggregated
    assert sorted(disaggregated.choices) == [0, 1, 2]
    assert disaggregated.completion_tokens == 3
    assert assert_ledger_balances(conformance_cluster.ctx.url)["totals"]["parked"] == before["parked"]


def test_best_of_stays_refused_and_responses_take_no_n(conformance_cluster: RefCluster) -> None:
    with conformance_cluster.orchestrator.client() as client:
        with pytest.raises(openai.BadRequestError) as caught:
            client.completions.create(model="tiny", prompt=PROMPT, max_tokens=2, best_of=2)
        assert caught.value.param == "best_of"
        with pytest.raises(openai.BadRequestError) as caught:
            client.responses.create(model="tiny", input="Hi", max_output_tokens=2, extra_body={"n": 2})
        assert caught.value.param == "n"
        with pytest.raises(openai.BadRequestError) as caught:
            client.chat.completions.create(model="tiny", messages=USER, max_tokens=2, n=129)
        assert caught.value.param == "n"


def test_gen_refuses_a_handoff_that_starts_fewer_sequences_than_n(conformance_cluster: RefCluster) -> None:
    ctx_body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 4, "n": 2, "seed": SEED,
                "disaggregated_params": {"request_type": "context_only", "return_prompt_token_ids_b64": True,
                                         "native_extensions": True}}  # as our orchestrator asks: n rides on them
    ctx = httpx.post(conformance_cluster.ctx.url + "/v1/completions", json=ctx_body, timeout=120).json()
    params = ctx["choices"][0]["disaggregated_params"]
    assert len(params["more_sequences"]) == 1
    gen_body = {"model": "tiny", "max_tokens": 4, "n": 3, "seed": SEED,
                "prompt_token_ids_b64": ctx["prompt_token_ids_b64"],
                "disaggregated_params": {**params, "request_type": "generation_only"}}
    reply = httpx.post(conformance_cluster.gen.url + "/v1/completions", json=gen_body, timeout=120)
    assert reply.status_code == 400
    assert reply.json()["error"]["param"] == "disaggregated_params.more_sequences"
    # Refusing it did not consume it: the right n continues, and the ledger balances.
    reply = httpx.post(conformance_cluster.gen.url + "/v1/completions", json={**gen_body, "n": 2}, timeout=120)
    assert reply.status_code == 200, reply.text
    assert [c["index"] for c in reply.json()["choices"]] == [0, 1]
    assert_ledger_balances(conformance_cluster.ctx.url)
