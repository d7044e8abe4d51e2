"""Per-request token sampling: penalties, temperature, top-k/top-p, seeded draws and logprobs.

The draw for output position i comes from a fresh PCG64 generator seeded with (seed, i), never from one threaded
through the request, so a GEN worker that continues after CTX's first token(s) draws what a single worker would.
Sequence i of n draws as a request seeded ``seed + i`` would (vLLM's rule, wrapping in 64 bits)."""

from __future__ import annotations

import secrets
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

from frontend.sampling import SamplingParams

F32Array = npt.NDArray[np.float32]
F64Array = npt.NDArray[np.float64]
BoolArray = npt.NDArray[np.bool_]


_SEED_SPACE = 2**64


def check_sampling(params: SamplingParams) -> None:
    """What this sampler needs beyond ``SamplingParams``' own checks: a seed that fits in 64 bits."""
    if params.seed is not None and not -(2**63) <= params.seed < _SEED_SPACE:
        raise ValueError("seed must be a 64-bit integer")


def seed_key(seed: int, sequence_index: int = 0) -> int:
    """PCG64 takes non-negative seeds: a negative one is read as its 64-bit two's complement, so every signed
    64-bit seed names its own stream, and non-negative seeds keep the streams they always had. Sequence i of an
    ``n`` > 1 request uses ``seed + i``, wrapped the same way."""
    return (seed + sequence_index) % _SEED_SPACE


@dataclass(frozen=True)
class SampledToken:
    token_id: int
    logprob: float  # log-softmax of the raw model logits (before penalties and temperature)
    top_logprobs: tuple[tuple[int, float], ...]  # best first, same distribution as `logprob`


def log_softmax(logits: npt.NDArray[np.floating[Any]]) -> F64Array:
    """Log-probabilities in float64, so small ones do not underflow or lose digits."""
    x = np.asarray(logits, dtype=np.float64)
    shifted = x - x.max()
    out: F64Array = shifted - np.log(np.exp(shifted).sum())
    return out


def top_logprobs(logprobs: F64Array, n: int) -> tuple[tuple[int, float], ...]:
    if n <= 0:
        return ()
    n = min(n, logprobs.shape[0])
    idx = np.argpartition(-logprobs, n - 1)[:n]
    # Ties broken by token id so the list is deterministic.
    order = np.lexsort((idx, -logprobs[idx]))
    return tuple((int(idx[i]), float(logprobs[idx[i]])) for i in order)


class Sampler:
    """Chooses tokens for one request; `sample` records each chosen token as output.

    Logprob convention (OpenAI's): logprobs are of the raw model distribution, i.e. log-softmax of
    the logits before penalties, temperature and truncation, so they describe the model, not the
    sampling settings; they are identical under greedy and sampled decoding. A grammar's mask
    (``allowed``) is a truncation too: it limits the choice, not the reported distribution.
    """

    def __init__(
        self,
        config: SamplingParams,
        prompt_ids: npt.NDArray[np.integer[Any]] | Sequence[int],
        vocab_size: int,
        output_so_far: Sequence[int] = (),
        sequence_index: int = 0,
    ) -> None:
        check_sampling(config)
        self.config = config
        self.vocab_size = vocab_size
        self.seed = seed_key(config.seed, sequence_index) if config.seed is not None else secrets.randbits(63)
        prompt = np.asarray(prompt_ids, dtype=np.int64).reshape(-1)
        self._check_ids(prompt)
        # Counts over token values, built once: per-step cost is O(vocab), not O(prompt + output).
        self._output_counts = np.zeros(vocab_size, np.int64)
        self._seen = np.bincount(prompt, minlength=vocab_size) > 0  # prompt or output, for repetition
        self._position = 0
        for token in output_so_far:
            self.observe(token)

    def _check_ids(self, ids: npt.NDArray[np.int64]) -> None:
        if ids.size and (ids.min() < 0 or ids.max() >= self.vocab_size):
            raise ValueError(f"token id out of range [0, {self.vocab_size})")

    @property
    def position(self) -> int:
        """Number of output tokens so far: the index of the next draw."""
        return self._position

    def observe(self, token_id: int) -> None:
        """Record an output token chosen elsewhere (e.g. on the CTX worker) without sampling."""
        if not 0 <= token_id < self.vocab_size:
            raise ValueError(f"token id {token_id} out of range [0, {self.vocab_size})")
        self._output_counts[token_id] += 1
        self._seen[token_id] = True
        self._position += 1

    def _penalised(self, logits: F32Array) -> F32Array:
        cfg = self.config
        out = np.array(logits, dtype=np.float32)  # never modify the caller's logits
        if cfg.repetition_penalty != 1.0:
            rp = np.float32(cfg.repetition_penalty)
            seen = self._seen
            out[seen] = np.where(out[seen] > 0, out[seen] / rp, out[seen] * rp)
        if cfg.frequency_penalty != 0.0 or cfg.presence_penalty != 0.0:
            counts = self._output_counts
            out -= np.float32(cfg.frequency_penalty) * counts.astype(np.float32) + np.float32(
                cfg.presence_penalty
            ) * (counts > 0).astype(np.float32)
        return out

    def _probabilities(self, logits: F32Array) -> tuple[npt.NDArray[np.int64], F64Array]:
        """Candidate ids and their normalised probabilities after temperature, top-k and top-p."""
        cfg = self.config
        scaled = logits.astype(np.float64) / cfg.temperature
        ids = np.arange(scaled.shape[0])
        if 0 < cfg.top_k < scaled.shape[0]:
            ids = np.argpartition(-scaled, cfg.top_k - 1)[: cfg.top_k]
        probs = np.exp(scaled[ids] - scaled[ids].max())
        probs /= probs.sum()
        if cfg.top_p < 1.0:
            # Sort descending (ties by id for determinism) and keep the smallest prefix reaching top_p.
            order = np.lexsort((ids, -probs))
            ids, probs = ids[order], probs[order]
            keep = int(np.searchsorted(np.cumsum(probs), cfg.top_p)) + 1
            ids, probs = ids[:keep], probs[:keep]
            probs = probs / probs.sum()
        elif cfg.top_k > 0:
            order = np.argsort(ids)  # candidate order must not depend on argpartition's internals
            ids, probs = ids[order], probs[order]
        return ids, probs

    def _draw(self) -> float:
        rng = np.random.Generator(np.random.PCG64([self.seed, self._position]))
        return float(rng.random())

    def choose(self, logits: F32Array, allowed: BoolArray | None = None) -> int:
        """The token for the current position, without recording it; only an ``allowed`` one when given."""
        penalised = self._penalised(logits)
        if allowed is not None:
            penalised[~allowed] = -np.inf  # before temperature and top-k/p, so they share out only what is allowed
        if self.config.temperature == 0.0:
            return int(np.argmax(penalised))
        ids, probs = self._probabilities(penalised)
        cdf = np.cumsum(probs)
        index = int(np.searchsorted(cdf, self._draw() * cdf[-1], side="right"))
        return int(ids[min(index, ids.shape[0] - 1)])

    def sample(self, logits: F32Array, allowed: BoolArray | None = None) -> SampledToken:
        """Choose, record and report the next output token (one of the ``allowed`` ones, when given)."""
        if logits.shape != (self.vocab_size,):
            raise ValueError(f"logits shape {logits.shape} != ({self.vocab_size},)")
        token = self.choose(logits, allowed)
        lp = log_softmax(logits)
        n_top = self.config.logprobs or 0
        result = SampledToken(token, float(lp[token]), top_logprobs(lp, n_top))
        self.observe(token)
        return result
