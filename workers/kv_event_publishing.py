"""A worker's KV events while its app runs: the publisher and the record of the prompt KV its engine holds.

With the deployment secret (``WorkerSettings.internal_secret``) the sockets take only its holders (CURVE,
``frontend.kv_events``), and the worker records a prefix chain only from a request that carries the internal
token (``frontend.prefix_chain.trusted_chain_header``, in ``workers.server``)."""

from __future__ import annotations

import logging
import secrets
from typing import Any

from frontend.kv_events import PREFIX_CHAIN_TOPIC, EventPublisher
from workers.engines.base import Engine, ReportsKvCapacity
from workers.prefix_holdings import PrefixHoldings
from workers.service import WorkerService
from workers.settings import WorkerSettings

logger = logging.getLogger(__name__)


class KvEventPublishing:
    """The worker's KV events: while the app runs, a publisher and the record of what the engine holds
    (``workers.prefix_holdings``), for an engine that reuses KV across requests (``ReportsKvCapacity`` with a
    positive capacity); for any other engine, or with the endpoint off, nothing."""

    def __init__(self, engine: Engine, settings: WorkerSettings, service: WorkerService) -> None:
        self.engine = engine
        self.settings = settings
        self.service = service
        self.publisher: EventPublisher | None = None
        self.card: dict[str, Any] | None = None  # engine_info["kv_events"] while publishing
        # The deployment secret: the sockets' CURVE keys, and who may send this worker a prefix chain (only a
        # holder: anyone else's chain would be published as if the engine held it, and steer every orchestrator).
        self.secret = settings.internal_secret

    def start(self) -> None:
        endpoint = self.settings.kv_events_endpoint
        if endpoint is None or not isinstance(self.engine, ReportsKvCapacity):
            return
        capacity = self.engine.kv_capacity_tokens()
        if not capacity or capacity <= 0:
            return  # the engine reuses no KV: there is nothing to route by
        service = self.service
        publisher = EventPublisher(endpoint, self.settings.kv_events_replay_endpoint,
                                   snapshot=lambda: service.holdings.snapshot() if service.holdings else [],
                                   secret=self.secret)
        publisher.start()
        self.publisher = publisher
        self.service.holdings = PrefixHoldings(capacity, publisher)
        # A new incarnation each start: a subscriber that sees it change knows the picture starts again.
        self.card = {"endpoint": publisher.endpoint, "replay_endpoint": publisher.replay_endpoint,
                     "topic": PREFIX_CHAIN_TOPIC.decode(), "incarnation": secrets.token_hex(8),
                     "capacity_tokens": capacity}
        logger.info("KV events on %s (replay %s): up to %d tokens of prompt KV", publisher.endpoint,
                    publisher.replay_endpoint, capacity)

    async def aclose(self) -> None:
        self.service.holdings = None
        self.card = None
        publisher, self.publisher = self.publisher, None
        if publisher is not None:
            await publisher.aclose()


def kv_capacity_tokens(engine: Engine) -> int | None:
    """The prompt KV ``engine`` keeps for reuse, in tokens (None: it reuses none, or does not say). The worker's card
    says it with or without events: a router that gets no events bounds its model of the cache by it."""
    capacity = engine.kv_capacity_tokens() if isinstance(engine, ReportsKvCapacity) else None
    return capacity if capacity is not None and capacity > 0 else None
