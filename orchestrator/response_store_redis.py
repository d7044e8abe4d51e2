"""The Responses store on a Redis or Valkey server: one store for every orchestrator process and replica.

Each call is one Lua script, which Redis runs whole: an entry is stored with its bookkeeping or not at all, and
processes storing at once cannot push the store past its bounds. The keys share one hash tag (one Cluster slot):
``{prefix}:r:<id>`` (the entry, expiring by itself), ``:use`` and ``:age`` (ids by last use, by store time),
``:sizes`` and ``:bytes`` (for the byte bound), ``:tick`` (the use counter). Outages: docs/conformance.md."""

from __future__ import annotations

import asyncio
import logging
import time
from urllib.parse import urlsplit

import redis.asyncio as redis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import RedisError, ResponseError

from frontend.config import ResponseStoreConfig
from frontend.errors import ResponseStoreUnavailableError
from frontend.metrics import Metrics
from orchestrator.metric_labels import RESPONSE_STORE_OPERATIONS
from orchestrator.response_store import Clock, StoredResponse

logger = logging.getLogger(__name__)

# Connections to Redis per process: more requests than this at once wait (within the timeout) for one.
MAX_CONNECTIONS = 64
# Expired entries one call removes from the bookkeeping at most: a call stays short however long no one wrote.
_EXPIRED_PER_CALL = 256
_REFUSAL_LOG_EVERY_S = 60.0

# Redis 7's script flags (the first line). A store refused by a Redis at its memory limit (maxmemory with
# noeviction) is refused before its first command, so nothing of it is written; a read (it moves the entry in the
# LRU) and a delete (it frees memory) run even then.
_WRITES_WHOLE = "#!lua\n"
_ALWAYS = "#!lua flags=allow-oom\n"

# KEYS: use, age, sizes, bytes, tick, the entry's key. ARGV[1]: the entries' key prefix, ARGV[2]: the id.
_DROP = """
local use, age, sizes, total, tick, entry = KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5], KEYS[6]
local base = ARGV[1]
local function drop(id)
  local size = redis.call('HGET', sizes, id)
  redis.call('DEL', base .. id)
  redis.call('ZREM', use, id)
  redis.call('ZREM', age, id)
  if not size then return 0 end
  redis.call('HDEL', sizes, id)
  redis.call('DECRBY', total, size)
  return 1
end
local function counts()
  return {redis.call('ZCARD', use), tonumber(redis.call('GET', total) or '0')}
end
"""

# ARGV: prefix, id, response, conversation, session, now, ttl_s, max_entries, max_bytes, expired_per_call, owner.
# Returns {stored (1/0), entries, bytes}.
_PUT = _WRITES_WHOLE + _DROP + """
local id, response, conversation = ARGV[2], ARGV[3], ARGV[4]
local now, ttl = tonumber(ARGV[6]), tonumber(ARGV[7])
local max_entries, max_bytes = tonumber(ARGV[8]), tonumber(ARGV[9])
for _, old in ipairs(redis.call('ZRANGEBYSCORE', age, '-inf', now - ttl, 'LIMIT', 0, tonumber(ARGV[10]))) do
  drop(old)
end
drop(id)
local size = #response + #conversation
if size > max_bytes then
  local c = counts()
  return {0, c[1], c[2]}
end
redis.call('HSET', entry, 'response', response, 'conversation', conversation, 'session', ARGV[5],
           'stored_at', ARGV[6], 'owner', ARGV[11])
redis.call('PEXPIRE', entry, math.ceil(ttl * 1000))
redis.call('ZADD', use, redis.call('INCR', tick), id)
redis.call('ZADD', age, now, id)
redis.call('HSET', sizes, id, size)
redis.call('INCRBY', total, size)
while redis.call('ZCARD', use) > max_entries or tonumber(redis.call('GET', total)) > max_bytes do
  local oldest = redis.call('ZRANGE', use, 0, 0)[1]
  if oldest == id then  -- only this entry is left, and it fits: the total counted what is gone (keys deleted by
    redis.call('SET', total, size)  -- hand), so it starts again from what is here
    break
  end
  drop(oldest)
end
local c = counts()
return {1, c[1], c[2]}
"""

# ARGV: prefix, id, now, ttl_s. Returns {response, conversation, session, stored_at, owner} or false.
_GET = _ALWAYS + _DROP + """
local id = ARGV[2]
local stored_at = redis.call('ZSCORE', age, id)
if not stored_at then return false end
if tonumber(stored_at) <= tonumber(ARGV[3]) - tonumber(ARGV[4]) then
  drop(id)
  return false
end
local fields = redis.call('HMGET', entry, 'response', 'conversation', 'session', 'stored_at', 'owner')
if not fields[1] then  -- gone by itself (its own expiry, or Redis evicted it): forget it
  drop(id)
  return false
end
redis.call('ZADD', use, redis.call('INCR', tick), id)
return fields
"""

# ARGV: prefix, id. Returns {deleted (1/0), entries, bytes}.
_DELETE = _ALWAYS + _DROP + """
local deleted = drop(ARGV[2])
local c = counts()
return {deleted, c[1], c[2]}
"""


def redacted(url: str) -> str:
    """``url`` without its user name and password: what a log line may say."""
    parts = urlsplit(url)
    host = parts.hostname or ""
    where = f"{host}:{parts.port}" if parts.port else host
    return f"{parts.scheme}://{where}{parts.path}"


