"""Prompts for the vLLM tests: longer than one 128-token KV block, so ExampleConnector really moves KV."""

from __future__ import annotations

from openai.types.chat import ChatCompletionMessageParam

MODEL = "SmolLM2-135M-Instruct.Q4_1"  # the zero-config model's name: the GGUF's, as the reference engine serves it

_STORY = (
    "The lighthouse keeper climbed the spiral stairs every evening at dusk. He wound the clockwork, trimmed the "
    "wick, polished the great lens and wrote the weather in his logbook: wind from the west, a swell from the "
    "south, fog coming in over the rocks by midnight. Ships passed far out, their lights small and steady. "
)
FRANCE: list[ChatCompletionMessageParam] = [{"role": "user", "content": "What is the capital of France?"}]


# Each test asks its own variant: a prompt a vLLM instance has seen before is found in its own prefix cache, and
# then says nothing about the KV hand-off.
def long_chat(variant: str) -> list[ChatCompletionMessageParam]:
    return [
        {"role": "system", "content": f"You are a helpful assistant ({variant}). Here is a story. " + _STORY * 4},
        {"role": "user", "content": "In one sentence, what does the keeper do every evening?"},
    ]


def long_prompt(variant: str) -> str:
    return f"Story ({variant}): " + _STORY * 5 + "\nQuestion: What does the keeper write in his logbook?\nAnswer:"
