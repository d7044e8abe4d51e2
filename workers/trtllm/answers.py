"""Answering TensorRT-LLM's orchestrator in its field set (``Trtllm``, chosen for a request whose
``disaggregated_params`` lack our ``native_extensions``): its response models refuse unknown fields.

- CTX: ``ctx_request_id`` an int, ``first_gen_log_probs``, no ``prompt_len``, ``finish_reason: "not_finished"``
  when GEN must continue (it calls GEN only on ``"length"`` or ``"not_finished"``), and always the prompt;
- every whole answer: no ``system_fingerprint``, and ``prompt_logprobs`` only where nothing else would carry them
  (``Trtllm``). Streams are relayed unparsed and keep our chunk shape. docs/interop.md lists the fields.
"""

from __future__ import annotations

import logging
import secrets
import uuid
from collections.abc import AsyncGenerator
from typing import Any

from frontend.disaggregated_params import DisaggregatedParams
from frontend.errors import HandoffError, UnsupportedParameterError
from frontend.openai_models import GenerationWireRequest
from frontend.sampling import SamplingParams
from frontend.token_codec import encode_prompt_tokens
from frontend.trtllm.identity import LIFECYCLE_FIELDS, has_identity
from workers.dialects import NATIVE, parked_state
from workers.engines.base import Tokenizer
from workers.engines.outputs import TokenLogprob
from workers.engines.request import GenerationRequest, Phase
from workers.text_stream import CollectedOutput, TextStep
from workers.trtllm.generation_first import HandoffBoard
from workers.trtllm.lifecycle import LifecycleControl

logger = logging.getLogger("disagg_serve.worker.generation_first")

NOT_FINISHED = "not_finished"
GEN_PENDING_FINISH_REASONS = ("length", NOT_FINISHED)  # a CTX answer that TensorRT-LLM continues on GEN


def new_request_id(disagg: DisaggregatedParams | None) -> str:
    """A CTX request's id doubles as the hand-off's ``ctx_request_id``. TensorRT-LLM's is an int, so it is always
    the decimal form of one: sent as an int to TensorRT-LLM's orchestrator, and convertible to one by ours when a
    mixed fleet hands it to a trtllm-serve GEN; GEN's ``str(ctx_request_id)`` names the same hand-off either way."""
    if disagg is not None and disagg.request_type == "context_only":
        return str(secrets.randbits(63))  # not guessable: it names a parked hand-off
    return uuid.uuid4().hex


class Trtllm:
    """TensorRT-LLM's shape; under lifecycle v1 its CTX answer also parks the attempt's artifact, and in generation
    first it posts the hand-off on the board for the GEN that came first.

    ``prompt_logprobs`` has no field in TensorRT-LLM's whole answers: kept for a caller that proved it is one of this
    deployment's own processes (``keeps_prompt_logprobs``: our orchestrator reads our fields), and for any other
    caller never dropped silently: a whole answer that would lose it is refused, a CTX answer drops it only when GEN
    answers the request."""

    def __init__(self, lifecycle: LifecycleControl, board: HandoffBoard, *,
                 keeps_prompt_logprobs: bool = False) -> None:
        self.lifecycle = lifecycle
        self.board = board
        self.keeps_prompt_logprobs = keeps_prompt_logprobs

    def refuse_unservable(self, wire: GenerationWireRequest, sampling: SamplingParams, phase: Phase) -> None:
        if sampling.n > 1 and phase is not Phase.AGGREGATED:
            # TensorRT-LLM's hand-off fields start one sequence; the others' first tokens have no field there.
            raise UnsupportedParameterError("n > 1 is not served in TensorRT-LLM's disaggregated wire; send it to an "
                                            "aggregated worker or through disagg-serve's orchestrator", param="n")
        if (getattr(wire, "prompt_logprobs", None) is not None and not self.keeps_prompt_logprobs
                and not wire.stream and phase is not Phase.CONTEXT_ONLY):
            raise UnsupportedParameterError("prompt_logprobs has no field in TensorRT-LLM's whole answers; stream the "
                                            "request, or send it through disagg-serve's orchestrator on its native "
                                            "wire", param="prompt_logprobs")

    def answered_at_context(self, disagg: DisaggregatedParams | None, sampling: SamplingParams) -> bool:
        assert sampling.max_tokens is not None
        if not finished_at_context(disagg, sampling.max_tokens):
            return False
        if sampling.prompt_logprobs is not None:
            # CTX scored the prompt, but TensorRT-LLM's hand-off has no field for the scores: answered from the
            # first token alone, every prompt token's logprob would read null.
            echoed = sampling.echo and sampling.logprobs is not None
            raise UnsupportedParameterError(
                f"{'echo with logprobs' if echoed else 'prompt_logprobs'} needs the prompt's logprobs, which "
                "TensorRT-LLM's hand-off does not carry, and CTX's first token ended this request; send it to an "
                "aggregated worker or through disagg-serve's orchestrator on its native wire",
                param="echo" if echoed else "prompt_logprobs")
        return True

    def add_context_fields(self, body: dict[str, Any], request: GenerationRequest, disagg: DisaggregatedParams,
                           out: CollectedOutput, endpoint: str) -> None:
        if "choices" not in body:  # a Responses answer has no choice to carry TensorRT-LLM's fields: ours it is
            NATIVE.add_context_fields(body, request, disagg, out, endpoint)
            return
        state = parked_state(out)
        first = out.choices[0]  # n is 1 here: refuse_unservable refused more
        add_context_fields(body, request, disagg, first.token_ids,
                           first.logprobs if request.sampling.logprobs is not None else None, state, endpoint)
        if self.lifecycle.enabled:  # v1: the parked KV is now this attempt's artifact
            parked = out.handoff_state if state is not None else None
            self.lifecycle.artifacts.park(disagg, request.request_id, parked)
        if disagg.schedule_style == 1 and disagg.disagg_request_id is not None:
            claim = str(disagg.transfer_session_id) if disagg.transfer_session_id is not None else None
            if not self.board.post(disagg.disagg_request_id, body["choices"][0]["disaggregated_params"], claim):
                logger.warning("generation-first hand-off of disagg_request_id %s already on the board: this "
                               "one (ctx_request_id %s) is not posted, and its KV expires unused",
                               disagg.disagg_request_id, request.request_id)

    def finish_whole(self, body: dict[str, Any]) -> None:
        # A CTX answer GEN continues reaches TensorRT-LLM's orchestrator only: GEN's answer is the client's.
        continued = any(choice.get("finish_reason") in GEN_PENDING_FINISH_REASONS for choice in body.get("choices", ()))
        strip_to_trtllm_fields(body, prompt_logprobs=continued and not self.keeps_prompt_logprobs)


