"""Our ``SamplingParams`` as vLLM's, and what does not map refused with a 400 that names the field.

Stop strings stay in our front end, so vLLM never detokenizes. Greedy ``n`` > 1, which vLLM refuses, is one sequence
repeated (``repeated_sequences``). Structured output is vLLM's ``guidance`` backend given the grammar
``json_grammar`` gives, so every engine formats JSON alike. Plain data: the engine builds vLLM's types in one call."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import orjson

from frontend.errors import UnsupportedParameterError
from frontend.sampling import SamplingParams
from frontend.structured_output import JSON_OPTIONS

# Prompt logprobs (and echo with logprobs, which needs them) are not mapped yet: vLLM computes them, but GEN would
# need them carried from CTX. A clear refusal beats a silently empty field.
_REFUSED_FIELDS = ("prompt_logprobs",)
_GREEDY_BELOW = 1e-5  # vllm.sampling_params._SAMPLING_EPS
# Connectors whose saved KV any number of requests may load (ExampleConnector's files stay until deleted).
REREADABLE_CONNECTORS = frozenset({"ExampleConnector"})


def refuse_unmapped(sampling: SamplingParams) -> None:
    for name in _REFUSED_FIELDS:
        if getattr(sampling, name) is not None:
            raise UnsupportedParameterError(f"'{name}' is not supported by the vllm engine", param=name)


def vllm_sampling_fields(
    sampling: SamplingParams, max_tokens: int, eos_token_ids: Iterable[int], kv_transfer_params: dict[str, Any] | None,
    seed: int | None = None,
) -> dict[str, Any]:
    """Keyword arguments for ``vllm.SamplingParams`` (``output_kind`` is added by the engine: it is vLLM's enum;
    ``structured_outputs``, when present, holds ``StructuredOutputsParams``' keyword arguments). ``seed``, when
    given, replaces the request's (the one a disaggregated request's CTX drew for it)."""
    refuse_unmapped(sampling)
    fields: dict[str, Any] = {
        "n": 1 if repeated_sequences(sampling) > 1 else sampling.n,
        "max_tokens": max_tokens,
        "temperature": sampling.temperature,
        "top_p": sampling.top_p,
        "top_k": sampling.top_k if sampling.top_k > 0 else 0,  # 0: off, in vLLM as here
        "seed": sampling.seed if seed is None else seed,
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
    if sampling.json_schema is not None:
        fields["structured_outputs"] = {"json": guidance_schema(sampling.json_schema)}
    elif sampling.grammar is not None:  # Lark with its %llguidance header, which the guidance backend reads as such
        fields["structured_outputs"] = {"grammar": sampling.grammar}
    if kv_transfer_params is not None:
        fields["extra_args"] = {"kv_transfer_params": kv_transfer_params}
    return fields


def refuse_n_across_handoff(sampling: SamplingParams, connector: str | None) -> None:
    """CTX's check: GEN runs a sampled ``n`` > 1 as vLLM's ``n`` child requests, each fetching the prompt's KV
    through the connector; one that frees the KV after the first fetch (NixlConnector) would hand the others freed
    blocks. Greedy ``n`` is one vLLM request; no connector means nothing is handed off."""
    if sampling.n > 1 and repeated_sequences(sampling) == 1 and connector is not None \
            and connector not in REREADABLE_CONNECTORS:
        raise UnsupportedParameterError(
            f"n > 1 with sampling is not supported across a {connector} KV hand-off (GEN's sequences would each "
            f"fetch the prompt's KV, which {connector} hands over once); use n=1, temperature 0, or a connector "
            f"whose KV can be read more than once ({', '.join(sorted(REREADABLE_CONNECTORS))})", param="n")


def repeated_sequences(sampling: SamplingParams) -> int:
    """How many copies of vLLM's one sequence the request gets: ``n`` under greedy sampling (vLLM's own test for
    greedy, ``temperature`` below 1e-5, where it refuses ``n`` > 1), else 1 (vLLM samples every sequence)."""
    return sampling.n if sampling.temperature < _GREEDY_BELOW else 1


def guidance_schema(schema_text: str) -> str:
    """The schema with this server's JSON options as its ``x-guidance``, over any the client set: vLLM compiles
    it with ``grammar_from_json_schema``, whose ``x-guidance`` wins over vLLM's own defaults, so the grammar is
    the very one ``frontend.structured_output.json_grammar`` builds (compact separators, no free whitespace)."""
    schema = orjson.loads(schema_text)
    if not isinstance(schema, dict):  # a boolean schema: no options to carry, and nothing to format
        return schema_text
    theirs = schema.get("x-guidance")
    schema["x-guidance"] = {**(theirs if isinstance(theirs, dict) else {}), **JSON_OPTIONS}
    return orjson.dumps(schema).decode()
