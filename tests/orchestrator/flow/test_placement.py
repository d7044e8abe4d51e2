"""Conditional disaggregation by what is cached: a follow-up turn whose history the GEN worker holds is
prefilled there, skipping CTX and the KV transfer.

Real simulated-engine workers (their prefix caches, KV events on loopback ZMQ) behind a real orchestrator, driven
with the official ``openai`` client.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import openai
import pytest

from frontend.config import parse_config
from orchestrator.server import create_orchestrator_app
from tests.cluster import sample
from tests.servers import running
from tests.waiting import eventually
from workers.engines.options import SimulatedConfig
from workers.engines.simulated import SimulatedEngine
from workers.server import create_worker_app
from workers.settings import Role, WorkerSettings

SYSTEM = "You answer in one short sentence. " * 80  # ~2.7k tokens
THRESHOLD = 256


def start_worker(stack: contextlib.ExitStack, role: Role) -> tuple[str, Any, SimulatedEngine]:
    engine = SimulatedEngine(SimulatedConfig(prefill_base_s=0.0, prefill_tokens_per_s=1e9,
                                             prefix_cache_tokens=65_536, inter_token_latency_s=0.0))
    app = create_worker_app(engine, WorkerSettings(role=role))
    return stack.enter_context(running(app)), app, engine


@pytest.fixture
def system() -> Iterator[dict[str, Any]]:
    with contextlib.ExitStack() as stack:
        ctx_url, _, ctx = start_worker(stack, "context")
        gen_url, gen_app, gen = start_worker(stack, "generation")
        both_url, _, _ = start_worker(stack, "both")
        config = parse_config({"context_servers": {"urls": [ctx_url]}, "generation_servers": {"urls": [gen_url]},
                               "max_local_prefill_length": THRESHOLD})
        app = create_orchestrator_app(config)
        url = stack.enter_context(running(app))
        yield {"url": url, "app": app, "ctx": ctx, "gen": gen, "gen_url": gen_url, "gen_app": gen_app,
               "both": both_url}


def placements(app: Any, placement: str) -> float:
    return sample(app.state.metrics, "disagg_prefill_placement_total", placement=placement)


def test_a_follow_up_that_gen_holds_skips_ctx_and_answers_as_an_aggregated_worker(system: dict[str, Any]) -> None:
    client = openai.OpenAI(base_url=f"{system['url']}/v1", api_key="unused", max_retries=0)
    aggregated = openai.OpenAI(base_url=f"{system['both']}/v1", api_key="unused", max_retries=0)
    history: list[Any] = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "First question?"}]
    first = client.chat.completions.create(model="simulated", messages=history, max_tokens=12)
    assert placements(system["app"], "ctx") == 1 and system["ctx"].stats().prefills == 1
    gen_holdings = system["gen_app"].state.kv_events.service.holdings
    index = system["app"].state.pools["generation"].index
    assert eventually(lambda: gen_holdings.links > 0
                      and index.held(system["gen_url"]) == frozenset(gen_holdings.held()))
    history += [{"role": "assistant", "content": first.choices[0].message.content},
                {"role": "user", "content": "And the second?"}]
    second = client.chat.completions.create(model="simulated", messages=history, max_tokens=12)
    assert placements(system["app"], "gen_cached") == 1
    assert system["ctx"].stats().prefills == 1  # CTX never saw the second turn
    assert system["gen"].stats().prefills == 1  # GEN prefilled it, from its cache
    assert system["gen"].stats().hit_tokens > 2000
    alone = aggregated.chat.completions.create(model="simulated", messages=history, max_tokens=12)
    assert second.choices[0].message.content == alone.choices[0].message.content
    assert second.usage is not None and alone.usage is not None
    assert second.usage.prompt_tokens == alone.usage.prompt_tokens
    for c in (client, aggregated):
        c.close()


def test_a_new_conversation_still_goes_through_ctx(system: dict[str, Any]) -> None:
    client = openai.OpenAI(base_url=f"{system['url']}/v1", api_key="unused", max_retries=0)
    client.chat.completions.create(model="simulated", max_tokens=4,
                                   messages=[{"role": "system", "content": SYSTEM}, {"role": "user", "content": "a"}])
    client.chat.completions.create(model="simulated", max_tokens=4,
                                   messages=[{"role": "user", "content": "An unrelated, long question. " * 100}])
    assert placements(system["app"], "ctx") == 2 and placements(system["app"], "gen_cached") == 0
    client.close()
