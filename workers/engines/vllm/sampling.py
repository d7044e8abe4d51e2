"""Our ``SamplingParams`` as vLLM's, and what does not map refused with a 400 that names the field.

Stop strings stay in our front end (``workers.text_stream`` matches them across token boundaries and closes the
engine's iterator, which aborts the request in vLLM), so vLLM never detokenizes: it is started without a tokenizer
and told the model's end-of-sequence ids itself. Everything here is plain data; the engine builds vLLM's
``SamplingParams`` from ``vllm_sampling_fields`` in one call.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from frontend.errors import UnsupportedParameterError
from frontend.sampling import SamplingParams

# Prompt logprobs (and echo with logprobs, which needs them) are not mapped yet: vLLM computes them, but GEN would
# need them carried from CTX. A clear refusal beats a silently empty field.
_REFUSED_FIELDS = ("prompt_logprobs",)


def refuse_unmapped(sampling: SamplingParams) -> None:
    for name in _REFUSED_FIELDS:
        if getattr(sampling, name) is not None:
            raise UnsupportedParameterError(f"'{name}' is not supported by the vllm engine", param=name)


def vllm_sampling_fields(
    sampling: SamplingParams, max_tokens: int, eos_token_ids: Iterable[int], kv_transfer_params: dict[str, Any] | None
) -> dict[str, Any]:
    """Keyword arguments for ``vllm.SamplingParams`` (``output_kind`` is added by the engine: it is vLLM's enum)."""
    refuse_unmapped(sampling)
    fields: dict[str, Any] = {
        "max_tokens": max_tokens,
        "temperature": sampling.temperature,
        "top_p": sampling.top_p,
        "top_k": sampling.top_k if sampling.top_k > 0 else 0,  # 0: off, in vLLM as here
        "seed": sampling.seed,
        "frequency_penalty": sampling.frequency_penalty,
        "presence_penalty": sampling.presence_penalty,
        "repetition_penalty": sampling.repetition_penalty,
        "logprobs": sampling.logprobs,
        "ignore_eos": sampling.ignore_eos,
        # vLLM ends on stop_token_ids even under ignore_eos, so ignore_eos sends none.
        "stop_token_ids": [] if sampling.ignore_eos else sorted(eos_token_ids),
        "detokenize": False,
    }
    if sampling.logit_bias:
        fields["logit_bias"] = dict(sampling.logit_bias)
    if kv_transfer_params is not None:
        fields["extra_args"] = {"kv_transfer_params": kv_transfer_params}
    return fields
