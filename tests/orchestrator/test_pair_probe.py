"""KV that never moved, seen for real: reference-engine workers where one CTX's KV cannot be fetched.

The failure is a real misconfiguration, not a test hook: the bad CTX advertises its KV transfer server at 127.0.0.2,
where nothing listens (the server binds 127.0.0.1), so every fetch from it is refused, as when a pod advertises an
address its peers cannot reach. The GEN runs ``kv_load_failure_policy="recompute"`` (vLLM's policy of that name):
it prefills the prompt itself and answers right, only at twice the cost. The good CTX hands off as it should.
One set of workers serves every test (each reference worker is an engine core process); orchestrators, which are
cheap, are made per test.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import pathlib
import threading
import urllib.parse
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import httpx
import orjson
import pybase64
import pytest

from frontend.config import parse_config
from frontend.prompt_report import PROMPT_TOKENS_HEADER, PromptReport, read_prompt_report
from orchestrator.server import create_orchestrator_app
from tests.cluster import sample
from tests.servers import running
from tests.waiting import eventually
from tests.workers.engines.reference.cluster import RefNode, start_reference_worker
from tests.workers.engines.reference.tiny_model import write_tiny_model
from workers.engines.reference.options import ReferenceOptions

ADMIN = "pair-probe-admin"
PROMPT = "The quick brown fox jumps over the lazy dog, and then the dog jumps over the fox."


@dataclass
class Workers:
    good_ctx: RefNode
    bad_ctx: RefNode
    gen: RefNode


@pytest.fixture(scope="module")
def workers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Workers]:
    model: pathlib.Path = write_tiny_model(tmp_path_factory.mktemp("pair-probe") / "tiny.gguf", seed=0)
    options = ReferenceOptions(model_path=str(model), served_model_name="tiny", blas_threads=1)
    with contextlib.ExitStack() as stack:
        good = start_reference_worker(stack, "context", options)
        bad = start_reference_worker(stack, "context", ReferenceOptions(
            model_path=str(model), served_model_name="tiny", blas_threads=1, kv_advertise_host="127.0.0.2"))
        gen = start_reference_worker(stack, "generation", ReferenceOptions(
            model_path=str(model), served_model_name="tiny", blas_threads=1, kv_load_failure_policy="recompute"))
        yield Workers(good, bad, gen)


@contextlib.contextmanager
def orchestrator(ctx: list[RefNode], gen: RefNode, admin_key: str | None = None, **options: Any) -> Iterator[RefNode]:
    config = parse_config({"context_servers": {"urls": [c.url for c in ctx]},
                           "generation_servers": {"urls": [gen.url]}, **options})
    app = create_orchestrator_app(config, admin_key=admin_key)
    with running(app) as url:
        yield RefNode(url, app)


def recomputed(node: RefNode, gen: RefNode) -> float:
    return sample(node.app.state.metrics, "disagg_gen_prompt_tokens_recomputed_total", pool="gen", worker=gen.url)


def complete(node: RefNode, prompt: str = PROMPT, stream: bool = False) -> tuple[str, int]:
    """The greedy answer's text and the prompt's length as the server counted it."""
    client = node.client()
    if not stream:
        answer = client.completions.create(model="tiny", prompt=prompt, max_tokens=8, temperature=0)
        assert answer.usage is not None
        return answer.choices[0].text, answer.usage.prompt_tokens
    text, prompt_tokens = "", 0
    for chunk in client.completions.create(model="tiny", prompt=prompt, max_tokens=8, temperature=0, stream=True,
                                           stream_options={"include_usage": True}):
        text += "".join(choice.text for choice in chunk.choices)
        if chunk.usage is not None:
            prompt_tokens = chunk.usage.prompt_tokens
    return text, prompt_tokens


def test_a_gen_that_recomputes_is_counted_logged_once_and_still_answers_right(
        workers: Workers, caplog: pytest.LogCaptureFixture) -> None:
    with orchestrator([workers.good_ctx], workers.gen) as good, orchestrator([workers.bad_ctx], workers.gen) as bad:
        expected, prompt_tokens = complete(good)
        assert recomputed(good, workers.gen) == 0  # exported at 0 from start-up, and still 0: the KV moved
        with caplog.at_level(logging.WARNING, logger="disagg_serve.recompute"):
            assert complete(bad) == (expected, prompt_tokens)  # the same greedy answer, paid for twice
            assert recomputed(bad, workers.gen) == prompt_tokens
            assert complete(bad, stream=True) == (expected, prompt_tokens)  # a stream's head says so too
        assert recomputed(bad, workers.gen) == 2 * prompt_tokens
        lines = [r.getMessage() for r in caplog.records if r.name == "disagg_serve.recompute"]
        assert len(lines) == 1, lines  # the first case of the minute, not one line per answer
        assert workers.gen.url in lines[0] and workers.bad_ctx.url in lines[0]
        assert f"computed {prompt_tokens} of {prompt_tokens} prompt tokens itself" in lines[0]


def handed_off(ctx: RefNode, gen: RefNode) -> httpx.Response:
    """CTX then GEN, called as our orchestrator calls them (its own wire), without one."""
    body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 4, "temperature": 0}
    ctx_reply = httpx.post(ctx.url + "/v1/completions", timeout=60, json={**body, "disaggregated_params": {
        "request_type": "context_only", "disagg_request_id": 1, "native_extensions": True,
        "return_prompt_token_ids_b64": True}})
    assert ctx_reply.status_code == 200, ctx_reply.text
    answer = ctx_reply.json()
    params = answer["choices"][0]["disaggregated_params"]
    return httpx.post(gen.url + "/v1/completions", timeout=60, json={
        **body, "prompt_token_ids_b64": answer["prompt_token_ids_b64"],
        "disaggregated_params": {**params, "request_type": "generation_only"}})


def test_each_gen_answer_says_what_of_the_prompt_came_through_the_hand_off(workers: Workers) -> None:
    moved = handed_off(workers.good_ctx, workers.gen)
    assert moved.status_code == 200, moved.text
    prompt_tokens = moved.json()["usage"]["prompt_tokens"]
    assert read_prompt_report(moved.headers[PROMPT_TOKENS_HEADER]) == PromptReport(prompt_tokens, 0)
    lost = handed_off(workers.bad_ctx, workers.gen)
    assert lost.status_code == 200, lost.text
    assert read_prompt_report(lost.headers[PROMPT_TOKENS_HEADER]) == PromptReport(0, prompt_tokens)
    assert lost.json()["choices"][0]["text"] == moved.json()["choices"][0]["text"]
    # A CTX answer is no GEN answer: it carries no report.
    ctx_only = httpx.post(workers.good_ctx.url + "/v1/completions", timeout=60, json={
        "model": "tiny", "prompt": PROMPT, "max_tokens": 4, "disaggregated_params": {
            "request_type": "context_only", "disagg_request_id": 2, "native_extensions": True}})
    assert PROMPT_TOKENS_HEADER not in ctx_only.headers


def probe(node: RefNode, method: str = "POST", key: str = ADMIN) -> httpx.Response:
    return httpx.request(method, node.url + "/admin/pair-probe", headers={"Authorization": f"Bearer {key}"},
                         timeout=120)


def test_the_probe_keeps_the_failing_pair_out_of_routing_and_passes_the_good_one(workers: Workers) -> None:
    good_pair, bad_pair = (workers.good_ctx.url, workers.gen.url), (workers.bad_ctx.url, workers.gen.url)
    with orchestrator([workers.good_ctx, workers.bad_ctx], workers.gen, admin_key=ADMIN) as node:
        assert probe(node, key="wrong").status_code == 401
        reply = probe(node)
        assert reply.status_code == 200, reply.text
        verdicts = {(v["ctx"], v["gen"]): v for v in reply.json()["pairs"]}
        assert verdicts[good_pair]["outcome"] == "passed" and verdicts[good_pair]["computed_by_gen"] == 0
        assert verdicts[bad_pair]["outcome"] == "recomputed"
        assert "did not come from the CTX worker" in verdicts[bad_pair]["cause"]
        assert reply.json()["kept_out_of_routing"] == [{"ctx": bad_pair[0], "gen": bad_pair[1],
                                                        "cause": verdicts[bad_pair]["cause"]}]
        metrics = node.app.state.metrics
        assert sample(metrics, "disagg_pair_probe_passing", ctx=good_pair[0], gen=good_pair[1]) == 1
        assert sample(metrics, "disagg_pair_probe_passing", ctx=bad_pair[0], gen=bad_pair[1]) == 0
        assert sample(metrics, "disagg_pair_probes_total", outcome="recomputed") == 1
        # The probe's own recompute was real work, and is counted as such.
        after_probe = recomputed(node, workers.gen)
        assert after_probe == verdicts[bad_pair]["prompt_tokens"]
        # Now every request goes through the pair that passed: no prompt is computed twice any more (the cache-
        # aware router would otherwise spread these different prompts over both CTX workers).
        for i in range(6):
            complete(node, prompt=f"{i} {PROMPT}")
        assert recomputed(node, workers.gen) == after_probe
        assert probe(node, method="GET").json()["kept_out_of_routing"][0]["ctx"] == bad_pair[0]


def test_a_fleet_whose_every_pair_fails_still_answers(workers: Workers) -> None:
    """A failing pair is picked last, never refused: a probe that fails every pair (a fleet-wide misconfiguration,
    or a probe of its own gone wrong) costs prefills twice, not a fleet that answers nothing."""
    with orchestrator([workers.bad_ctx], workers.gen, admin_key=ADMIN) as node:
        kept_out = probe(node).json()["kept_out_of_routing"]
        assert [(pair["ctx"], pair["gen"]) for pair in kept_out] == [(workers.bad_ctx.url, workers.gen.url)]
        text, prompt_tokens = complete(node)
        assert text and prompt_tokens > 0
        assert complete(node, stream=True) == (text, prompt_tokens)


class Forwarder:
    """A TCP forwarder from ``listen`` to ``target`` (host, port), in its own thread and loop: the network path to
    the bad CTX's advertised KV address, put right."""

    def __init__(self, listen: tuple[str, int], target: tuple[str, int]) -> None:
        self.listen, self.target = listen, target
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.server: asyncio.Server | None = None
        self.connections: set[asyncio.Task[None]] = set()

    async def _pipe(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        with contextlib.suppress(ConnectionError):
            while data := await reader.read(65536):
                writer.write(data)
                await writer.drain()
        writer.close()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self.connections.add(task)
        try:
            upstream_reader, upstream_writer = await asyncio.open_connection(*self.target)
            await asyncio.gather(self._pipe(reader, upstream_writer), self._pipe(upstream_reader, writer))
        finally:
            self.connections.discard(task)

    def __enter__(self) -> Forwarder:
        self.thread.start()
        self.server = asyncio.run_coroutine_threadsafe(
            asyncio.start_server(self._serve, *self.listen), self.loop).result(timeout=10)
        return self

    def __exit__(self, *_: object) -> None:
        async def close() -> None:
            assert self.server is not None
            self.server.close()
            for task in list(self.connections):  # (a GEN's fetch closes its connection; any left is cut)
                task.cancel()
            await asyncio.gather(*self.connections, return_exceptions=True)

        asyncio.run_coroutine_threadsafe(close(), self.loop).result(timeout=10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=10)


def advertised_kv_address(ctx: RefNode) -> tuple[str, int]:
    """Where ``ctx`` tells GEN workers to fetch its KV from (read from a hand-off it gives out, then released)."""
    reply = httpx.post(ctx.url + "/v1/completions", timeout=60, json={
        "model": "tiny", "prompt": PROMPT, "max_tokens": 4, "disaggregated_params": {
            "request_type": "context_only", "disagg_request_id": 3, "native_extensions": True}})
    params = reply.json()["choices"][0]["disaggregated_params"]
    httpx.post(ctx.url + "/v1/disagg/release", timeout=60, json={
        "ctx_request_id": params["ctx_request_id"], "encoded_opaque_state": params["encoded_opaque_state"]})
    kv_url = urllib.parse.urlsplit(orjson.loads(pybase64.b64decode(params["encoded_opaque_state"]))["kv_url"])
    assert kv_url.hostname is not None and kv_url.port is not None
    return kv_url.hostname, kv_url.port


def test_a_pair_kept_out_is_routable_again_once_a_probe_passes(workers: Workers) -> None:
    bad_pair = (workers.bad_ctx.url, workers.gen.url)
    host, port = advertised_kv_address(workers.bad_ctx)
    assert host == "127.0.0.2"
    with orchestrator([workers.good_ctx, workers.bad_ctx], workers.gen, admin_key=ADMIN) as node:
        verdicts = {(v["ctx"], v["gen"]): v["outcome"] for v in probe(node).json()["pairs"]}
        assert verdicts[bad_pair] == "recomputed"
        # The operator puts the network path right: the advertised address now reaches the KV transfer server.
        with Forwarder((host, port), ("127.0.0.1", port)):
            reply = probe(node).json()
            verdicts = {(v["ctx"], v["gen"]): v["outcome"] for v in reply["pairs"]}
            assert verdicts[bad_pair] == "passed" and reply["kept_out_of_routing"] == []
            metrics = node.app.state.metrics
            assert sample(metrics, "disagg_pair_probe_passing", ctx=bad_pair[0], gen=bad_pair[1]) == 1


def test_the_pairs_of_a_worker_that_left_its_pool_are_judged_no_more(workers: Workers) -> None:
    with orchestrator([workers.good_ctx, workers.bad_ctx], workers.gen, admin_key=ADMIN) as node:
        assert probe(node).json()["kept_out_of_routing"]
        left = httpx.request("DELETE", node.url + "/admin/workers", headers={"Authorization": f"Bearer {ADMIN}"},
                             json={"role": "context", "url": workers.bad_ctx.url}, timeout=30)
        assert left.status_code == 200, left.text
        reply = probe(node).json()
        assert reply["kept_out_of_routing"] == []
        assert [(v["ctx"], v["outcome"]) for v in reply["pairs"]] == [(workers.good_ctx.url, "passed")]
        registry = node.app.state.metrics.registry
        assert registry.get_sample_value("disagg_pair_probe_passing",
                                         {"ctx": workers.bad_ctx.url, "gen": workers.gen.url}) is None


def test_an_enabled_probe_runs_at_start_up(workers: Workers) -> None:
    with orchestrator([workers.good_ctx, workers.bad_ctx], workers.gen,
                      pair_probe={"enabled": True, "interval_s": 3600}) as node:
        metrics = node.app.state.metrics
        assert eventually(lambda: sample(metrics, "disagg_pair_probes_total", outcome="passed")
                          + sample(metrics, "disagg_pair_probes_total", outcome="recomputed") == 2)
        assert sample(metrics, "disagg_pair_probe_passing", ctx=workers.bad_ctx.url, gen=workers.gen.url) == 0
        # (no admin key configured: the on-demand route is closed, as every admin route is without one)
        assert probe(node).status_code in (401, 403, 404)


def test_a_pair_whose_gen_fails_the_fetch_is_failed_with_its_cause(workers: Workers,
                                                                   tmp_path_factory: pytest.TempPathFactory) -> None:
    """A GEN on the default policy ("fail") refuses the hand-off it cannot fetch: the pair fails, with the cause."""
    model = write_tiny_model(tmp_path_factory.mktemp("strict") / "tiny.gguf", seed=0)
    with contextlib.ExitStack() as stack:
        strict_gen = start_reference_worker(stack, "generation", ReferenceOptions(
            model_path=str(model), served_model_name="tiny", blas_threads=1))
        with orchestrator([workers.bad_ctx], strict_gen, admin_key=ADMIN) as node:
            (verdict,) = probe(node).json()["pairs"]
    assert verdict["outcome"] == "failed"
    assert "the GEN worker answered" in verdict["cause"] and "KV fetch" in verdict["cause"]

