"""KV cache events on vLLM's wire: what a worker holds, published over ZMQ, read by every orchestrator process.

The format is vLLM's (``vllm/distributed/kv_events.py``), so one reader serves every publisher; our workers publish
prefix-chain links on ``PREFIX_CHAIN_TOPIC``, the one topic the subscriber reads. With the deployment secret every
socket speaks CURVE under the key pair derived from it. A replay is answered in bounded pages, so a peer that does
not read holds at most two pages of the worker's memory. The wire and its bounds: docs/routing.md#kv-events."""

from __future__ import annotations

import asyncio
import collections
import contextlib
import itertools
import logging
import time
from collections.abc import Callable, Sequence
from typing import Any, TypeVar
from urllib.parse import urlsplit

import msgspec
import zmq
import zmq.asyncio

from frontend.internal_secret import InternalSecret, warn_if_exposed

logger = logging.getLogger(__name__)

PREFIX_CHAIN_TOPIC = b"prefix-chain"
END_SEQ = (-1).to_bytes(8, "big", signed=True)
REPLAY_BATCHES = 10_000  # batches a publisher keeps for subscribers that missed some (vLLM's default)
MAX_BATCH_BYTES = 64 * 1024 * 1024  # a snapshot of ~4M links; a larger message is refused by the socket
_REPLAY_WAIT_S = 5.0  # a replay that has not ended by then is given up; live events keep flowing
REPLAY_PAGE_BATCHES = 64  # batches one replay request is answered with at most (~80 KB of usual batches)
REPLAY_PAGE_BYTES = 1024 * 1024  # and bytes at most (past the first batch, which always goes)
# Messages queued for one peer: two pages and their ends. Not one: libzmq learns what the connection took off the
# queue only every half high-water mark, so a subscriber that read its whole page may still count as holding up to
# half of it when it asks for the next.
REPLAY_PEER_HWM = 2 * (REPLAY_PAGE_BATCHES + 1)
REPLAY_PEER_SNDBUF = 256 * 1024  # bytes of a peer's TCP send buffer (Linux doubles it for its bookkeeping)


class BlockStored(msgspec.Struct, tag=True, omit_defaults=True, gc=False):
    # Required as vLLM declares them, so that vLLM's own decoder reads what we publish.
    block_hashes: list[int | bytes]
    parent_block_hash: int | bytes | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None


class BlockRemoved(msgspec.Struct, tag=True, omit_defaults=True, gc=False):
    block_hashes: list[int | bytes]
    medium: str | None


class AllBlocksCleared(msgspec.Struct, tag=True, omit_defaults=True, gc=False):
    pass


KVCacheEvent = BlockStored | BlockRemoved | AllBlocksCleared


class KVEventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[KVCacheEvent]
    data_parallel_rank: int | None = None


_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(KVEventBatch)


def encode_batch(events: Sequence[KVCacheEvent]) -> bytes:
    return _encoder.encode(KVEventBatch(time.time(), list(events)))


def decode_batch(payload: bytes) -> KVEventBatch:
    """A batch; ``msgspec.DecodeError`` if the payload is not one. Fields we do not read are ignored."""
    return _decoder.decode(payload)


def bound_endpoint(socket: zmq.Socket[Any]) -> str:
    return socket.getsockopt_string(zmq.LAST_ENDPOINT)


def _new_socket(context: zmq.asyncio.Context, kind: int, endpoint: str) -> zmq.asyncio.Socket:
    """A socket that lingers on nothing, able to bind or connect ``endpoint``."""
    return _ready(context.socket(kind), endpoint)


SocketT = TypeVar("SocketT", bound=zmq.Socket[Any])


def _ready(socket: SocketT, endpoint: str) -> SocketT:
    socket.setsockopt(zmq.LINGER, 0)
    if "[" in endpoint:  # libzmq refuses an IPv6 address (tcp://[::1]:5557) on a socket without IPV6
        socket.setsockopt(zmq.IPV6, 1)
    return socket


def curve_server(socket: zmq.Socket[Any], secret: InternalSecret | None) -> None:
    """Make ``socket`` (before it binds) accept only peers holding the deployment's key pair; no secret: open."""
    if secret is not None:
        public, private = secret.curve_keypair()
        socket.curve_secretkey = private
        socket.curve_publickey = public
        socket.curve_server = True


def curve_client(socket: zmq.Socket[Any], secret: InternalSecret | None) -> None:
    """Make ``socket`` (before it connects) prove the deployment's key pair to a ``curve_server`` socket."""
    if secret is not None:
        public, private = secret.curve_keypair()
        socket.curve_serverkey = public  # every process of the deployment holds the one pair
        socket.curve_publickey = public
        socket.curve_secretkey = private


