"""Cache-aware routing and conditional disaggregation on real vLLM: what the orchestrator's picture of the caches
(the workers' KV events) says a worker holds, that worker's vLLM really reuses.

Two of our workers on ``--engine vllm`` (``--role both``, prefix caching on, ExampleConnector sharing one folder),
started side by side, serve both tests, each behind its own orchestrator:

- **Routing.** Both are CTX workers behind the default (``cache_aware``) router. A conversation's first turn (a
  long system prompt, a question) lands on one of them, W; once the orchestrator's index shows W holding its
  links, the next turn (the first, its answer, another question) goes to W (a ``cache_hit``), and W's vLLM counts
  prefix-cache hits for it while the other's counts none. The requests ask for one token, so CTX answers them
  alone: a GEN step would record the prompt on a GEN worker too, and with two vLLM instances the only GEN worker
  is one of the two CTX workers (the test is of the CTX pool's choice).
- **A follow-up turn GEN holds skips CTX** (``max_local_prefill_length``). One worker is CTX, the other GEN: turn 1
  goes CTX -> GEN (GEN loads its KV through the connector); once GEN's events show it holding turn 1's prompt,
  turn 2 goes to GEN alone (``gen_cached``), CTX never sees it, GEN's vLLM reuses the handed-off KV from its own
  prefix cache, and the answer is the aggregated worker's, token for token.
"""

from __future__ import annotations

import contextlib
import shutil
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import openai
import pytest
from openai.types.chat import ChatCompletionMessageParam

from orchestrator.routers import matched_tokens, routing_key
from tests.cluster import Node, sample, start_orchestrator
from tests.vllm.answers import MAX_TOKENS, Answer, sdk_client
from tests.vllm.availability import needs_vllm
from tests.vllm.processes import (
    EXTERNAL_HITS,
    METRIC_TIMEOUT_S,
    VllmProcess,
    example_connector,
    metric_value,
    our_worker,
    vllm_processes,
)
from tests.vllm.prompts import MODEL, long_chat
from tests.waiting import eventually

pytestmark = needs_vllm

BLOCK = 128  # vLLM's KV block on the CPU: its prefix cache reuses whole blocks
PREFIX_HITS = "vllm:prefix_cache_hits_total"  # tokens vLLM found in its own prefix cache (not the connector's)
PREFIX_QUERIES = "vllm:prefix_cache_queries_total"  # prompt tokens it looked up: moves with every request's stats
SERVED = "disagg_requests_total"  # our worker's count of the generation requests it answered
THRESHOLD = 64  # max_local_prefill_length of the follow-up test


@dataclass
class Pair:
    a: VllmProcess
    b: VllmProcess
    kv_folder: Path  # ExampleConnector's shared folder


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory, hf_checkpoint: Path) -> Iterator[Pair]:
    folder = tmp_path_factory.mktemp("vllm-routing-kv")
    connector = example_connector(folder)
    logs = tmp_path_factory.mktemp("vllm-routing")
    with vllm_processes((our_worker("both", logs / "a.log", connector), logs / "a.log"),
                        (our_worker("both", logs / "b.log", connector), logs / "b.log")) as (a, b):
        yield Pair(a, b, folder)


def served(worker: VllmProcess) -> float:
    return worker.metric(SERVED)


def cache_figures(worker: VllmProcess) -> tuple[float, float, float]:
    """(prefix-cache queries, local hits, external hits) of ``worker``'s vLLM, read from one scrape."""
    text = worker.metrics()
    return metric_value(text, PREFIX_QUERIES), metric_value(text, PREFIX_HITS), metric_value(text, EXTERNAL_HITS)


def cache_figures_after(worker: VllmProcess, before: tuple[float, float, float], prompt_tokens: int
                        ) -> tuple[float, float]:
    """(local hits, external hits) ``worker``'s vLLM counted for a prompt of ``prompt_tokens`` since ``before``,
    once its stats for that prompt are in (they trail the answer): read when its queries have moved that far."""
    figures: list[tuple[float, float, float]] = []

    def recorded() -> bool:
        figures.append(cache_figures(worker))
        return figures[-1][0] - before[0] >= prompt_tokens

    assert eventually(recorded, timeout_s=METRIC_TIMEOUT_S, every_s=0.2), (figures[-1], before, prompt_tokens)
    _, hits, external = figures[-1]
    return hits - before[1], external - before[2]


