"""A worker that keeps failing requests is taken out of routing for a while, then tried with one request.

A worker can pass ``/health`` and fail every request, so the breaker counts request outcomes. Each outcome is
reported with the ``Trial`` its call started under: a call started before the breaker opened cannot close it by
succeeding late. See docs/admission.md#circuit-breakers."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

CLOSED, HALF_OPEN, OPEN = 0, 1, 2  # disagg_worker_circuit_state's values
MAX_COOLDOWN_S = 300.0


@dataclass(frozen=True, slots=True)
class Trial:
    epoch: int  # the breaker's state changes before this call started
    is_trial: bool  # the one call of a half-open breaker


class CircuitBreaker:
    def __init__(self, failures: int, cooldown_s: float, clock: Callable[[], float] = time.monotonic,
                 on_change: Callable[[int], None] | None = None) -> None:
        self.failures = failures
        self.base_cooldown_s = cooldown_s
        self._clock = clock
        self._on_change = on_change
        self._state = CLOSED
        self._epoch = 0
        self._in_a_row = 0
        self._cooldown_s = cooldown_s
        self._open_until = 0.0
        self._trial = False  # half-open: a request is trying the worker now

    @property
    def state(self) -> int:
        if self._state == OPEN and self._clock() >= self._open_until:
            self._move(HALF_OPEN)
        return self._state

    def allows(self) -> bool:
        """Whether the worker may be given a request now."""
        state = self.state
        return state == CLOSED or (state == HALF_OPEN and not self._trial)

    def started(self) -> Trial:
        """A request was given to the worker (in half-open: the trial)."""
        is_trial = self.state == HALF_OPEN and not self._trial
        if is_trial:
            self._trial = True
        return Trial(self._epoch, is_trial)

    def succeeded(self, trial: Trial) -> None:
        if trial.epoch != self._epoch:
            return  # started under another state: says nothing of this one
        self._in_a_row = 0
        if trial.is_trial:
            self._trial = False
            self._cooldown_s = self.base_cooldown_s
            self._move(CLOSED)

    def failed(self, trial: Trial) -> None:
        if trial.epoch != self._epoch:
            return
        if trial.is_trial:
            self._trial = False
            self._cooldown_s = min(MAX_COOLDOWN_S, self._cooldown_s * 2)
            self._open()
            return
        self._in_a_row += 1
        if self._state == CLOSED and self._in_a_row >= self.failures:
            self._open()

    def abandoned(self, trial: Trial) -> None:
        """The request ended with no outcome for the worker (cancelled): a trial may be made again."""
        if trial.is_trial and trial.epoch == self._epoch:
            self._trial = False

    def _open(self) -> None:
        self._open_until = self._clock() + self._cooldown_s
        self._in_a_row = 0
        self._move(OPEN)

    def _move(self, state: int) -> None:
        self._state = state
        self._epoch += 1
        if self._on_change is not None:
            self._on_change(state)
