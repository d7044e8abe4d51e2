"""Logprobs as clients read them: one token's entry (``token_logprob_info``, for output and prompt tokens alike),
echo's per-token entries, and vLLM's ``prompt_logprobs`` list.

The engine scores the prompt during prefill (on CTX in the disaggregated flow; the hand-off carries the scores to
GEN) and reports one entry per prompt token, ``None`` for the first, which has no context to be scored in.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from frontend.openai_output import TokenLogprobInfo
from frontend.token_codec import TokenArray
from workers.engines.base import ProvidesTokenBytes, Tokenizer
from workers.engines.outputs import TokenLogprob

PromptLogprobs = Sequence[TokenLogprob | None]


def token_logprob_info(tokenizer: Tokenizer, token_id: int, logprob: float | None,
                       top: Sequence[tuple[int, float]] = ()) -> TokenLogprobInfo:
    """One token's entry: its text and its alternatives', with their own bytes when the tokenizer knows them (the
    text of a token that is only part of a character is U+FFFD, whose bytes are not the token's)."""
    decode = tokenizer.decode
    top_texts = tuple((decode([t]), v) for t, v in top)
    if not isinstance(tokenizer, ProvidesTokenBytes):
        return TokenLogprobInfo(decode([token_id]), logprob, top_texts)
    raw = tokenizer.token_bytes
    return TokenLogprobInfo(decode([token_id]), logprob, top_texts, raw(token_id), tuple(raw(t) for t, _ in top))


def echo_logprob_infos(
    tokenizer: Tokenizer, prompt: Sequence[int] | TokenArray, scores: PromptLogprobs | None
) -> list[TokenLogprobInfo]:
    """One entry per prompt token: its text always, its logprob and alternatives where the engine scored it."""
    entries = []
    for index, token_id in enumerate(prompt):
        score = scores[index] if scores is not None and index < len(scores) else None
        entries.append(token_logprob_info(tokenizer, int(token_id), score.logprob if score else None,
                                          score.top if score is not None else ()))
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
