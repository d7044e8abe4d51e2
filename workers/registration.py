"""A worker that announces itself to an orchestrator (``--register URL``) and leaves when it shuts down."""

from __future__ import annotations

import asyncio
import contextlib
import logging

import httpx

logger = logging.getLogger("disagg_serve.worker.registration")

_RETRY_S = (0.5, 1.0, 2.0, 5.0)


class Registration:
    def __init__(self, orchestrator_url: str, advertise_url: str, role: str, admin_key: str | None) -> None:
        self.orchestrator_url = orchestrator_url.rstrip("/")
        self.body = {"url": advertise_url.rstrip("/"), "role": role}
        self.headers = {"Authorization": f"Bearer {admin_key}"} if admin_key else {}
        self._task: asyncio.Task[None] | None = None
        self.registered = asyncio.Event()

    async def _register_until_done(self) -> None:
        attempt = 0
        async with httpx.AsyncClient(timeout=10) as client:
            while True:
                try:
                    reply = await client.post(self.orchestrator_url + "/admin/workers", json=self.body,
                                              headers=self.headers)
                    if reply.status_code in (200, 201):
                        logger.info("registered %s with %s", self.body["url"], self.orchestrator_url)
                        self.registered.set()
                        return
                    if reply.status_code in (401, 403):
                        logger.error("the orchestrator refused registration (%s): check --admin-key",
                                     reply.status_code)
                        return
                    logger.warning("registration answered %s; retrying", reply.status_code)
                except httpx.HTTPError as exc:
                    logger.warning("registration with %s failed (%s); retrying", self.orchestrator_url, exc)
                await asyncio.sleep(_RETRY_S[min(attempt, len(_RETRY_S) - 1)])
                attempt += 1

    def start(self) -> None:
        self._task = asyncio.create_task(self._register_until_done(), name="worker-registration")

    async def leave(self) -> None:
        if self._task is not None and not self._task.done():
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        if not self.registered.is_set():
            return
        try:
            async with httpx.AsyncClient(timeout=5) as client:
                await client.request("DELETE", self.orchestrator_url + "/admin/workers", json=self.body,
                                     headers=self.headers)
        except httpx.HTTPError as exc:
            logger.warning("could not deregister from %s: %s (health checks will notice)", self.orchestrator_url, exc)
