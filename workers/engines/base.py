"""The typed engine adapter: the one boundary between the HTTP front end and whatever runs the model.

In the style of httpx's transports: one method that matters (``generate``), a few lifecycle methods, typed
dataclasses in and out. An adapter translates its runtime's errors into ``frontend.errors`` types at this
boundary (``raise EngineError(...) from exc``); no foreign exception type leaks into the server.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import AsyncGenerator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal, Protocol

from frontend.token_codec import TokenArray

if TYPE_CHECKING:
    from workers.generation_request import GenerationRequest

FinishReason = Literal["stop", "length", "abort"]


@dataclass(frozen=True, slots=True)
class EngineInfo:
    """Facts about an engine that the front end and the orchestrator's guardrail rely on."""

    engine: str  # "synthetic", "reference", ...
    model: str  # the served model name
    vocab_size: int
    max_context: int  # prompt + output tokens
    model_hash: str = ""
    kv_block_reuse: bool = False  # blocks keyed by token-value hashes: placeholders would collide
    prompt_tokens_in_handoff: bool = False  # the KV hand-off carries the prompt's real int32 ids
    supports_logprobs: bool = True


@dataclass(frozen=True, slots=True)
class TokenLogprob:
    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


@dataclass(frozen=True, slots=True)
class EngineOutput:
    """New tokens of one step. The last output of a request carries ``finish_reason``.

    A CONTEXT_ONLY request yields exactly one output: the first token, with ``handoff_state`` (the opaque bytes
    GEN needs to continue) unless the request already finished, in which case the engine has freed its KV.
    A GENERATION_ONLY request's first output confirms that the hand-off was accepted (it may hold no tokens);
    a hand-off the engine cannot use raises before it.
    """

    token_ids: tuple[int, ...]
    logprobs: tuple[TokenLogprob, ...] = ()
    finish_reason: FinishReason | None = None
    handoff_state: bytes | None = None
    prompt_logprobs: tuple[TokenLogprob | None, ...] | None = None  # first output only, when asked for
    prompt_token_ids: TokenArray | None = None  # the real prompt, when the request had a placeholder (echo)


class Detokenizer(Protocol):
    def add(self, token_ids: Sequence[int]) -> str:
        """Text newly completed by these tokens (incomplete UTF-8 is held back until it completes)."""
        ...


class Tokenizer(Protocol):
    @property
    def vocab_size(self) -> int: ...

    def encode(self, text: str) -> TokenArray: ...

    def decode(self, token_ids: Sequence[int] | TokenArray) -> str: ...

    def render_chat(self, messages: list[dict[str, str]]) -> str: ...

    def detokenizer(self) -> Detokenizer: ...


class Engine(ABC):
    info: EngineInfo
    tokenizer: Tokenizer

    async def start(self) -> None:  # noqa: B027 - optional hook; engines with nothing to load keep it
        """Load the model / start the engine core. Called once before the server accepts requests."""

    @abstractmethod
    def generate(self, request: GenerationRequest) -> AsyncGenerator[EngineOutput, None]:
        """Run ``request`` and yield its outputs until one carries ``finish_reason``.

        Contract: the caller owns the iterator. Closing it early (``aclose()``, or cancelling the task that
        iterates it) aborts the request inside the engine and frees its resources. Errors are raised as
        ``frontend.errors`` types: ``HandoffError`` for a hand-off this engine cannot use, ``EngineError`` for
        failures of the runtime itself.
        """

    @abstractmethod
    async def abort(self, request_id: str) -> None:
        """Stop ``request_id`` if it is running and free everything it holds (KV, hand-off entries)."""

    async def health(self) -> bool:
        return True

    async def release_handoff(self, ctx_request_id: str, opaque_state: bytes) -> bool:
        """Free a parked hand-off that no GEN will take (the client left between the steps). The opaque state
        (with its one-time key) is the proof of ownership. Returns whether something was freed."""
        return False

    def kv_store_stats(self) -> tuple[int, int] | None:
        """(entries, bytes) of KV hand-offs this engine holds for GEN workers; None if it keeps none."""
        return None

    async def aclose(self) -> None:  # noqa: B027 - optional hook, as start()
        """Release the engine; after this no request is running."""
