"""The answer equality matrix's parts: the deployments under test, the requests, and an answer read into what must be
equal between a deployment and the aggregated oracle (``--role both``), whole or reassembled from a stream.

Every deployment is an orchestrator of its own in front of real reference-engine workers on loopback: the suite's
CTX/GEN pair (lifecycle v0) or a pair started with lifecycle v1. Prefill is bitwise equal on every worker (BLAS on
one thread, no KV block reuse, so no cache history), and decoding is greedy or seeded, so an answer is compared
exactly: text, finish reasons, usage, every logprob. A stream is compared by what it carries, not by its framing.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

import httpx
import orjson
from fastapi import FastAPI

from frontend.config import parse_config
from orchestrator.server import create_orchestrator_app
from tests.cluster import Recorder
from tests.servers import running
from tests.workers.engines.reference.cluster import RefCluster
from tests.workers.engines.reference.ledger import ADMIN_KEY
from workers.engines.reference.engine import ReferenceEngine
from workers.engines.reference.options import ReferenceOptions
from workers.server import create_worker_app
from workers.settings import Role, WorkerSettings
from workers.trtllm.settings import LifecycleSettings

MODEL = "tiny"
# Conditional disaggregation's threshold: every short prompt below is under it (GEN prefills alone), every long one
# (a short one after LONG_PREFIX) over it (CTX prefills).
# The orchestrator estimates a prompt's tokens as its characters / 4, so a long prompt is past 4 * LOCAL_LIMIT
# characters; in the tiny vocabulary (mostly single bytes) it stays well inside the model's context of 512.
LOCAL_LIMIT = 64
LONG_PREFIX = "Read this first, then answer the question after it. " * 6

Workers = Literal["v0", "v1"]  # TensorRT-LLM's lifecycle protocol version the pair was started with
Api = Literal["chat", "completions", "responses"]
# What GEN is sent: the request alone, our native hand-off (with the prompt's token ids, or only its length), or
# TensorRT-LLM's hand-off after CTX answered or before (generation first), under lifecycle v0 or v1.
Schedule = Literal["gen-alone", "native", "native-length-only", "trtllm-context-first-v0",
                   "trtllm-context-first-v1", "trtllm-generation-first-v0", "trtllm-generation-first-v1"]


@dataclass(frozen=True)
class Deployment:
    """An orchestrator's settings, the worker pair behind it, whether its prompts cross ``LOCAL_LIMIT``, and the
    schedule its requests run (None: none today, see the matrix's known failures)."""

    name: str
    workers: Workers
    schedule: Schedule | None
    options: Mapping[str, Any] = field(default_factory=dict)
    long_prompts: bool = False

    @property
    def gen_alone(self) -> bool:
        """Its prompts are under ``max_local_prefill_length``: GEN prefills them, CTX is never asked."""
        return bool(self.options.get("max_local_prefill_length")) and not self.long_prompts

    @property
    def trtllm_through_ctx(self) -> bool:
        """Its requests go through CTX on TensorRT-LLM's wire."""
        return self.options.get("protocol") == "trtllm" and not self.gen_alone


def _trtllm(**trtllm: Any) -> dict[str, Any]:
    return {"protocol": "trtllm", "trtllm": trtllm}


_LOCAL = {"max_local_prefill_length": LOCAL_LIMIT}
DEPLOYMENTS = (
    Deployment("native", "v0", "native"),
    Deployment("native-metadata-only", "v0", "native-length-only", {"gen_tokids_metadata_only": True}),
    Deployment("native-local-short", "v0", "gen-alone", _LOCAL),
    Deployment("native-local-long", "v0", "native", _LOCAL, long_prompts=True),
    Deployment("trtllm-v0", "v0", "trtllm-context-first-v0", _trtllm()),
    Deployment("trtllm-v0-gen-first", "v0", "trtllm-generation-first-v0", _trtllm(schedule_style="generation_first")),
    Deployment("trtllm-local-short", "v0", "gen-alone", {**_trtllm(), **_LOCAL}),
    Deployment("trtllm-local-long", "v0", "trtllm-context-first-v0", {**_trtllm(), **_LOCAL}, long_prompts=True),
    # Our default orchestrator (protocol detect) before v1 workers: they announce our wire first, and are spoken to in
    # TensorRT-LLM's, the only one that carries v1.
    Deployment("default-v1-workers", "v1", "trtllm-context-first-v1"),
    Deployment("trtllm-v1", "v1", "trtllm-context-first-v1", _trtllm()),
    Deployment("trtllm-v1-gen-first", "v1", "trtllm-generation-first-v1", _trtllm(schedule_style="generation_first")),
)


def schedule_of(gen_body: dict[str, Any]) -> Schedule:
    """The schedule a request ran, read from the body GEN was sent."""
    params = gen_body.get("disaggregated_params")
    if params is None:
        return "gen-alone"
    if params.get("native_extensions"):
        return "native" if "prompt_token_ids_b64" in gen_body else "native-length-only"
    v1 = "consumer_grant_id" in params  # a lifecycle v1 grant
    if params.get("schedule_style") == 1:
        return "trtllm-generation-first-v1" if v1 else "trtllm-generation-first-v0"
    return "trtllm-context-first-v1" if v1 else "trtllm-context-first-v0"


@dataclass
class Deployments:
    oracle: str  # the aggregated worker's URL
    urls: dict[str, str]  # an orchestrator's URL by deployment name
    apps: dict[str, FastAPI]  # an orchestrator's app by deployment name (its metrics)
    ctx: dict[Workers, str]  # each pair's CTX worker's URL (its hand-off ledger)
    gen: dict[Workers, Recorder]  # what each pair's GEN worker was sent


def _worker(stack: contextlib.ExitStack, role: Role, options: ReferenceOptions,
            **settings: Any) -> tuple[str, Recorder]:
    settings = {"admin_key": ADMIN_KEY, **settings}  # the hand-off ledger's key, as on the cluster's workers
    recorder = Recorder(create_worker_app(ReferenceEngine(options), WorkerSettings(role=role, **settings)))
    return stack.enter_context(running(recorder)), recorder


@contextlib.contextmanager
def deployments_running(cluster: RefCluster) -> Iterator[Deployments]:
    """Every deployment of ``DEPLOYMENTS``: the v0 ones in front of the conformance cluster's CTX and GEN, the v1
    ones in front of a pair of their own on the same model; the cluster's aggregated worker is the oracle."""
    assert cluster.ctx.engine is not None and cluster.gen.recorder is not None
    options = cluster.ctx.engine.options
    with contextlib.ExitStack() as stack:
        v1 = LifecycleSettings(protocol_version=1)
        ctx_v1, _ = _worker(stack, "context", options, lifecycle=v1)
        gen_v1, gen_v1_recorder = _worker(stack, "generation", options, lifecycle=v1)
        pairs = {"v0": (cluster.ctx.url, cluster.gen.url), "v1": (ctx_v1, gen_v1)}
        urls: dict[str, str] = {}
        apps: dict[str, FastAPI] = {}
        for deployment in DEPLOYMENTS:
            ctx, gen = pairs[deployment.workers]
            settings = dict(deployment.options)
            protocol = settings.pop("protocol", "detect")
            config = parse_config({"context_servers": {"urls": [ctx], "protocol": protocol},
                                   "generation_servers": {"urls": [gen], "protocol": protocol}, **settings})
            apps[deployment.name] = create_orchestrator_app(config)
            urls[deployment.name] = stack.enter_context(running(apps[deployment.name]))
        yield Deployments(cluster.aggregated.url, urls, apps, {"v0": cluster.ctx.url, "v1": ctx_v1},
                          {"v0": cluster.gen.recorder, "v1": gen_v1_recorder})


# -- requests ----------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Case:
    """One request shape: its API, and its body for a prompt (``long``: one past ``LOCAL_LIMIT``)."""

    name: str
    api: Api
    body: Callable[[bool], dict[str, Any]]

    @property
    def path(self) -> str:
        return {"chat": "/v1/chat/completions", "completions": "/v1/completions", "responses": "/v1/responses"}[
            self.api]


def text(prompt: str, long: bool) -> str:
    return LONG_PREFIX + prompt if long else prompt


class RequestFailed(AssertionError):
    """A deployment answered with an error where the oracle answered; its status and body are in the message."""

    def __init__(self, status: int, body: str) -> None:
        super().__init__(f"status {status}: {body}")
        self.status = status
        self.body = body


def _post(url: str, path: str, body: dict[str, Any]) -> dict[str, Any]:
    reply = httpx.post(url + path, json={"model": MODEL, **body}, timeout=60)
    if reply.status_code != 200:
        raise RequestFailed(reply.status_code, reply.text)
    answer: dict[str, Any] = reply.json()
    return answer


def _events(url: str, path: str, body: dict[str, Any]) -> list[dict[str, Any]]:
    with httpx.stream("POST", url + path, json={"model": MODEL, **body, "stream": True}, timeout=60) as reply:
        if reply.status_code != 200:
            raise RequestFailed(reply.status_code, reply.read().decode())
        data = [line[6:] for line in reply.iter_lines() if line.startswith("data: ")]
    if path != "/v1/responses":
        assert data[-1] == "[DONE]", data[-3:]
        data = data[:-1]
    return [orjson.loads(line) for line in data]


def ask(url: str, case: Case, long: bool, stream: bool, stored: bool = True) -> dict[str, Any]:
    """``case``'s answer from ``url``, read into the fields that must be equal (``answer``). ``stored``: the server
    keeps Responses (an orchestrator), so a chain's follow-ups name the turn before; otherwise (a worker) they
    carry the conversation so far."""
    body = case.body(long)
    if case.api == "responses":
        return _response_answer(url, body, stream, stored)
    if not stream:
        return answer(case.api, _post(url, case.path, body))
    return reassembled(case.api, _events(url, case.path, {**body, "stream_options": {"include_usage": True}}))


# -- reading answers ---------------------------------------------------------------------------------------------
def _chat_logprobs(logprobs: dict[str, Any] | None) -> list[Any] | None:
    if logprobs is None:
        return None
    return [(e["token"], e["logprob"], e["bytes"], [(t["token"], t["logprob"]) for t in e["top_logprobs"]])
            for e in logprobs.get("content") or ()]


def _usage(usage: dict[str, Any] | None) -> Any:
    if usage is None:
        return None
    return {k: usage.get(k) for k in ("prompt_tokens", "completion_tokens", "total_tokens")}


def answer(api: Api, whole: dict[str, Any]) -> dict[str, Any]:
    """A whole chat or completions answer's choices, usage and prompt logprobs."""
    choices: dict[int, dict[str, Any]] = {}
    for choice in whole["choices"]:
        if api == "chat":
            message = choice["message"]
            choices[choice["index"]] = {"text": message.get("content"), "finish": choice["finish_reason"],
                                        "logprobs": _chat_logprobs(choice.get("logprobs")),
                                        "tool_calls": message.get("tool_calls") or None}
        else:
            logprobs = choice.get("logprobs")
            choices[choice["index"]] = {"text": choice["text"], "finish": choice["finish_reason"],
                                        "logprobs": None if logprobs is None else
                                        {k: logprobs[k] for k in ("tokens", "token_logprobs", "top_logprobs",
                                                                   "text_offset")},
                                        "prompt_logprobs": choice.get("prompt_logprobs")}
    result = {"choices": choices, "usage": _usage(whole.get("usage"))}
    if api == "chat":
        result["prompt_logprobs"] = whole.get("prompt_logprobs")
    return result


def reassembled(api: Api, chunks: list[dict[str, Any]]) -> dict[str, Any]:
    """A stream's chunks read into the shape ``answer`` gives a whole answer."""
    choices: dict[int, dict[str, Any]] = {}
    usage = None
    prompt_logprobs = None
    for chunk in chunks:
        usage = chunk.get("usage") or usage
        prompt_logprobs = chunk.get("prompt_logprobs") or prompt_logprobs
        for c in chunk["choices"]:
            into = choices.setdefault(c["index"], {"text": None, "finish": None, "logprobs": None})
            if c.get("finish_reason") is not None:
                assert into["finish"] is None, "a choice finished twice"
                into["finish"] = c["finish_reason"]
            if api == "chat":
                into.setdefault("tool_calls", None)
                piece = c["delta"].get("content")
                if piece is not None:
                    into["text"] = (into["text"] or "") + piece
                if c["delta"].get("tool_calls"):
                    into["tool_calls"] = (into["tool_calls"] or []) + c["delta"]["tool_calls"]
                entries = _chat_logprobs(c.get("logprobs"))
                if entries is not None:
                    into["logprobs"] = (into["logprobs"] or []) + entries
            else:
                into.setdefault("prompt_logprobs", None)
                into["text"] = (into["text"] or "") + c["text"]
                if c.get("prompt_logprobs"):
                    into["prompt_logprobs"] = c["prompt_logprobs"]
                if c.get("logprobs"):
                    into["logprobs"] = into["logprobs"] or {k: [] for k in ("tokens", "token_logprobs",
                                                                           "top_logprobs", "text_offset")}
                    for k in into["logprobs"]:
                        into["logprobs"][k] += c["logprobs"][k]
    result = {"choices": choices, "usage": _usage(usage)}
    if api == "chat":
        result["prompt_logprobs"] = prompt_logprobs
    return result


# A chain turn's ``call_id`` that means the one of the function call the turn before made (each server names its own).
PREVIOUS_CALL_ID = "<the previous turn's call_id>"


def _with_previous_call_id(turn: dict[str, Any], response: dict[str, Any]) -> dict[str, Any]:
    if not isinstance(turn["input"], list):
        return dict(turn)
    ids = [item["call_id"] for item in response.get("output", ()) if item["type"] == "function_call"]
    assert ids or PREVIOUS_CALL_ID not in str(turn["input"]), f"the turn before made no function call: {response}"
    items = [{**item, "call_id": ids[0]} if item.get("call_id") == PREVIOUS_CALL_ID else item
             for item in turn["input"]]
    return {**turn, "input": items}


def _response_answer(url: str, body: dict[str, Any], stream: bool, stored: bool) -> dict[str, Any]:
    """A Responses answer; with ``chain``, its last turn's, each turn after the first a follow-up of the one before
    (by ``previous_response_id`` where ``stored``, as OpenAI keeps a conversation: instructions not carried)."""
    turns = body.pop("chain", None) or [body]
    history: list[Any] = []
    previous = None
    response: dict[str, Any] = {}
    for turn in turns:
        request = _with_previous_call_id(turn, response)
        if stored and previous is not None:
            request["previous_response_id"] = previous
        elif not stored:
            said = [{"role": "user", "content": turn["input"]}] if isinstance(turn["input"], str) \
                else request["input"]
            request["input"] = [*history, *said]
            request["store"] = False
        if not stream:
            response = _post(url, "/v1/responses", request)
        else:
            events = _events(url, "/v1/responses", request)
            final = events[-1]
            assert final["type"] in ("response.completed", "response.incomplete"), final["type"]
            response = final["response"]
            deltas = "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta")
            assert deltas == _output_text(response), (deltas, response)
            arguments = ["".join(e["delta"] for e in events if e["type"] == "response.function_call_arguments.delta"
                                 and e["item_id"] == item["id"])
                         for item in response["output"] if item["type"] == "function_call"]
            assert arguments == [item["arguments"] for item in response["output"] if item["type"] == "function_call"]
        previous = response["id"]
        if not stored:
            history = [*request["input"], *response["output"]]
    usage = response.get("usage") or {}
    return {"status": response["status"], "incomplete": response.get("incomplete_details"),
            "settings": {k: response.get(k) for k in ("instructions", "temperature", "max_output_tokens", "tools",
                                                      "tool_choice", "parallel_tool_calls")},
            "output": [_item(item) for item in response["output"]],
            "usage": {k: usage.get(k) for k in ("input_tokens", "output_tokens", "total_tokens")}}


def _output_text(response: dict[str, Any]) -> str:
    return "".join(part.get("text", "") for item in response["output"] if item["type"] == "message"
                   for part in item["content"])


def _item(item: dict[str, Any]) -> dict[str, Any]:
    if item["type"] == "message":
        return {"type": "message", "role": item["role"], "status": item.get("status"),
                "content": [(p["type"], p.get("text"), p.get("logprobs")) for p in item["content"]]}
    return {k: v for k, v in item.items() if k not in ("id", "call_id")}
