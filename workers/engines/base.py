"""The typed engine adapter: the one boundary between the HTTP front end and whatever runs the model.

``Engine`` has one method that matters (``generate``) and four for its life, typed values in and out. What only
some engines can do is a small protocol of its own that the worker finds with ``isinstance`` (``ProvidesTokenizer``,
``KVHandoffStore``, ``HealthCheck``, ``StopsSequences``, ...). An adapter translates its runtime's errors into
``frontend.errors`` types here (``raise EngineError(...) from exc``): no foreign exception reaches the server."""

from __future__ import annotations

from collections.abc import AsyncGenerator, Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

from frontend.token_codec import TokenArray
from workers.engines.outputs import EngineInfo, EngineOutput
from workers.engines.request import GenerationRequest
from workers.tokenization.prompt_encoder import TokenizeStats


class Engine(Protocol):
    @property
    def info(self) -> EngineInfo:
        """Facts about the engine and its model; readable once ``start`` has returned."""
        ...

    async def start(self) -> None:
        """Load the model / start the engine core. Called once before the server accepts requests."""

    def generate(self, request: GenerationRequest) -> AsyncGenerator[EngineOutput, None]:
        """Run ``request`` and yield its outputs until one carries ``finish_reason``.

        An async generator rather than any async iterator, because the caller owns it and must be able to
        close it: closing it early (``aclose()``, or cancelling the task that iterates it) aborts the request
        inside the engine and frees its resources. Errors are raised as ``frontend.errors`` types:
        ``HandoffError`` for a hand-off this engine cannot use, ``EngineError`` for failures of the runtime itself.
        """
        ...

    async def abort(self, request_id: str) -> None:
        """Stop ``request_id`` if it is running and free everything it holds (KV, hand-off entries)."""

    async def aclose(self) -> None:
        """Release the engine; after this no request is running."""


# -- optional capabilities ---------------------------------------------------------------------------------


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


@runtime_checkable
class ProvidesTokenBytes(Protocol):
    """A tokenizer that knows each token's own bytes, also for a token that is only part of a UTF-8 character
    (whose decoded text is U+FFFD): logprobs report them as ``bytes``. Without it, ``bytes`` is the token's decoded
    text in UTF-8."""

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes this token adds to the output (b"" for one that decodes to nothing, e.g. a control token)."""
        ...


@runtime_checkable
class DeclaresChatTemplate(Protocol):
    """A tokenizer that shows its chat template's source: the worker reads which tool-call format the model writes
    from it (``frontend.tool_parsers.format_of_template``)."""

    @property
    def chat_template(self) -> str | None:
        """The template's Jinja source; None where the model has none."""
        ...


@runtime_checkable
class EncodesIncrementally(Protocol):
    """A tokenizer that keeps what it encoded (workers/tokenization/): a prompt that extends a recent one costs only
    what it adds, so whether to encode it off the event loop depends on that, not on the prompt's length."""

    def new_chars(self, text: str) -> int:
        """How many characters of ``text`` ``encode`` would encode now."""
        ...


@runtime_checkable
class ReportsTokenizeStats(Protocol):
    """A tokenizer that counts its work (workers/tokenization/): prompts, tokens encoded, its conversation cache."""

    def tokenize_stats(self) -> TokenizeStats | None:
        """The running totals; None before the first prompt."""
        ...


@runtime_checkable
class ProvidesTokenizer(Protocol):
    """An engine that brings the tokenizer of its model: the worker tokenizes text prompts, renders the chat
    template and detokenizes outputs with it."""

    def get_tokenizer(self) -> Tokenizer:
        """The model's tokenizer; available once ``start`` has returned."""
        ...


@dataclass(frozen=True, slots=True)
class ParkedHandoff:
    ctx_request_id: str
    age_s: float
    bytes: int
    expires_in_s: float


# The ledger's totals: hand-offs parked, and each way one leaves its store (``HandoffLedger`` says when). They are
# also the ``outcome`` values of the worker's ``disagg_kv_handoffs_total``.
HANDOFF_TOTALS = ("parked", "taken", "released", "expired")


@dataclass(frozen=True, slots=True)
class HandoffLedger:
    """Every hand-off a store parked, and how each left it: ``totals`` counts ``parked``, ``taken`` (a GEN
    fetched it), ``released`` (refused by GEN, client gone, orchestrator failure, request aborted) and
    ``expired`` (its time to live ran out); what has not left yet is in ``parked_now``."""

    parked_now: tuple[ParkedHandoff, ...]
    parked_bytes: int
    totals: Mapping[str, int]

    @property
    def balanced(self) -> bool:
        """Nothing parked, no parked bytes, and every parked hand-off accounted for."""
        t = self.totals
        return (not self.parked_now and self.parked_bytes == 0
                and t.get("parked", 0) == t.get("taken", 0) + t.get("released", 0) + t.get("expired", 0))


@runtime_checkable
class ReportsKvCapacity(Protocol):
    """An engine that reuses cached prompt KV across requests and knows how much it can hold.

    The worker keeps its record of what the engine holds (``workers.prefix_holdings``) to this size, so that
    what it publishes for routing ages as the engine's own cache does. An engine without it publishes nothing.
    """

    def kv_capacity_tokens(self) -> int | None:
        """Tokens of prompt KV the engine keeps for reuse; None or 0: it reuses none (prefix caching off)."""
        ...


@runtime_checkable
class KVHandoffStore(Protocol):
    """An engine that parks KV hand-offs for GEN workers to fetch (a CTX-side store)."""

    async def release_handoff(self, ctx_request_id: str, opaque_state: bytes) -> bool:
        """Free a parked hand-off that no GEN will take (the client left between the steps). The opaque state
        (with its one-time key) is the proof of ownership. Returns whether something was freed."""
        ...

    def kv_store_stats(self) -> tuple[int, int]:
        """(entries, bytes) of KV hand-offs parked now."""
        ...

    def kv_handoff_totals(self) -> Mapping[str, int]:
        """The ledger's totals as last reported (``parked``, ``taken``, ``released``, ``expired``), without
        waiting on the engine: for metrics scrapes."""
        ...

    async def handoff_ledger(self) -> HandoffLedger:
        """The whole ledger, asked of the engine now: what is parked (with ages and sizes) and the totals."""
        ...


@runtime_checkable
class StopsSequences(Protocol):
    """An engine that can stop one of a request's n sequences and keep decoding the others.

    The worker finishes a sequence itself when it meets a stop string; without this, the engine decodes that
    sequence on (its output is dropped) until the request ends."""

    async def stop_sequence(self, request_id: str, index: int) -> None: ...


@runtime_checkable
class HealthCheck(Protocol):
    """An engine that can fail while its process lives on (a separate core that died or hangs)."""

    async def health(self) -> bool: ...


@runtime_checkable
class ExposesMetrics(Protocol):
    """An engine with Prometheus metrics of its own (vLLM's ``vllm:*``): the worker's ``/metrics`` appends them."""

    def metrics_text(self) -> bytes:
        """Prometheus text exposition of the engine's metrics, with no name the worker's own metrics use."""
        ...
