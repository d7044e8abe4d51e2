"""Where CTX keeps exported KV until GEN takes it: bounded by bytes, with a time to live, one-time keys.

An entry leaves when GEN takes it, when it is released or aborted, or when it expires, and the ``ledger`` counts
each way, so nothing is stranded unnoticed. Keys are 256-bit random tokens compared in constant time. The transfer
server runs in the engine core, so KV bytes never pass through an HTTP front end's event loop."""

from __future__ import annotations

import hmac
import secrets
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from workers.engines.base import HANDOFF_TOTALS


class KVStoreFull(Exception):
    pass


class KVStoreMiss(Exception):
    """Unknown, expired, already taken, or wrong key; ``status`` is the HTTP status to answer with."""

    def __init__(self, message: str, status: int) -> None:
        super().__init__(message)
        self.status = status


@dataclass(slots=True)
class _Entry:
    key: str
    payload: bytes
    parked_at: float
    expires_at: float


class KVStore:
    def __init__(self, max_bytes: int, ttl_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.max_bytes = max_bytes
        self.ttl_s = ttl_s
        self._clock = clock
        self._entries: dict[str, _Entry] = {}
        self._bytes = 0
        self.totals = dict.fromkeys(HANDOFF_TOTALS, 0)  # the ledger's counts since start
        self._lock = threading.Lock()
        self.on_change: Callable[[int, int], None] = lambda entries, size: None

    def put(self, entry_id: str, payload: bytes) -> str:
        try:
            with self._lock:
                self._expire_locked()
                if self._bytes + len(payload) > self.max_bytes:
                    raise KVStoreFull(f"KV store is full ({self._bytes} of {self.max_bytes} bytes held)")
                key = secrets.token_urlsafe(32)
                now = self._clock()
                self._entries[entry_id] = _Entry(key, payload, now, now + self.ttl_s)
                self._bytes += len(payload)
                self.totals["parked"] += 1
        finally:
            self._notify()  # a refusal may have expired entries on its way
        return key

    def entry_bytes(self, entry_id: str) -> int | None:
        """The size of a parked hand-off (None if it is not held): reported in the core's traces."""
        with self._lock:
            entry = self._entries.get(entry_id)
            return None if entry is None else len(entry.payload)

    def take(self, entry_id: str, key: str) -> bytes:
        try:
            with self._lock:
                self._expire_locked()
                entry = self._entries.get(entry_id)
                if entry is None:
                    raise KVStoreMiss(f"no KV hand-off '{entry_id}': unknown, expired or already taken", 404)
                if not hmac.compare_digest(entry.key.encode(), key.encode()):
                    raise KVStoreMiss("wrong key for this KV hand-off", 403)
                del self._entries[entry_id]
                self._bytes -= len(entry.payload)
                self.totals["taken"] += 1
        finally:
            self._notify()  # a miss may have expired entries on its way
        return entry.payload

    def discard_with_key(self, entry_id: str, key: str) -> bool:
        """Discard only for the holder of the entry's key (a release from the network)."""
        with self._lock:
            entry = self._entries.get(entry_id)
            if entry is None or not hmac.compare_digest(entry.key.encode(), key.encode()):
                return False
        return self.discard(entry_id)

    def discard(self, entry_id: str) -> bool:
        with self._lock:
            entry = self._entries.pop(entry_id, None)
            if entry is not None:
                self._bytes -= len(entry.payload)
                self.totals["released"] += 1
        if entry is not None:
            self._notify()
        return entry is not None

    def expire(self) -> int:
        with self._lock:
            removed = self._expire_locked()
        if removed:
            self._notify()
        return removed

    def _expire_locked(self) -> int:
        now = self._clock()
        dead = [entry_id for entry_id, entry in self._entries.items() if entry.expires_at <= now]
        for entry_id in dead:
            self._bytes -= len(self._entries.pop(entry_id).payload)
        self.totals["expired"] += len(dead)
        return len(dead)

    @property
    def stats(self) -> tuple[int, int]:
        with self._lock:
            return len(self._entries), self._bytes

    def ledger(self) -> dict[str, Any]:
        """What is parked now (id, age, bytes, time left) and the totals: for the worker's admin listing."""
        with self._lock:
            self._expire_locked()
            now = self._clock()
            parked = [{"id": entry_id, "age_s": round(now - e.parked_at, 3), "bytes": len(e.payload),
                       "expires_in_s": round(e.expires_at - now, 3)} for entry_id, e in self._entries.items()]
            return {"parked_now": parked, "parked_bytes": self._bytes, "totals": dict(self.totals)}

    def _notify(self) -> None:
        entries, size = self.stats
        self.on_change(entries, size)


KV_KEY_HEADER = "X-KV-Key"


class KVTransferServer:
    """``GET /kv/<id>`` with the one-time key in ``X-KV-Key``; serves from a ``KVStore`` in its own threads."""

    def __init__(self, store: KVStore, host: str, port: int) -> None:
        self.store = store

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                if not self.path.startswith("/kv/"):
                    self._answer(404, b"not found")
                    return
                try:
                    payload = store.take(self.path[4:], self.headers.get(KV_KEY_HEADER, ""))
                except KVStoreMiss as exc:
                    self._answer(exc.status, str(exc).encode())
                    return
                self._answer(200, payload, "application/octet-stream")

            def _answer(self, status: int, body: bytes, content_type: str = "text/plain") -> None:
                self.send_response(status)
                self.send_header("Content-Type", content_type)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, format: str, *args: Any) -> None:
                pass

        self._server = ThreadingHTTPServer((host, port), Handler)
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._server.serve_forever, name="kv-transfer", daemon=True)

    @property
    def port(self) -> int:
        return int(self._server.server_address[1])

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()