def _endpoint_host(endpoint: str) -> str | None:
    """The host a ``tcp://`` endpoint binds (``*`` read as every interface); None for another transport."""
    scheme, _, rest = endpoint.partition("://")
    if scheme != "tcp":
        return None  # ipc:// and inproc:// reach no other machine
    host = rest.rpartition(":")[0]
    return "0.0.0.0" if host == "*" else host


def reachable_endpoint(endpoint: str, worker_url: str) -> str:
    """``endpoint`` as a worker announced it, with a wildcard host (``tcp://*:5557``, ``tcp://0.0.0.0:5557``)
    replaced by the host the orchestrator reaches the worker at."""
    scheme, _, rest = endpoint.partition("://")
    host, _, port = rest.rpartition(":")
    if scheme == "tcp" and host in ("*", "0.0.0.0", "[::]", "::"):
        worker_host = urlsplit(worker_url).hostname or "127.0.0.1"
        if ":" in worker_host:
            worker_host = f"[{worker_host}]"
        return f"tcp://{worker_host}:{port}"
    return endpoint


class EventPublisher:
    """A worker's publisher: a PUB socket, and a ROUTER socket that replays its last ``REPLAY_BATCHES`` batches.

    Sends never block the event loop: PUB drops messages for a subscriber past its high-water mark, and that
    subscriber's next batch shows the gap, which it fills by replay.
    """

    def __init__(self, endpoint: str, replay_endpoint: str | None, topic: bytes = PREFIX_CHAIN_TOPIC,
                 snapshot: Callable[[], list[KVCacheEvent]] | None = None,
                 replay_batches: int = REPLAY_BATCHES, secret: InternalSecret | None = None) -> None:
        # ``snapshot``: the whole picture as events (AllBlocksCleared, then what is held), for a subscriber that
        # asks for batches older than the buffer keeps: an orchestrator started long after this worker, which
        # would otherwise never learn of links stored before (a hot system prompt is stored once).
        self._snapshot = snapshot
        self._context = zmq.asyncio.Context.instance()
        # A plain (not asyncio) PUB socket: it is only ever sent to, and a send returns at once (a PUB socket
        # drops what a subscriber past its high-water mark has no room for), so it needs no Future per batch.
        self._pub: zmq.Socket[bytes] = _ready(zmq.Socket(self._context, zmq.PUB), endpoint)
        self._replay: zmq.asyncio.Socket | None = None
        self._replay_sender: zmq.Socket[bytes] | None = None
        self.replay_endpoint: str | None = None
        try:
            curve_server(self._pub, secret)
            self._pub.bind(endpoint)
            self.endpoint = bound_endpoint(self._pub)  # the real port when ``endpoint`` asked for port 0
            if replay_endpoint is not None:
                self._replay = _new_socket(self._context, zmq.ROUTER, replay_endpoint)
                curve_server(self._replay, secret)
                # One peer's queue holds two pages at most; a send past that fails (EAGAIN) instead of being
                # dropped in silence, and a send to a peer that has left fails too (EHOSTUNREACH).
                self._replay.setsockopt(zmq.SNDHWM, REPLAY_PEER_HWM)
                # And the kernel's share of it: a fixed send buffer, not one autotuned up to MiBs per connection.
                self._replay.setsockopt(zmq.SNDBUF, REPLAY_PEER_SNDBUF)
                self._replay.setsockopt(zmq.ROUTER_MANDATORY, 1)
                # A request is 9 bytes, a CURVE handshake's largest command ~300: anything past 4 KiB is not ours.
                self._replay.setsockopt(zmq.MAXMSGSIZE, 4096)
                self._replay.bind(replay_endpoint)
                self.replay_endpoint = bound_endpoint(self._replay)
                # The same socket, for sends that return at once (refused or queued), never a Future per batch.
                self._replay_sender = zmq.Socket.shadow(self._replay.underlying)
        except BaseException:  # a replay address in use must not leave the PUB socket bound for good
            self._pub.close(linger=0)
            if self._replay is not None:
                self._replay.close(linger=0)
            raise
        for bound in (endpoint, replay_endpoint):
            host = _endpoint_host(bound) if bound is not None else None
            if host is not None and warn_if_exposed(secret, host, "the KV-event publisher"):
                break  # one warning for the pair
        self.topic = topic
        self._sequence = 0
        self._buffer: collections.deque[tuple[int, bytes]] = collections.deque(maxlen=replay_batches)
        self._replay_task: asyncio.Task[None] | None = None
        self._snapshot_of: tuple[int, bytes] | None = None  # (sequence, encoded snapshot as of it)
        self.replay_requests = 0  # replay requests read
        self.replays_dropped = 0  # of them, given up: the peer's queue was full (it does not read) or it left

    def start(self) -> None:
        if self._replay is not None and self._replay_task is None:
            self._replay_task = asyncio.get_running_loop().create_task(self._serve_replays(), name="kv-event-replay")

    def publish(self, events: Sequence[KVCacheEvent]) -> None:
        if not events:
            return
        payload = encode_batch(events)
        sequence = self._sequence
        self._sequence += 1
        self._buffer.append((sequence, payload))
        with contextlib.suppress(zmq.Again):  # no room for some subscriber: it sees the gap and replays
            self._pub.send_multipart((self.topic, sequence.to_bytes(8, "big"), payload), flags=zmq.NOBLOCK)

    async def _serve_replays(self) -> None:
        assert self._replay is not None
        while True:
            frames = await self._replay.recv_multipart()
            self.replay_requests += 1
            if len(frames) != 3 or len(frames[2]) != 8:
                logger.warning("a KV event replay request of %d frames, not 3 with an 8-byte start: ignored",
                               len(frames))
                continue
            client, _, start = frames
            try:
                self._answer_replay(client, int.from_bytes(start, "big"))
            except zmq.ZMQError as exc:  # EAGAIN: its queue is full, it does not read; EHOSTUNREACH: it left
                self.replays_dropped += 1
                logger.debug("a KV event replay to a peer that does not take it is dropped (%s)", exc)
            await asyncio.sleep(0)  # one page at a time: the worker's streams run between requests

    def _answer_replay(self, client: bytes, first: int) -> None:
        """One page from ``first`` on, then the end marker, each sent at once or not at all (``ZMQError``)."""
        send = self._replay_sender
        assert send is not None
        oldest = self._buffer[0][0] if self._buffer else self._sequence
        if first < oldest and self._snapshot is not None and self._sequence:
            # What it asks for is gone: the state as of the latest batch instead, under that batch's number.
            latest = self._sequence - 1
            if self._snapshot_of is None or self._snapshot_of[0] != latest:
                self._snapshot_of = (latest, encode_batch(self._snapshot()))
            send.send_multipart((client, b"", self.topic, latest.to_bytes(8, "big"), self._snapshot_of[1]),
                                flags=zmq.NOBLOCK, copy=False)
        else:
            # The buffer's sequences are consecutive: the page starts at an index, no scan for it.
            skip = max(0, first - oldest)
            sent_bytes = 0
            for sequence, payload in itertools.islice(self._buffer, skip, skip + REPLAY_PAGE_BATCHES):
                if sent_bytes and sent_bytes + len(payload) > REPLAY_PAGE_BYTES:
                    break  # the rest is the subscriber's next request
                send.send_multipart((client, b"", self.topic, sequence.to_bytes(8, "big"), payload),
                                    flags=zmq.NOBLOCK, copy=False)
                sent_bytes += len(payload)
        send.send_multipart((client, b"", b"", END_SEQ, b""), flags=zmq.NOBLOCK)

    async def aclose(self) -> None:
        if self._replay_task is not None:
            self._replay_task.cancel()
            await asyncio.gather(self._replay_task, return_exceptions=True)
        self._pub.close(linger=0)
        if self._replay is not None:
            self._replay.close(linger=0)  # the shadow needs no close of its own: it owns no socket