class RedisResponseStore:
    def __init__(self, limits: ResponseStoreConfig, metrics: Metrics | None = None, clock: Clock = time.time,
                 ) -> None:
        assert limits.url is not None, "the config's validator requires a url for backend: redis"
        self.limits = limits
        self._clock = clock
        self._metrics = metrics or Metrics()
        self._where = redacted(limits.url)
        pool = redis.BlockingConnectionPool.from_url(
            limits.url, max_connections=MAX_CONNECTIONS, timeout=limits.timeout_s,
            socket_connect_timeout=limits.timeout_s, socket_timeout=limits.timeout_s,
            retry=Retry(NoBackoff(), 1), client_name="disagg-serve-orchestrator")
        self._redis = redis.Redis.from_pool(pool)
        self._put, self._get, self._delete = (self._redis.register_script(s) for s in (_PUT, _GET, _DELETE))
        tag = "{" + limits.key_prefix + "}"
        self._keys = [f"{tag}:{name}" for name in ("use", "age", "sizes", "bytes", "tick")]
        self._entry_prefix = f"{tag}:r:"
        self._entries = self._bytes = 0  # as the last call that changed them said
        self._down_since: float | None = None
        self._refusal_logged_at = -_REFUSAL_LOG_EVERY_S
        self._metrics.response_store_up.set(0)  # until it answers (start())
        self._latency = {op: self._metrics.response_store_latency.labels(operation=op)
                         for op in RESPONSE_STORE_OPERATIONS}

    @property
    def entries(self) -> int:
        return self._entries

    @property
    def size_bytes(self) -> int:
        return self._bytes

    async def put(self, response_id: str, response: bytes, conversation: bytes, session: str = "",
                  owner: str = "") -> bool:
        stored, self._entries, self._bytes = await self._call(
            "put", self._put, response_id, response, conversation, session or response_id, repr(self._clock()),
            repr(self.limits.ttl_s), self.limits.max_entries, self.limits.max_bytes, _EXPIRED_PER_CALL, owner)
        return bool(stored)

    async def get(self, response_id: str) -> StoredResponse | None:
        fields = await self._call("get", self._get, response_id, repr(self._clock()), repr(self.limits.ttl_s))
        if not fields:
            return None
        response, conversation, session, stored_at, owner = fields
        return StoredResponse(response_id, response, conversation, float(stored_at), session.decode(),
                              owner.decode() if owner else "")

    async def delete(self, response_id: str) -> bool:
        deleted, self._entries, self._bytes = await self._call("delete", self._delete, response_id)
        return bool(deleted)

    async def start(self) -> None:
        """Ask Redis once, at start-up, so that a wrong URL or password shows at once (logged, ``up`` 0) rather
        than at the first follow-up. The orchestrator serves either way: the store may come later."""
        try:
            async with asyncio.timeout(self.limits.timeout_s):
                await self._redis.ping()
        except (RedisError, OSError, TimeoutError) as exc:
            self._went_down(exc)
            return
        self._metrics.response_store_up.set(1)
        logger.info("the Responses store at %s answers", self._where)

    async def aclose(self) -> None:
        await self._redis.aclose()

    async def _call(self, operation: str, script: object, response_id: str, *args: object) -> list:  # type: ignore[type-arg]
        started = time.perf_counter()
        try:
            async with asyncio.timeout(self.limits.timeout_s):
                result = await script(keys=[*self._keys, self._entry_prefix + response_id],  # type: ignore[operator]
                                      args=[self._entry_prefix, response_id, *args])
        except (RedisError, OSError, TimeoutError) as exc:
            self._failed(operation, exc)
            # The cause (unreachable, too slow, refused: a wrong password, out of memory) is in the log, once per
            # outage; the client learns that the store cannot serve it now.
            raise ResponseStoreUnavailableError("the Responses store is unavailable; try again") from exc
        self._latency[operation].observe(time.perf_counter() - started)
        self._metrics.response_store_up.set(1)
        if self._down_since is not None:
            logger.warning("the Responses store at %s answers again, after %.1f s", self._where,
                           time.monotonic() - self._down_since)
            self._down_since = None
        return result  # type: ignore[no-any-return]

    def _failed(self, operation: str, exc: BaseException) -> None:
        self._metrics.response_store_errors.labels(operation=operation).inc()
        if isinstance(exc, ResponseError):
            # Redis answered, with a refusal (out of memory, a wrong password, a read-only replica): it is not
            # down, so no outage begins; the refusal is logged at most once a minute, not once per request.
            now = time.monotonic()
            if now - self._refusal_logged_at >= _REFUSAL_LOG_EVERY_S:
                self._refusal_logged_at = now
                logger.error("the Responses store at %s refused a %s: %s", self._where, operation, exc)
            return
        self._went_down(exc)

    def _went_down(self, exc: BaseException) -> None:
        self._metrics.response_store_up.set(0)
        if self._down_since is None:  # once per outage, not once per request
            self._down_since = time.monotonic()
            logger.error("the Responses store at %s does not answer (%s: %s); requests that need it get 503 until "
                         "it does", self._where, type(exc).__name__, exc or "no answer within the timeout")
