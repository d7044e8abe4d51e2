"""The shape of a worker's answers, chosen once per request by ``WorkerService``: ``Native``, ours, for our
orchestrator and plain clients; or TensorRT-LLM's (``workers.trtllm.answers.Trtllm``) for its orchestrator, whose
response models refuse fields they lack. Past that choice no step asks the request which shape it wants."""

from __future__ import annotations

from typing import Any, Protocol

import pybase64

from frontend.disaggregated_params import DisaggregatedParams
from frontend.openai_models import GenerationWireRequest
from frontend.sampling import SamplingParams
from frontend.token_codec import encode_prompt_tokens
from workers.engines.request import GenerationRequest, Phase
from workers.text_stream import CollectedChoice, CollectedOutput


class AnswerDialect(Protocol):
    def refuse_unservable(self, wire: GenerationWireRequest, sampling: SamplingParams, phase: Phase) -> None:
        """Refuse, before the engine runs, what this shape cannot carry."""

    def answered_at_context(self, disagg: DisaggregatedParams | None, sampling: SamplingParams) -> bool:
        """Whether CTX's first tokens are this GEN request's whole answer (no engine is asked); ``sampling`` has its
        budget resolved."""

    def add_context_fields(self, body: dict[str, Any], request: GenerationRequest, disagg: DisaggregatedParams,
                           out: CollectedOutput, endpoint: str) -> None:
        """Put CTX's hand-off (first tokens, KV state, prompt) into its answer's ``body``."""

    def finish_whole(self, body: dict[str, Any]) -> None:
        """The last change to a whole answer's body."""


def parked_state(out: CollectedOutput) -> str | None:
    """The KV hand-off CTX parked, base64; None when every sequence finished at CTX (no GEN will need it)."""
    if out.handoff_state is None or out.finished:
        return None
    return pybase64.b64encode(out.handoff_state).decode("ascii")


def sequence_start(choice: CollectedChoice, with_logprobs: bool) -> dict[str, Any]:
    """What GEN needs to continue one sequence CTX started: its first token(s) (and their logprobs)."""
    start: dict[str, Any] = {"first_gen_tokens": choice.token_ids}
    if with_logprobs:
        start["first_gen_logprobs"] = [
            {"token_id": lp.token_id, "logprob": lp.logprob, "top": [list(t) for t in lp.top]}
            for lp in choice.logprobs
        ]
    return start


class Native:
    """Our own shape: every field we have, the hand-off of n sequences, the prompt as base64 int32 when asked."""

    def refuse_unservable(self, wire: GenerationWireRequest, sampling: SamplingParams, phase: Phase) -> None:
        return None

    def answered_at_context(self, disagg: DisaggregatedParams | None, sampling: SamplingParams) -> bool:
        return False  # our CTX says when it finished, and our orchestrator then calls no GEN

    def add_context_fields(self, body: dict[str, Any], request: GenerationRequest, disagg: DisaggregatedParams,
                           out: CollectedOutput, endpoint: str) -> None:
        with_logprobs = request.sampling.logprobs is not None
        first, *more = out.choices
        params: dict[str, Any] = {
            "request_type": "context_only",
            "ctx_request_id": request.request_id,
            "disagg_request_id": disagg.disagg_request_id,
            **sequence_start(first, with_logprobs),
            "encoded_opaque_state": parked_state(out),
            "prompt_len": request.prompt_len,
            "native_extensions": True,  # GEN gets these params back: it answers our orchestrator in our shape
        }
        if more:  # n > 1: one hand-off (the prompt's KV) starts every sequence
            params["more_sequences"] = [sequence_start(choice, with_logprobs) for choice in more]
        if out.cached_tokens:
            params["cached_tokens"] = out.cached_tokens
        if "choices" in body:
            body["choices"][0]["disaggregated_params"] = params
        else:
            body["disaggregated_params"] = params
        if disagg.return_prompt_token_ids_b64 and not out.finished:  # finished: no GEN will need it
            body["prompt_token_ids"] = None
            body["prompt_token_ids_b64"] = encode_prompt_tokens(request.prompt_token_ids_i32)

    def finish_whole(self, body: dict[str, Any]) -> None:
        return None


NATIVE = Native()