class EventSubscriber:
    """Reads one worker's stream in order. ``apply(events)`` gets each batch once; ``reset()`` is called when the
    picture so far can no longer be trusted (the publisher restarted, or a gap could not be replayed), before
    the batches that rebuild it.

    On start, and after every gap, it asks the replay socket for what it missed; without a replay socket a gap
    resets and goes on from the live stream.
    """

    def __init__(self, endpoint: str, replay_endpoint: str | None, apply: Callable[[list[KVCacheEvent]], None],
                 reset: Callable[[], None], topic: bytes = PREFIX_CHAIN_TOPIC,
                 secret: InternalSecret | None = None) -> None:
        self.endpoint = endpoint
        self._secret = secret
        self.replay_endpoint = replay_endpoint
        self.topic = topic
        self._apply = apply
        self._reset = reset
        self._next: int | None = None  # the sequence expected next; None: nothing read yet
        self._last_live: int | None = None  # the last sequence read from the live stream
        self.batches = 0
        self.gaps = 0
        self._answered = False  # a replay request was answered (a worker with nothing to say yet says so)
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._run(), name=f"kv-events {self.endpoint}")

    async def aclose(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None

    @property
    def delivered(self) -> bool:
        """Whether anything came from the worker yet: a batch, or a replay's answer."""
        return self.batches > 0 or self._answered

    async def _run(self) -> None:
        context = zmq.asyncio.Context.instance()
        sub = _new_socket(context, zmq.SUB, self.endpoint)
        try:
            sub.setsockopt(zmq.SUBSCRIBE, self.topic)
            sub.setsockopt(zmq.RCVHWM, REPLAY_BATCHES)
            sub.setsockopt(zmq.MAXMSGSIZE, MAX_BATCH_BYTES)  # a worker's batch is KiBs; one of GiBs is an attack
            curve_client(sub, self._secret)
            sub.connect(self.endpoint)
            await self._replay(0)  # what was published before we connected
            while True:
                frames = await sub.recv_multipart()
                await self._take(frames)
        except asyncio.CancelledError:
            raise
        except Exception:  # a reader that dies silently would freeze the picture: say so; routing goes on without
            logger.exception("KV events from %s: the reader stopped", self.endpoint)
            self._reset()
        finally:
            sub.close(linger=0)

    async def _take(self, frames: list[bytes]) -> None:
        if len(frames) != 3 or frames[0] != self.topic:
            return
        sequence = int.from_bytes(frames[1], "big")
        last_live, self._last_live = self._last_live, sequence
        if last_live is not None and sequence <= last_live:
            # One publisher's live stream only climbs: a sequence at or below the last one read means it started
            # again (even when its first batches went by before this socket had reconnected).
            logger.info("KV events from %s start again at %d: the picture is rebuilt", self.endpoint, sequence)
            self._reset()
            self._next = 0  # what the new publisher sent before ``sequence`` is asked for by replay below
        elif self._next is not None and sequence < self._next:
            return  # already read (a replay and the live stream overlapped)
        if self._next is not None and sequence > self._next:
            self.gaps += 1
            await self._replay(self._next)
            if self._next is not None and sequence < self._next:
                return  # the replay brought it
        self._deliver(sequence, frames[2])

    def _deliver(self, sequence: int, payload: bytes) -> None:
        if self._next is not None and sequence != self._next:
            # A hole nobody could fill: what this worker holds is no longer known for sure.
            logger.warning("KV events from %s: batches %d..%d are lost; the picture is rebuilt from here",
                           self.endpoint, self._next, sequence - 1)
            self._reset()
        try:
            batch = decode_batch(payload)
        except msgspec.DecodeError:
            logger.warning("KV events from %s: batch %d is not a KVEventBatch; skipped", self.endpoint, sequence)
        else:
            self._apply(batch.events)
            self.batches += 1
        self._next = sequence + 1

    async def _replay(self, first: int) -> None:
        """What was published from ``first`` on, page after page (``REPLAY_PAGE_BATCHES``) until a page brings
        nothing new, on one connection."""
        if self.replay_endpoint is None:
            return
        dealer = _new_socket(zmq.asyncio.Context.instance(), zmq.DEALER, self.replay_endpoint)
        try:
            dealer.setsockopt(zmq.RCVHWM, REPLAY_PEER_HWM)
            dealer.setsockopt(zmq.MAXMSGSIZE, MAX_BATCH_BYTES)
            curve_client(dealer, self._secret)
            dealer.connect(self.replay_endpoint)
            while await self._replay_page(dealer, first):
                if self._next is None:
                    return
                first = self._next
        except TimeoutError:
            logger.warning("KV events from %s: no replay answer within %.0f s", self.replay_endpoint, _REPLAY_WAIT_S)
        finally:
            dealer.close(linger=0)

    async def _replay_page(self, dealer: zmq.asyncio.Socket, first: int) -> bool:
        """One replay request and its answer; whether it brought anything new (the next expected moved on)."""
        before = self._next
        await dealer.send_multipart((b"", first.to_bytes(8, "big")))
        for count in itertools.count():
            frames = await asyncio.wait_for(dealer.recv_multipart(), _REPLAY_WAIT_S)
            self._answered = True
            if count % 256 == 255:
                await asyncio.sleep(0)  # a long replay must not hold the orchestrator's loop
            if len(frames) != 4 or frames[2] == END_SEQ:
                return self._next != before
            _, topic, sequence_bytes, payload = frames
            sequence = int.from_bytes(sequence_bytes, "big")
            if topic == self.topic and (self._next is None or sequence >= self._next):
                if self._next is None and sequence != first:
                    self._next = sequence  # the buffer had moved on: what is older is gone for good
                self._deliver(sequence, payload)
        raise AssertionError("unreachable")  # itertools.count() never ends
