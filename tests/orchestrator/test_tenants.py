"""Tenants: identified by their own API keys, held to their limits (at once, per second, prompt and completion tokens
per second) with a 429 whose Retry-After and message name the limit; and through a real orchestrator, a heavy
tenant limited while another is served, and a tenant's priority that a header may lower but never raise."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Iterator
from typing import Any

import httpx
import openai
import pytest

from frontend.config import TenantConfig, parse_config
from frontend.errors import OverloadedError
from frontend.metrics import Metrics
from orchestrator.server import create_orchestrator_app
from orchestrator.tenants import Tenant, Tenants, TokenBucket
from tests.cluster import MODEL, Cluster, sample
from tests.orchestrator.test_admission import counted
from tests.orchestrator.test_response_store import FakeClock
from tests.servers import running

ENV = {"KEY_A": "key-of-a", "KEY_B": "key-of-b", "KEY_C": "key-of-c", "KEY_D": "key-of-d"}


def tenants_of(clock: FakeClock, *configs: dict[str, Any], share: float = 1.0,
               metrics: Metrics | None = None) -> Tenants:
    return Tenants([TenantConfig.model_validate(c) for c in configs], metrics or Metrics(), process_share=share,
                   environ=ENV, clock=clock)


def tenant(tenants: Tenants, key: str = "key-of-a") -> Tenant:
    found = tenants.identify(f"Bearer {key}")
    assert found is not None
    return found


def test_a_bucket_refills_at_its_rate_up_to_its_capacity_and_may_go_into_debt() -> None:
    clock = FakeClock()
    bucket = TokenBucket(rate=2.0, capacity=4.0, clock=clock)
    assert bucket.seconds_until(4) == 0
    bucket.spend(10)  # a debt of 6
    assert bucket.seconds_until(1) == pytest.approx(3.5)
    clock.now += 100
    assert bucket.level() == 4.0


def test_a_key_names_its_tenant_and_an_unknown_key_none() -> None:
    tenants = tenants_of(FakeClock(), {"name": "a", "api_key_env": "KEY_A"}, {"name": "b", "api_key_env": "KEY_B"})
    assert tenant(tenants).name == "a" and tenant(tenants, "key-of-b").name == "b"
    assert tenants.identify("Bearer nobody") is None and tenants.identify(None) is None
    assert tenants.identify("Basic key-of-a") is None


def test_a_tenant_whose_key_is_not_in_the_environment_stops_start_up() -> None:
    with pytest.raises(ValueError, match="KEY_UNSET"):
        tenants_of(FakeClock(), {"name": "c", "api_key_env": "KEY_UNSET"})


@pytest.mark.parametrize(("limits", "body_bytes", "limit", "retry_after"), [
    ({"max_concurrent": 1}, 10, "concurrent", "1"),
    ({"requests_per_s": 0.5}, 10, "requests_per_s", "2"),
    ({"prompt_tokens_per_s": 100.0}, 4_000, "prompt_tokens_per_s", "11"),  # 1,001 owed, 100 held
])
def test_a_second_request_over_a_limit_is_a_429_naming_it(limits: dict[str, Any], body_bytes: int, limit: str,
                                                         retry_after: str) -> None:
    metrics = Metrics()
    tenants = tenants_of(FakeClock(), {"name": "a", "api_key_env": "KEY_A", **limits}, metrics=metrics)
    a = tenant(tenants)
    tenants.admit(a, body_bytes)
    with pytest.raises(OverloadedError) as caught:
        tenants.admit(a, body_bytes)
    assert caught.value.status_code == 429 and caught.value.code == "tenant_rate_limited"
    assert caught.value.headers == {"Retry-After": retry_after}
    assert "tenant 'a'" in caught.value.message and limit in caught.value.message
    assert sample(metrics, "disagg_tenant_refusals_total", tenant="a", limit=limit) == 1
    assert a.running == 1  # the refused one holds nothing


def test_streamed_completion_tokens_put_a_tenant_in_debt_until_its_rate_pays_it() -> None:
    clock = FakeClock()
    tenants = tenants_of(clock, {"name": "a", "api_key_env": "KEY_A", "completion_tokens_per_s": 10.0})
    a = tenant(tenants)
    tenants.spend_whole(a, b'{"usage": {"prompt_tokens": 3, "completion_tokens": 25}}')  # 10 held, 15 owed
    with pytest.raises(OverloadedError) as caught:
        tenants.admit(a, 10)
    assert caught.value.headers == {"Retry-After": "2"}  # 16 missing at 10 a second
    clock.now += 1.6
    tenants.admit(a, 10)


def test_a_responses_answer_spends_its_output_tokens() -> None:
    clock = FakeClock()
    tenants = tenants_of(clock, {"name": "a", "api_key_env": "KEY_A", "completion_tokens_per_s": 10.0})
    a = tenant(tenants)
    tenants.spend_whole(a, b'{"usage": {"input_tokens": 3, "output_tokens": 4, "total_tokens": 7}}')
    assert a.completion_tokens is not None and a.completion_tokens.level() == 6.0


async def test_a_stream_spends_a_token_per_event_as_it_passes() -> None:
    clock = FakeClock()
    tenants = tenants_of(clock, {"name": "a", "api_key_env": "KEY_A", "completion_tokens_per_s": 5.0})
    a = tenant(tenants)

    async def frames() -> AsyncIterator[bytes]:
        yield b"data: {}\n\ndata: {}\n\n"
        yield b"data: {}\n\n"

    assert [chunk async for chunk in tenants.spend_streamed(a, frames())] == [b"data: {}\n\ndata: {}\n\n",
                                                                             b"data: {}\n\n"]
    assert a.completion_tokens is not None and a.completion_tokens.level() == 2.0


def test_a_prompt_larger_than_its_body_is_checked_whole_and_charged() -> None:
    # A short follow-up (26 tokens by its bytes) that a stored conversation makes 10,000 tokens long: checked as if
    # those 26 had never been charged, so a full bucket lets it run once, and it leaves the tenant in debt.
    clock = FakeClock()
    tenants = tenants_of(clock, {"name": "a", "api_key_env": "KEY_A", "prompt_tokens_per_s": 2000.0})
    a = tenant(tenants)
    charged = tenants.admit(a, 100)
    assert charged == 26
    assert tenants.charge_prompt(a, charged, 10_000) == 10_000
    assert a.prompt_tokens is not None and a.prompt_tokens.level() == -8_000
    with pytest.raises(OverloadedError) as caught:
        tenants.admit(a, 100)
    assert caught.value.headers == {"Retry-After": "5"}  # 8,026 missing at 2,000 a second
    clock.now += 3.0  # -2,000: the next one's 26 are still missing
    with pytest.raises(OverloadedError):
        tenants.admit(a, 100)


def test_a_larger_prompt_than_the_bucket_holds_now_is_a_429_and_its_charge_given_back() -> None:
    clock = FakeClock()
    tenants = tenants_of(clock, {"name": "a", "api_key_env": "KEY_A", "prompt_tokens_per_s": 2000.0})
    a = tenant(tenants)
    tenants.charge_prompt(a, tenants.admit(a, 100), 1_000)  # 1,000 held
    charged = tenants.admit(a, 100)
    with pytest.raises(OverloadedError) as caught:
        tenants.charge_prompt(a, charged, 1_500)
    assert "prompt_tokens_per_s: 2000 prompt tokens per second" in caught.value.message
    assert caught.value.headers == {"Retry-After": "1"}
    assert a.prompt_tokens is not None and a.prompt_tokens.level() == 1_000
    assert tenants.charge_prompt(a, 26, 20) == 26  # smaller than charged: nothing more now, settled later


def test_the_workers_count_settles_the_estimate_both_ways() -> None:
    clock = FakeClock()
    tenants = tenants_of(clock, {"name": "a", "api_key_env": "KEY_A", "prompt_tokens_per_s": 1000.0})
    a = tenant(tenants)
    assert a.prompt_tokens is not None
    charged = tenants.admit(a, 400)  # 101
    tenants.settle_prompt(a, charged, 400)  # one token a byte: 299 more
    assert a.prompt_tokens.level() == 600
    tenants.settle_prompt(a, 400, 100)  # fewer than charged: given back
    assert a.prompt_tokens.level() == 900
    tenants.settle_prompt(a, 100, None)  # no count: the estimate stands
    assert a.prompt_tokens.level() == 900
    assert tenants.prompt_tokens_of(b'{"usage": {"prompt_tokens": 7, "completion_tokens": 2}}') == 7
    assert tenants.prompt_tokens_of(b'{"usage": {"input_tokens": 5, "input_tokens_details": {}}}') == 5
    assert tenants.prompt_tokens_of(b'{"choices": []}') is None


def test_each_of_n_processes_enforces_its_share() -> None:
    tenants = tenants_of(FakeClock(), {"name": "a", "api_key_env": "KEY_A", "max_concurrent": 10,
                                       "requests_per_s": 8.0}, share=0.25)
    a = tenant(tenants)
    assert a.max_concurrent == 2 and a.requests is not None and a.requests.rate == 2.0


@pytest.fixture(scope="module")
def with_tenants(cluster: Cluster) -> Iterator[tuple[str, Metrics]]:
    config = parse_config({
        "context_servers": {"urls": [cluster.ctx.url]}, "generation_servers": {"urls": [cluster.gen.url]},
        # A burst of two that refills once in 1,000 s: the test's requests may take any time they need.
        "tenants": [{"name": "heavy", "api_key_env": "KEY_A", "requests_per_s": 0.001, "burst_s": 2000.0,
                     "priority": "batch"},
                    {"name": "light", "api_key_env": "KEY_B", "priority": "interactive"},
                    {"name": "plain", "api_key_env": "KEY_C"},
                    # 100,000 prompt tokens that refill at one in 1,000 s: nothing the test takes time for.
                    {"name": "reader", "api_key_env": "KEY_D", "prompt_tokens_per_s": 0.001, "burst_s": 1e8}],
    })
    metrics = Metrics()
    with pytest.MonkeyPatch.context() as patch:
        for name, value in ENV.items():
            patch.setenv(name, value)
        app = create_orchestrator_app(config, metrics)
    with running(app) as url:
        yield url, metrics


def test_through_the_orchestrator_the_heavy_tenant_is_limited_and_the_other_served(
    with_tenants: tuple[str, Metrics]
) -> None:
    url, metrics = with_tenants
    heavy = openai.OpenAI(base_url=url + "/v1", api_key="key-of-a", max_retries=0)
    light = openai.OpenAI(base_url=url + "/v1", api_key="key-of-b", max_retries=0)
    ask: dict[str, Any] = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    with contextlib.closing(heavy), contextlib.closing(light):
        heavy.chat.completions.create(**ask)
        heavy.chat.completions.create(**ask)  # its burst: two
        with pytest.raises(openai.RateLimitError) as caught:
            heavy.chat.completions.create(**ask)
        assert "tenant 'heavy'" in caught.value.message and "requests per second" in caught.value.message
        assert int(caught.value.response.headers["retry-after"]) >= 1
        for _ in range(5):
            assert light.chat.completions.create(**ask).choices[0].message.content
    assert counted(metrics, "batch", "admitted") == 2
    assert counted(metrics, "interactive", "admitted") == 5
    # A key that is no tenant's (and no --api-key was given): 401.
    answer = httpx.post(url + "/v1/chat/completions", json=ask, headers={"authorization": "Bearer other"})
    assert answer.status_code == 401


def test_a_header_may_lower_a_tenants_priority_but_not_raise_it(with_tenants: tuple[str, Metrics]) -> None:
    url, metrics = with_tenants
    ask: dict[str, Any] = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    before = [counted(metrics, p, "admitted")
              for p in ("interactive", "default", "batch")]
    # light (interactive) asks lower twice; plain (default) asks higher, and stays default.
    for key, priority in (("key-of-b", "batch"), ("key-of-b", "default"), ("key-of-c", "interactive")):
        answer = httpx.post(url + "/v1/chat/completions", json=ask,
                            headers={"authorization": f"Bearer {key}", "x-priority": priority})
        assert answer.status_code == 200
    after = [counted(metrics, p, "admitted")
             for p in ("interactive", "default", "batch")]
    assert [b - a for a, b in zip(before, after, strict=True)] == [0, 2, 1]


def test_each_tenants_refusals_are_exported_at_zero_from_start_up() -> None:
    metrics = Metrics()
    tenants_of(FakeClock(), {"name": "a", "api_key_env": "KEY_A"}, metrics=metrics)
    exported = {s.labels["limit"] for f in metrics.registry.collect() for s in f.samples
                if s.name == "disagg_tenant_refusals_total" and s.labels.get("tenant") == "a"}
    assert exported == {"concurrent", "requests_per_s", "prompt_tokens_per_s", "completion_tokens_per_s"}


def test_a_tenant_reads_deletes_and_continues_only_its_own_stored_responses(with_tenants: tuple[str, Metrics]
                                                                           ) -> None:
    url, _ = with_tenants
    light = openai.OpenAI(base_url=url + "/v1", api_key="key-of-b", max_retries=0)
    plain = openai.OpenAI(base_url=url + "/v1", api_key="key-of-c", max_retries=0)
    with contextlib.closing(light), contextlib.closing(plain):
        first = light.responses.create(model=MODEL, input="Hello", max_output_tokens=2)
        with pytest.raises(openai.NotFoundError):
            plain.responses.retrieve(first.id)
        with pytest.raises(openai.NotFoundError) as caught:
            plain.responses.create(model=MODEL, input="Mine now?", previous_response_id=first.id)
        assert caught.value.code == "previous_response_not_found"
        with pytest.raises(openai.NotFoundError):
            plain.responses.delete(first.id)
        assert light.responses.retrieve(first.id).id == first.id  # still there, and still light's
        light.responses.create(model=MODEL, input="And then?", previous_response_id=first.id, max_output_tokens=2)


def test_short_follow_ups_to_a_long_stored_turn_are_charged_what_ctx_prefills(with_tenants: tuple[str, Metrics]
                                                                              ) -> None:
    # The tenant's bucket holds 100,000 prompt tokens; its one stored turn is 40,000 (the synthetic engine's
    # tokenizer makes a token of each byte). Charged for the bytes of its body alone, each follow-up cost ~30 tokens
    # and all ten ran: 400,000 tokens prefilled. Charged for the conversation CTX prefills, at most three run.
    url, metrics = with_tenants
    reader = openai.OpenAI(base_url=url + "/v1", api_key="key-of-d", max_retries=0)
    with contextlib.closing(reader):
        first = reader.responses.create(model=MODEL, input="x" * 40_000, max_output_tokens=2)
        ran = 0
        for _ in range(10):
            try:
                reader.responses.create(model=MODEL, input="And then?", previous_response_id=first.id,
                                        max_output_tokens=2)
            except openai.RateLimitError as refused:
                assert refused.code == "tenant_rate_limited" and "prompt_tokens_per_s" in refused.message
                break
            ran += 1
        else:
            raise AssertionError("ten follow-ups of 40,000 tokens each ran on a bucket of 100,000")
    assert ran <= 3
    assert sample(metrics, "disagg_tenant_refusals_total", tenant="reader", limit="prompt_tokens_per_s") == 1
