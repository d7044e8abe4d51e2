"""GenerationRequest: the validated request the engine accepts, holding the prompt as an int32 array.

The prompt lives as a read-only int32 ndarray (``prompt_token_ids_i32``). ``prompt_token_ids`` builds the Python
``list[int]`` only when something really reads token values, and caches it; on the array path nothing ever does.
Pickling carries the int32 bytes, never a list of ints, and an unread request re-pickles without building one.
Nothing here copies or mutates the token ids: copies share the same read-only array.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any

import numpy as np

from frontend.sampling import SamplingParams
from frontend.token_codec import TOKEN_DTYPE, TokenArray
from workers.engines.outputs import TokenLogprob


class Phase(enum.Enum):
    AGGREGATED = "aggregated"  # prefill and decode here (role "both", or a GEN running a short prompt itself)
    CONTEXT_ONLY = "context_only"  # prefill, choose the first token, export the KV for GEN
    GENERATION_ONLY = "generation_only"  # continue from a KV hand-off after the first token


class PromptPath(enum.Enum):
    """How the prompt reached this worker; reported as ``disagg_gen_prompt_path_total{path}``."""

    ARRAY = "array"  # prompt_token_ids_b64, decoded zero-copy
    LIST = "list"  # an explicit prompt_token_ids list
    METADATA_ONLY = "metadata_only"  # only prompt_len: a length-only placeholder
    TEXT = "text"  # tokenized here from text (CTX, aggregated)


@dataclass(frozen=True, slots=True)
class SequenceStart:
    """What CTX chose for one sequence: its first token(s) and their logprobs."""

    first_gen_tokens: tuple[int, ...]
    first_gen_logprobs: tuple[TokenLogprob, ...] = ()


@dataclass(frozen=True, slots=True)
class Handoff:
    """What GEN needs from CTX: the first token(s) and the engine's opaque KV hand-off state.

    ``first_gen_tokens`` are sequence 0's; with n > 1 the other sequences' starts are in ``more_sequences``. One
    KV hand-off serves them all: it holds the prompt alone, which every sequence shares."""

    first_gen_tokens: tuple[int, ...]
    opaque_state: bytes
    ctx_request_id: str | None = None
    first_gen_logprobs: tuple[TokenLogprob, ...] = ()
    more_sequences: tuple[SequenceStart, ...] = ()
    cached_tokens: int = 0  # prompt tokens CTX reused from its KV blocks: GEN reports CTX's figure
    # A continued stream: the steps ``first_gen_tokens`` were first streamed in (sizes), replayed as they came.
    first_gen_steps: tuple[int, ...] = ()

    @property
    def sequences(self) -> tuple[SequenceStart, ...]:
        """Every sequence's start, by index."""
        return (SequenceStart(self.first_gen_tokens, self.first_gen_logprobs), *self.more_sequences)


def placeholder_prompt(prompt_len: int) -> TokenArray:
    """A length-only prompt: the decode side needs the length (RoPE positions, KV size), not the values.
    A read-only zero-stride view: it costs nothing however long the prompt (the engine core never receives it)."""
    placeholder: TokenArray = np.broadcast_to(np.zeros(1, dtype=TOKEN_DTYPE), (prompt_len,))
    return placeholder


class GenerationRequest:
    __slots__ = (
        "_prompt_i32",
        "_prompt_list",
        "handoff",
        "phase",
        "prompt_path",
        "request_id",
        "sampling",
    )

    def __init__(
        self,
        request_id: str,
        prompt_i32: TokenArray,
        sampling: SamplingParams,
        *,
        phase: Phase = Phase.AGGREGATED,
        prompt_path: PromptPath = PromptPath.ARRAY,
        handoff: Handoff | None = None,
        prompt_list: list[int] | None = None,
    ) -> None:
        if prompt_i32.dtype != TOKEN_DTYPE or prompt_i32.ndim != 1:
            raise TypeError("prompt_i32 must be a 1-D little-endian int32 array")
        if prompt_i32.flags.writeable:
            # Share, never copy: the request keeps a read-only view, so no reader of it can edit the prompt.
            prompt_i32 = prompt_i32.view()
            prompt_i32.flags.writeable = False
        if phase is Phase.GENERATION_ONLY and handoff is None:
            raise ValueError("a generation_only request needs a hand-off")
        if sampling.max_tokens is None:
            raise ValueError("resolve max_tokens against the engine's context before building the request")
        self.request_id = request_id
        self._prompt_i32 = prompt_i32
        self._prompt_list = prompt_list
        self.sampling = sampling
        self.phase = phase
        self.prompt_path = prompt_path
        self.handoff = handoff

    @classmethod
    def from_token_list(
        cls, request_id: str, token_ids: list[int], prompt_i32: TokenArray, sampling: SamplingParams, **kw: Any
    ) -> GenerationRequest:
        """The list path: keep the client's list (already built) beside the array derived from it."""
        return cls(request_id, prompt_i32, sampling, prompt_path=PromptPath.LIST, prompt_list=token_ids, **kw)

    @classmethod
    def with_placeholder_prompt(
        cls, request_id: str, prompt_len: int, sampling: SamplingParams, **kw: Any
    ) -> GenerationRequest:
        """Metadata-only: a length-only prompt. The decode side needs only the length (RoPE positions, KV size)."""
        return cls(request_id, placeholder_prompt(prompt_len), sampling, prompt_path=PromptPath.METADATA_ONLY, **kw)

    @property
    def prompt_token_ids_i32(self) -> TokenArray:
        return self._prompt_i32

    @property
    def max_tokens(self) -> int:
        """The output budget, always resolved (the constructor refuses an open one)."""
        assert self.sampling.max_tokens is not None
        return self.sampling.max_tokens

    @property
    def prompt_len(self) -> int:
        return int(self._prompt_i32.shape[0])

    @property
    def prompt_is_placeholder(self) -> bool:
        return self.prompt_path is PromptPath.METADATA_ONLY

    @property
    def prompt_list_built(self) -> bool:
        return self._prompt_list is not None

    @property
    def prompt_token_ids(self) -> list[int]:
        """The prompt as ``list[int]``, built on first read and cached. Only for consumers that read values."""
        if self._prompt_list is None:
            self._prompt_list = self._prompt_i32.tolist()
        return self._prompt_list

    def __getstate__(self) -> dict[str, Any]:
        return {
            "request_id": self.request_id,
            "prompt_i32": self._prompt_i32.tobytes(),
            "sampling": self.sampling,
            "phase": self.phase,
            "prompt_path": self.prompt_path,
            "handoff": self.handoff,
        }

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.request_id = state["request_id"]
        self._prompt_i32 = np.frombuffer(state["prompt_i32"], dtype=TOKEN_DTYPE)
        self._prompt_list = None
        self.sampling = state["sampling"]
        self.phase = state["phase"]
        self.prompt_path = state["prompt_path"]
        self.handoff = state["handoff"]

    def __copy__(self) -> GenerationRequest:
        return self._shallow_copy()

    def __deepcopy__(self, memo: dict[int, Any]) -> GenerationRequest:
        # Token ids are immutable here; a "deep" copy shares them rather than duplicating 131k ints.
        return self._shallow_copy()

    def _shallow_copy(self) -> GenerationRequest:
        clone = GenerationRequest.__new__(GenerationRequest)
        for name in self.__slots__:
            setattr(clone, name, getattr(self, name))
        return clone

    def __repr__(self) -> str:
        return (
            f"GenerationRequest(id={self.request_id!r}, phase={self.phase.value}, prompt_len={self.prompt_len}, "
            f"path={self.prompt_path.value})"
        )
