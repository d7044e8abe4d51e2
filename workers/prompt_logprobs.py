"""The prompt's logprobs as clients read them: echo's per-token entries, and vLLM's ``prompt_logprobs`` list.

The engine scores the prompt during prefill (on CTX in the disaggregated flow; the hand-off carries the scores to
GEN) and reports one entry per prompt token, ``None`` for the first, which has no context to be scored in.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from frontend.openai_output import TokenLogprobInfo
from frontend.token_codec import TokenArray
from workers.engines.base import Tokenizer
from workers.engines.outputs import TokenLogprob

PromptLogprobs = Sequence[TokenLogprob | None]


def echo_logprob_infos(
    tokenizer: Tokenizer, prompt: Sequence[int] | TokenArray, scores: PromptLogprobs | None
) -> list[TokenLogprobInfo]:
    """One entry per prompt token: its text always, its logprob and alternatives where the engine scored it."""
    decode = tokenizer.decode
    entries = []
    for index, token_id in enumerate(prompt):
        score = scores[index] if scores is not None and index < len(scores) else None
        top = tuple((decode([t]), v) for t, v in score.top) if score is not None else ()
        entries.append(TokenLogprobInfo(decode([int(token_id)]), score.logprob if score else None, top))
    return entries


def vllm_prompt_logprobs(tokenizer: Tokenizer, scores: PromptLogprobs) -> list[dict[str, Any] | None]:
    """vLLM's shape: per prompt token ``None`` or ``{token_id: {logprob, rank, decoded_token}}``, the prompt's own
    token first, then the top alternatives; ``rank`` is 1-based, ``None`` where it was not among the top."""
    decode = tokenizer.decode
    rendered: list[dict[str, Any] | None] = []
    for score in scores:
        if score is None:
            rendered.append(None)
            continue
        ranks = {token_id: rank for rank, (token_id, _) in enumerate(score.top, start=1)}
        entry = {str(score.token_id): {"logprob": score.logprob, "rank": ranks.get(score.token_id),
                                       "decoded_token": decode([score.token_id])}}
        for token_id, logprob in score.top:
            entry.setdefault(str(token_id), {"logprob": logprob, "rank": ranks[token_id],
                                             "decoded_token": decode([token_id])})
        rendered.append(entry)
    return rendered
