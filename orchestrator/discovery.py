"""Workers found by DNS (a Kubernetes headless service): a pool kept to what the name resolves to.

A failed lookup keeps the members the pool had, so a DNS blip never empties it. Workers that register themselves
join through the admin API instead (``POST /admin/workers`` in ``orchestrator.server``)."""

from __future__ import annotations

import asyncio
import logging
import socket

from frontend.background import BackgroundLoop
from frontend.config import DiscoveryConfig
from orchestrator.pool import WorkerPool

logger = logging.getLogger(__name__)


def _url(scheme: str, address: str, port: int) -> str:
    host = f"[{address}]" if ":" in address else address
    return f"{scheme}://{host}:{port}"


class DnsDiscovery(BackgroundLoop):
    def __init__(self, pool: WorkerPool, config: DiscoveryConfig) -> None:
        self.pool = pool
        self.config = config
        self.task_name = f"dns-discovery-{pool.name}"

    async def resolve(self) -> set[str] | None:
        """The URLs the name resolves to now, or None if the lookup failed."""
        c = self.config
        try:
            infos = await asyncio.get_running_loop().getaddrinfo(c.dns_name, c.port, type=socket.SOCK_STREAM)
        except OSError as exc:
            logger.warning("cannot resolve %s for the %s pool: %s", c.dns_name, self.pool.name, exc)
            return None
        return {_url(c.scheme, str(info[4][0]), c.port) for info in infos}

    async def refresh(self) -> None:
        urls = await self.resolve()
        if urls is not None:
            self.pool.sync(urls, source="dns")

    async def _run(self) -> None:
        while True:
            await self.refresh()
            await asyncio.sleep(self.config.interval_s)

