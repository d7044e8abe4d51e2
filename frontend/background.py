"""A task that runs beside a server for its whole life (health checks, discovery, lag, memory): start and stop."""

from __future__ import annotations

import asyncio
import contextlib
from abc import ABC, abstractmethod


class BackgroundLoop(ABC):
    task_name = "background-loop"
    _task: asyncio.Task[None] | None = None

    @abstractmethod
    async def _run(self) -> None:
        """The loop itself; runs until cancelled."""

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name=self.task_name)

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