def ask(client: openai.OpenAI, messages: list[ChatCompletionMessageParam], max_tokens: int
        ) -> tuple[Answer, int]:
    """Greedy, with each output token (logprobs); and the prompt's token count."""
    reply = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=max_tokens, temperature=0,
                                           logprobs=True)
    choice = reply.choices[0]
    assert choice.logprobs is not None and choice.logprobs.content is not None and reply.usage is not None
    answer = Answer(choice.message.content or "", tuple(t.token for t in choice.logprobs.content),
                    reply.usage.completion_tokens)
    return answer, reply.usage.prompt_tokens


def links_of(messages: list[ChatCompletionMessageParam]) -> frozenset[int]:
    """The prompt's prefix-chain links, as the orchestrator names them (the texts here need no JSON escapes, so
    the SDK's JSON spells each as the orchestrator's encoder does)."""
    return frozenset(routing_key({"messages": messages}, 0, with_chain=True).chain.links)


def placements(orchestrator: Node, placement: str) -> float:
    return sample(orchestrator.metrics, "disagg_prefill_placement_total", placement=placement)


# -- 1. cache-aware routing over two vLLM CTX workers ----------------------------------------------------------------
def test_the_next_turn_goes_to_the_ctx_worker_whose_vllm_holds_its_prefix(pair: Pair) -> None:
    first: list[ChatCompletionMessageParam] = long_chat("routing")
    workers = (pair.a, pair.b)
    with contextlib.ExitStack() as stack:
        orchestrator = start_orchestrator(stack, [pair.a.url, pair.b.url], [pair.b.url], request_timeout_s=600)
        index = orchestrator.app.state.pools["context"].index
        client = stack.enter_context(sdk_client(orchestrator.url))
        served_before = {w.url: served(w) for w in workers}
        answer, first_tokens = ask(client, first, max_tokens=1)
        (w,) = [w for w in workers if served(w) == served_before[w.url] + 1]
        (other,) = [o for o in workers if o is not w]
        assert served(other) == served_before[other.url]
        # W's KV events reached the orchestrator: its index holds every link of the first prompt there, none at
        # the other worker.
        links = links_of(first)
        assert eventually(lambda: links <= index.held(w.url), timeout_s=METRIC_TIMEOUT_S, every_s=0.1), \
            (len(links), len(index.held(w.url)))
        assert not links & index.held(other.url)

        # The conversation's next turn: it shares the first turn's prompt and ends otherwise.
        second: list[ChatCompletionMessageParam] = [
            *first, {"role": "assistant", "content": answer.text},
            {"role": "user", "content": "Who climbs the stairs?"}]
        hits = sample(orchestrator.metrics, "disagg_routing_decisions_total", pool="ctx", decision="cache_hit")
        w_cache, other_cache = cache_figures(w), cache_figures(other)
        served_before = {x.url: served(x) for x in workers}
        _, second_tokens = ask(client, second, max_tokens=1)
        assert sample(orchestrator.metrics, "disagg_routing_decisions_total", pool="ctx",
                      decision="cache_hit") == hits + 1
        assert served(w) == served_before[w.url] + 1 and served(other) == served_before[other.url]
    # W's vLLM found the first turn's prompt in its own prefix cache (its whole blocks; not through the
    # connector's folder, which both workers share), and the other worker's vLLM was asked nothing.
    local, external = cache_figures_after(w, w_cache, second_tokens)
    assert local >= 2 * BLOCK, (local, first_tokens, second_tokens)
    assert local % BLOCK == 0 and external == 0
    assert cache_figures(other) == other_cache


