"""The adapter's half of the engine-core protocol: requests into ``submit`` frames, core frames into values.

The prompt crosses as the raw int32 buffer (the frame's payload: no list, no copy) and the sampling parameters as
``SamplingParams.to_wire()``; outputs come back as ``EngineOutput`` and core errors as ``frontend.errors`` types.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from frontend import tracing
from frontend.errors import (
    EngineError,
    EngineRequestError,
    HandoffError,
    OverloadedError,
    ServingError,
    UpstreamError,
)
from frontend.token_codec import TOKEN_DTYPE
from workers.engines.outputs import EngineOutput, TokenLogprob
from workers.engines.reference.ipc import Header
from workers.engines.request import GenerationRequest, PromptPath


def submit_frame(request: GenerationRequest) -> tuple[Header, memoryview | bytes]:
    header: Header = {
        "op": "submit",
        "id": request.request_id,
        "phase": request.phase.value,
        "prompt_len": request.prompt_len,
        "placeholder": request.prompt_path is PromptPath.METADATA_ONLY,
        "sampling": request.sampling.to_wire(),
    }
    if request.handoff is not None:
        header["first_gen_tokens"] = list(request.handoff.first_gen_tokens)
        header["more_first_gen_tokens"] = [list(s.first_gen_tokens) for s in request.handoff.more_sequences]
        header["handoff_state"] = request.handoff.opaque_state.decode("utf-8", errors="replace")
    traceparent = tracing.current_traceparent()  # the worker's engine span: the core's spans are its children
    if traceparent is not None:
        header["traceparent"] = traceparent
    if request.prompt_path is PromptPath.METADATA_ONLY:
        return header, b""
    return header, request.prompt_token_ids_i32.data  # the raw int32 buffer: no list, no copy


def engine_output(message: Header, payload: bytes) -> EngineOutput:
    logprobs = tuple(
        TokenLogprob(int(t), float(lp), tuple((int(i), float(v)) for i, v in top))
        for t, lp, top in message.get("logprobs") or ()
    )
    prompt_logprobs = None
    if message.get("prompt_logprobs") is not None:
        prompt_logprobs = tuple(
            None if entry is None
            else TokenLogprob(int(entry[0]), float(entry[1]), tuple((int(i), float(v)) for i, v in entry[2]))
            for entry in message["prompt_logprobs"]
        )
    state = message.get("handoff_state")
    return EngineOutput(
        token_ids=tuple(int(t) for t in message["tokens"]),
        logprobs=logprobs,
        finish_reason=message.get("finish"),
        handoff_state=state.encode() if isinstance(state, str) else None,
        prompt_logprobs=prompt_logprobs,
        prompt_token_ids=np.frombuffer(payload, TOKEN_DTYPE) if message.get("prompt_tokens") else None,
        index=int(message.get("index", 0)),
        cached_tokens=int(message.get("cached_tokens", 0)),
        recomputed_tokens=int(message.get("recomputed_tokens", 0)),
    )


def core_error(message: Header) -> ServingError:
    kind, text = message.get("kind"), str(message.get("message", "engine error"))
    if kind == "handoff":
        return HandoffError(text, param="disaggregated_params.encoded_opaque_state")
    if kind == "overloaded":
        return OverloadedError(text)
    if kind == "upstream":
        return UpstreamError(text)
    if kind == "request":  # this request's own fault inside the core: it would fail on any worker
        return EngineRequestError(text)
    return EngineError(text)


def tokenizer_fields(ready: Header) -> dict[str, Any]:
    """The ``ready`` frame's tokenizer vocabulary, as ``TokenizerMetadata`` keyword arguments."""
    t = ready["tokenizer"]
    return {
        "model": t["model"], "pre": t["pre"], "tokens": tuple(t["tokens"]), "merges": tuple(t["merges"]),
        "token_types": tuple(t["token_types"]), "bos_token_id": t["bos_token_id"],
        "eos_token_id": t["eos_token_id"], "chat_template": t["chat_template"],
    }
