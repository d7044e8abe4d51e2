"""What ``disagg-serve bench`` sends: synthetic prompts of a given length, or prompts from a JSONL file, written
as OpenAI chat or completions bodies that ask for a stream with a usage chunk."""

from __future__ import annotations

import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import orjson

Endpoint = Literal["completions", "chat"]
PATHS: dict[Endpoint, str] = {"completions": "/v1/completions", "chat": "/v1/chat/completions"}

# Short, common English words: each is one token (with its leading space) in the usual BPE vocabularies, so N
# words make a prompt of about N tokens on any server. The server's own count is reported (usage.prompt_tokens).
_WORDS = ("the", "of", "and", "to", "in", "is", "it", "for", "on", "with", "as", "at", "by", "this", "that",
          "from", "or", "not", "but", "are", "was", "be", "have", "one", "all", "can", "will", "time", "out", "up")


@dataclass(frozen=True, slots=True)
class Prompt:
    text: str | None = None  # a completions prompt, or one user message
    messages: list[dict[str, Any]] | None = None  # a whole chat conversation (JSONL)
    max_tokens: int | None = None  # this prompt's own output length (JSONL), else --output-tokens


def synthetic_prompts(count: int, tokens: int, seed: int) -> list[Prompt]:
    """``count`` distinct prompts of ``tokens`` words: distinct, so no server answers them from a prefix cache."""
    rng = random.Random(seed)
    return [Prompt(" ".join(rng.choice(_WORDS) for _ in range(tokens))) for _ in range(count)]


class PromptFileError(ValueError):
    pass


def jsonl_prompts(path: Path) -> list[Prompt]:
    """One JSON object a line: ``{"prompt": "..."}`` or ``{"messages": [...]}``, optionally ``"max_tokens"``."""
    prompts = []
    for number, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            entry = orjson.loads(line)
        except orjson.JSONDecodeError as exc:
            raise PromptFileError(f"{path}:{number}: not JSON: {exc}") from exc
        if not isinstance(entry, dict) or not (isinstance(entry.get("prompt"), str)
                                               or isinstance(entry.get("messages"), list)):
            raise PromptFileError(f"{path}:{number}: needs a string 'prompt' or a list 'messages'")
        max_tokens = entry.get("max_tokens")
        prompts.append(Prompt(entry.get("prompt"), entry.get("messages"),
                              max_tokens if isinstance(max_tokens, int) else None))
    if not prompts:
        raise PromptFileError(f"{path}: no prompts")
    return prompts


def request_body(endpoint: Endpoint, model: str, prompt: Prompt, output_tokens: int,
                 extra: dict[str, Any]) -> bytes:
    body: dict[str, Any] = {"model": model, "max_tokens": prompt.max_tokens or output_tokens, "stream": True,
                            "stream_options": {"include_usage": True}}
    if endpoint == "chat":
        body["messages"] = prompt.messages or [{"role": "user", "content": prompt.text or ""}]
    else:
        body["prompt"] = prompt.text if prompt.text is not None else _flatten(prompt.messages or [])
    body.update(extra)
    return orjson.dumps(body)


def _flatten(messages: list[dict[str, Any]]) -> str:
    """A chat conversation sent to the completions endpoint: its contents, one per line."""
    return "\n".join(str(m.get("content", "")) for m in messages)