# -- 2. conditional disaggregation: a follow-up turn GEN holds ---------------------------------------------------
def turn_one() -> list[ChatCompletionMessageParam]:
    """A conversation's first turn whose prefix chain ends just past a link's end (``frontend.prefix_chain``: a tail
    shorter than a link is not named), so that the next turn's unnamed remainder, the tail and what the turn adds,
    is well under ``THRESHOLD`` tokens."""
    system, user = long_chat("follow-up")
    base = str(system["content"]) + " Answer briefly."
    for extra in range(200):
        messages: list[ChatCompletionMessageParam] = [
            {"role": "system", "content": base + " Thanks" * extra + "."}, user]
        chain = routing_key({"messages": messages}, 0, with_chain=True).chain
        if chain.total_bytes - chain.covered_bytes(len(chain.links)) < 24:
            return messages
    raise AssertionError("no padding puts the chain's tail under 24 bytes")


def test_a_follow_up_turn_gen_holds_skips_ctx_and_equals_the_aggregated_answer(pair: Pair) -> None:
    ctx, gen = pair.a, pair.b
    conversation = turn_one()
    with contextlib.ExitStack() as stack:
        orchestrator = start_orchestrator(stack, [ctx.url], [gen.url], request_timeout_s=600,
                                          max_local_prefill_length=THRESHOLD)
        gen_pool = orchestrator.app.state.pools["generation"]
        client = stack.enter_context(sdk_client(orchestrator.url))

        gen_cache = cache_figures(gen)
        first, first_tokens = ask(client, conversation, MAX_TOKENS)
        assert placements(orchestrator, "ctx") == 1 and placements(orchestrator, "gen_cached") == 0
        assert first.completion_tokens > 1  # GEN decoded: the prompt was handed off
        # GEN's vLLM loaded turn 1's KV through the connector (all its whole blocks but the last token's).
        _, loaded = cache_figures_after(gen, gen_cache, first_tokens)
        assert loaded >= BLOCK, (loaded, first_tokens)
        # GEN's events say it holds turn 1's prompt (recorded when it accepted the hand-off).
        links = links_of(conversation)
        assert eventually(lambda: links <= gen_pool.index.held(gen.url), timeout_s=METRIC_TIMEOUT_S, every_s=0.1)

        conversation += [{"role": "assistant", "content": first.text},
                         {"role": "user", "content": "And who does he see?"}]
        key = routing_key({"messages": conversation}, 0, with_chain=True)
        uncached = key.prompt_tokens - matched_tokens(gen_pool.index, gen_pool.workers[0], key)
        assert 0 < uncached < THRESHOLD, (uncached, key.prompt_tokens)  # what makes it gen_cached

        ctx_served, gen_served = served(ctx), served(gen)
        gen_cache = cache_figures(gen)
        folders = set(pair.kv_folder.iterdir())
        second, second_tokens = ask(client, conversation, MAX_TOKENS)
        assert placements(orchestrator, "gen_cached") == 1 and placements(orchestrator, "ctx") == 1
        assert served(ctx) == ctx_served  # CTX never saw turn 2
        assert served(gen) == gen_served + 1
    # GEN's vLLM prefilled turn 2 from its own prefix cache: at least the KV it loaded for turn 1, nothing more
    # from the connector. (It keeps a handed-off prompt's blocks like any it computed.)
    reused, external = cache_figures_after(gen, gen_cache, second_tokens)
    assert reused >= loaded, (reused, loaded, second_tokens)
    assert external == 0

    # The aggregated answer: the CTX worker (--role both) asked directly. ExampleConnector saved turn 2's KV in
    # the shared folder when GEN computed it (it saves every prompt it did not load, found by its token ids):
    # removed first, so that the reference computes turn 2 by itself (its external hits stay 0), not from GEN's.
    for saved in set(pair.kv_folder.iterdir()) - folders:
        shutil.rmtree(saved)
    ctx_cache = cache_figures(ctx)
    with sdk_client(ctx.url) as aggregated:
        expected, expected_tokens = ask(aggregated, conversation, MAX_TOKENS)
    assert expected_tokens == second_tokens
    assert cache_figures_after(ctx, ctx_cache, expected_tokens)[1] == 0
    assert expected.completion_tokens > 1
    assert second == expected
