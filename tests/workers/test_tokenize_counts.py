"""A worker's /metrics shows what its conversation cache saved: a follow-up turn over real HTTP is a hit."""

from __future__ import annotations

import httpx

from tests.servers import running
from workers.engines.factory import create_engine
from workers.engines.options import EngineOptions
from workers.server import create_worker_app
from workers.settings import WorkerSettings


def _metric(text: str, name: str) -> float:
    for line in text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    raise AssertionError(f"{name} not exported")


def _optional(text: str, name: str) -> float:
    try:
        return _metric(text, name)
    except AssertionError:
        return 0.0


def test_a_follow_up_turn_is_served_from_the_conversation_cache_and_counted() -> None:
    engine = create_engine("synthetic", EngineOptions(tokenizer="reference"))
    app = create_worker_app(engine, WorkerSettings(role="both", kv_events_endpoint=None,
                                                   kv_events_replay_endpoint=None))
    history = [{"role": "user", "content": "Summarise this report. " + "The figures rose in every quarter. " * 300}]
    with running(app) as url:
        model = httpx.get(f"{url}/v1/models", timeout=30).json()["data"][0]["id"]
        before = httpx.get(f"{url}/metrics", timeout=30).text  # the engine may have encoded text of its own
        usages = []
        for follow_up in ("And the risks?", "And the outlook?"):
            reply = httpx.post(f"{url}/v1/chat/completions", timeout=60,
                               json={"model": model, "messages": history, "max_tokens": 4})
            assert reply.status_code == 200, reply.text
            usages.append(reply.json()["usage"]["prompt_tokens"])
            history = [*history, {"role": "assistant", "content": reply.json()["choices"][0]["message"]["content"]},
                       {"role": "user", "content": follow_up}]
        reply = httpx.post(f"{url}/v1/chat/completions", timeout=60,
                           json={"model": model, "messages": history, "max_tokens": 4})
        assert reply.status_code == 200, reply.text
        metrics = httpx.get(f"{url}/metrics", timeout=30).text
    prompts = _metric(metrics, "disagg_tokenize_prompts_total") - _optional(before, "disagg_tokenize_prompts_total")
    assert prompts == 3
    assert _metric(metrics, "disagg_tokenize_cache_hits_total") == 2
    # Each follow-up took all of the turn before it (bar the "assistant" line after the last added token) from
    # the cache: at least the first prompt's tokens twice over.
    assert _metric(metrics, "disagg_tokenize_cache_reused_tokens_total") >= 2 * (usages[0] - 3)
    encoded = (_metric(metrics, "disagg_tokenize_encoded_tokens_total")
               - _optional(before, "disagg_tokenize_encoded_tokens_total"))
    assert encoded < usages[0] + 200
    assert _metric(metrics, "disagg_tokenize_cache_entries") == 1  # one conversation, its latest turn
    assert _metric(metrics, "disagg_tokenize_cache_bytes") > 0
    # The reference tokenizer's chat template renders message by message: each follow-up rendered only its turns.
    assert _metric(metrics, "disagg_tokenize_render_hits_total") == 2
    assert _metric(metrics, "disagg_tokenize_render_reused_messages_total") == 1 + 3
    assert _metric(metrics, "disagg_tokenize_render_bytes") > 0