def add_context_fields(body: dict[str, Any], request: GenerationRequest, disagg: DisaggregatedParams,
                       first_tokens: list[int], logprobs: list[TokenLogprob] | None, handoff_state: str | None,
                       endpoint: str) -> None:
    """Put the CTX hand-off into ``body`` as TensorRT-LLM's CTX worker writes it."""
    choice = body["choices"][0]
    params: dict[str, Any] = {
        "request_type": "context_only",
        "first_gen_tokens": first_tokens,
        "ctx_request_id": int(request.request_id),
        "encoded_opaque_state": handoff_state,
        "disagg_request_id": disagg.disagg_request_id,
    }
    if logprobs is not None:
        params["first_gen_log_probs"] = [[lp.token_id, lp.logprob, [list(t) for t in lp.top]] for lp in logprobs]
    params.update(lifecycle_echo(disagg))
    choice["disaggregated_params"] = params
    if handoff_state is not None:
        choice["finish_reason"] = NOT_FINISHED
    # Also when CTX finished: on "length" TensorRT-LLM's orchestrator still calls GEN, with this prompt.
    if disagg.return_prompt_token_ids_b64 and endpoint == "chat":
        body["prompt_token_ids_b64"] = encode_prompt_tokens(request.prompt_token_ids_i32)
    else:
        body["prompt_token_ids"] = request.prompt_token_ids  # TensorRT-LLM's list path: a list it reads back


def lifecycle_echo(disagg: DisaggregatedParams) -> dict[str, Any]:
    """Lifecycle v1: the CTX answer repeats the request's lifecycle contract, field for field (TensorRT-LLM's
    orchestrator fails the request on any difference, a missing ``schedule_style`` included). Nothing for v0."""
    if not has_identity(disagg.__dict__):
        return {}
    echoed: dict[str, Any] = {}
    for name in (*LIFECYCLE_FIELDS, "schedule_style", "ctx_dp_rank"):
        value = getattr(disagg, name)
        if value is not None:
            echoed[name] = value.to_dict() if name == "context_transceiver_lifecycle" else value
    return echoed


def strip_to_trtllm_fields(body: dict[str, Any], *, prompt_logprobs: bool) -> None:
    """Drop what TensorRT-LLM's response models do not have (they refuse unknown fields): ``system_fingerprint``,
    and ``prompt_logprobs`` when told to."""
    body.pop("system_fingerprint", None)
    if not prompt_logprobs:
        return
    body.pop("prompt_logprobs", None)
    for choice in body.get("choices", ()):
        choice.pop("prompt_logprobs", None)


def first_gen_logprobs_from(log_probs: list[Any] | None) -> tuple[TokenLogprob, ...]:
    """``first_gen_log_probs`` as ``add_context_fields`` writes it, read back on GEN; () if it is not that shape
    (a TensorRT-LLM CTX writes its own): the first token's logprob is then simply not reported."""
    out = []
    for entry in log_probs or ():
        try:
            token_id, logprob, top = entry
            out.append(TokenLogprob(int(token_id), float(logprob), tuple((int(t), float(v)) for t, v in top)))
        except (TypeError, ValueError):
            return ()
    return tuple(out)


def finished_at_context(disagg: DisaggregatedParams | None, max_tokens: int) -> bool:
    """TensorRT-LLM's orchestrator calls GEN whenever CTX says ``"length"``, also when the first token already used
    up ``max_tokens`` and our CTX freed the KV: that GEN request has first tokens but no hand-off state. Its whole
    answer is those first tokens; no engine is asked.

    ``max_tokens`` is the request's resolved budget. Only first tokens that really used it up make such a request:
    with budget left, a missing state is a broken hand-off, and answering the first tokens as ``"length"`` would
    silently cut the output short (``handoff_from`` then refuses it by the field's name)."""
    if disagg is None or disagg.request_type != "generation_only":
        return False
    first = disagg.first_gen_tokens
    return disagg.encoded_opaque_state is None and first is not None and 0 < len(first) >= max_tokens


async def first_tokens_only(disagg: DisaggregatedParams, tokenizer: Tokenizer,
                            vocab_size: int) -> AsyncGenerator[TextStep, None]:
    """The answer of a request CTX finished by its length (``finished_at_context``), as one text step."""
    tokens = tuple(disagg.first_gen_tokens or ())
    if any(not 0 <= t < vocab_size for t in tokens):
        raise HandoffError(f"first_gen_tokens must be token ids in [0, {vocab_size})",
                           param="disaggregated_params.first_gen_tokens")
    # As the engine's own answer reads them: a token that is only part of a character is held back, never U+FFFD.
    text = tokenizer.detokenizer().add(tokens)
    yield TextStep(text, tokens, first_gen_logprobs_from(disagg.first_gen_log_probs), finish_reason="length")
