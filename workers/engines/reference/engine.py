"""The reference engine's adapter: the front-end half of the typed engine protocol.

It runs the engine core as its own child process, speaks to it over a Unix socket (token ids as raw int32 payloads)
and turns its frames into ``EngineOutput`` values and its failures into ``frontend.errors`` types. Being the core's
parent, it alone can restart a core that dies, so the worker keeps its address and connections; a core shared by
several front-end processes (``core_socket``) belongs to their supervisor (docs/reliability.md)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import shutil
import signal
import subprocess
import tempfile
from collections.abc import AsyncGenerator
from pathlib import Path
from typing import Any

from frontend.errors import EngineError
from frontend.process_lifetime import die_with_parent
from workers.engines.base import HandoffLedger, ParkedHandoff, Tokenizer
from workers.engines.options import EngineOptions
from workers.engines.outputs import EngineInfo, EngineOutput
from workers.engines.reference.frames import core_error, engine_output, submit_frame, tokenizer_fields
from workers.engines.reference.ipc import ChannelClosed, Header, encode_frame, read_frame
from workers.engines.reference.kv_fetch import HandoffUnavailable, parse_state
from workers.engines.reference.model_file import TokenizerMetadata
from workers.engines.reference.options import ReferenceOptions, core_command, core_env, reference_options
from workers.engines.reference.tokenizer import GGUFTokenizer
from workers.engines.request import GenerationRequest

logger = logging.getLogger(__name__)

# A core busy with a long prefill chunk answers between steps; longer than this means it is stuck.
_HEALTH_PING_TIMEOUT_S = 30.0
# Restarts of a dead core in a row before giving up (then /health stays 503 until an operator acts).
_MAX_RESTARTS = 3


class ReferenceEngine:
    """The typed adapter over the engine core; also a ``ProvidesTokenizer``, ``KVHandoffStore``, ``HealthCheck``
    ``StopsSequences`` and, with block reuse on, ``ReportsKvCapacity``."""

    def __init__(self, options: ReferenceOptions | None = None) -> None:
        self.options = options or ReferenceOptions()
        self._info: EngineInfo | None = None
        self._tokenizer: GGUFTokenizer | None = None
        self._process: subprocess.Popen[bytes] | None = None
        self._writer: asyncio.StreamWriter | None = None
        self._reader_task: asyncio.Task[None] | None = None
        self._queues: dict[str, asyncio.Queue[tuple[Header, bytes]]] = {}
        self._workdir: Path | None = None
        self._alive = False
        self._pings: dict[int, asyncio.Future[dict[str, Any]]] = {}
        self._ping_counter = 0
        self.kv_store_entries = 0
        self.kv_store_bytes = 0
        self.kv_handoff_totals_seen: dict[str, int] = {}
        self._closing = False
        self._restart_task: asyncio.Task[None] | None = None
        self.restarts = 0  # cores started after the first one died
        self._prefix_cache_tokens = 0  # the core's prefix cache, in tokens (0: no block reuse)

    @property
    def info(self) -> EngineInfo:
        if self._info is None:
            raise EngineError("the reference engine has not started")
        return self._info

    def get_tokenizer(self) -> Tokenizer:
        if self._tokenizer is None:
            raise EngineError("the reference engine has not started")
        return self._tokenizer

    # -- lifecycle ----------------------------------------------------------------------------------------
    @property
    def core_pid(self) -> int | None:
        """The engine core's process id, when this adapter started it."""
        return self._process.pid if self._process is not None else None

    async def start(self) -> None:
        self._closing = False
        await self._launch()

    async def _launch(self) -> None:
        if self.options.core_socket is not None:
            socket_path = self.options.core_socket  # a core shared by several front-end processes
        else:
            self._workdir = Path(tempfile.mkdtemp(prefix="disagg-core-"))
            socket_path = str(self._workdir / "core.sock")
            self._process = subprocess.Popen(  # noqa: ASYNC220 - a brief fork; Popen gives us preexec + poll()
                core_command(self.options, socket_path), env=core_env(self.options), preexec_fn=die_with_parent
            )
        try:
            reader, writer = await self._wait_for(asyncio.ensure_future(self._connect(socket_path)))
            ready, _ = await self._wait_for(asyncio.ensure_future(read_frame(reader)))
            if ready.get("op") != "ready":
                writer.close()
                raise EngineError(f"the engine core failed to start: {ready.get('message', ready)}")
        except BaseException:
            await self._stop_core()  # no half-started core, socket or temp dir is left behind
            raise
        self._writer = writer
        self._tokenizer = await asyncio.to_thread(GGUFTokenizer, TokenizerMetadata(**tokenizer_fields(ready)),
                                                 self.options.tokenize)
        self._info = EngineInfo(
            engine="reference",
            model=self.options.served_model_name or Path(ready["model_path"]).stem,
            vocab_size=int(ready["vocab_size"]),
            max_context=int(ready["context_length"]),
            model_hash=str(ready["model_hash"]),
            kv_block_reuse=self.options.kv_block_reuse,
            prompt_tokens_in_handoff=bool(ready["prompt_tokens_in_handoff"]),
            supports_structured_output=True,  # llguidance masks the core's sampler (reference/grammar.py)
            supports_n=True,
        )
        self._prefix_cache_tokens = int(ready.get("prefix_cache_tokens", 0))
        self._alive = True
        self._reader_task = asyncio.create_task(self._read_loop(reader), name="reference-core-reader")
        logger.info("reference engine ready: model %s loaded in %.1f s, core RSS %.0f MB",
                    self._info.model, ready["load_s"], ready["rss_mb"])
        print(f"reference engine: {self._info.model} loaded in {ready['load_s']:.1f} s, "
              f"engine core RSS {ready['rss_mb']:.0f} MB", flush=True)

    async def _connect(self, socket_path: str) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        # The core binds its socket before it loads the model; until then, a refused connect means "not yet".
        while True:
            try:
                return await asyncio.open_unix_connection(socket_path, limit=2**20)
            except (FileNotFoundError, ConnectionRefusedError):
                await asyncio.sleep(0.02)

    async def _wait_for(self, future: asyncio.Future[Any]) -> Any:
        """Await the core's start-up step, failing fast if the process dies or the time runs out."""
        deadline = asyncio.get_running_loop().time() + self.options.startup_timeout_s
        while not future.done():
            if self._process is not None and self._process.poll() is not None:
                future.cancel()
                raise EngineError(f"the engine core exited during start-up (status {self._process.returncode})")
            if asyncio.get_running_loop().time() > deadline:
                future.cancel()
                raise EngineError(f"the engine core did not start within {self.options.startup_timeout_s} s")
            await asyncio.wait({future}, timeout=0.1)
        try:
            return future.result()
        except ChannelClosed as exc:
            raise EngineError("the engine core closed its channel during start-up") from exc

    async def release_handoff(self, ctx_request_id: str, opaque_state: bytes) -> bool:
        try:
            state = parse_state(opaque_state)
        except HandoffUnavailable:
            return False
        try:
            answer = await self._ask({"op": "release", "id": ctx_request_id, "key": str(state["key"])}, 10.0)
        except EngineError:
            return False
        return bool(answer.get("released"))

    def kv_capacity_tokens(self) -> int | None:
        """With ``--kv-block-reuse``: the tokens of prompt KV the core's prefix cache holds (its byte budget over
        the model's KV bytes per token, in whole blocks); without it, None."""
        return self._prefix_cache_tokens or None

    def kv_store_stats(self) -> tuple[int, int]:
        return self.kv_store_entries, self.kv_store_bytes

    async def health(self) -> bool:
        if not self._alive or (self._process is not None and self._process.poll() is not None):
            return False
        try:
            await self.active_requests(timeout_s=_HEALTH_PING_TIMEOUT_S)
        except EngineError:
            return False
        return True

    async def active_requests(self, timeout_s: float = 10.0) -> int:
        """Requests the core holds right now (prefill, decode, or fetching KV), asked over the channel."""
        return (await self.core_stats(timeout_s))["active"]

    async def core_stats(self, timeout_s: float = 10.0) -> dict[str, int]:
        """The core's own counters (active requests, prefix-cache blocks and hits), asked over the channel."""
        return {k: int(v) for k, v in (await self._ask({"op": "ping"}, timeout_s)).items()}

    async def handoff_ledger(self) -> HandoffLedger:
        """What the core's KV store holds now, with ages, and how every hand-off it parked has left it."""
        answer = await self._ask({"op": "handoffs"}, _HEALTH_PING_TIMEOUT_S)
        parked = tuple(ParkedHandoff(str(e["id"]), float(e["age_s"]), int(e["bytes"]), float(e["expires_in_s"]))
                       for e in answer["parked_now"])
        return HandoffLedger(parked, int(answer["parked_bytes"]),
                             {k: int(v) for k, v in answer["totals"].items()})

    def kv_handoff_totals(self) -> dict[str, int]:
        return dict(self.kv_handoff_totals_seen)

    async def _ask(self, header: Header, timeout_s: float) -> dict[str, Any]:
        """Send a frame the core answers on this channel (tagged with ``ping``) and wait for the answer."""
        self._ping_counter += 1
        ping_id = self._ping_counter
        answer: asyncio.Future[dict[str, Any]] = asyncio.get_running_loop().create_future()
        self._pings[ping_id] = answer
        try:
            self._send({**header, "ping": ping_id})
            return await asyncio.wait_for(answer, timeout_s)
        except TimeoutError as exc:
            raise EngineError(f"the engine core did not answer within {timeout_s} s") from exc
        finally:
            self._pings.pop(ping_id, None)

    async def aclose(self) -> None:
        self._closing = True
        if self._restart_task is not None:
            self._restart_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._restart_task
        await self._stop_core()
        self._fail_all("the engine is shutting down")

    async def _stop_core(self) -> None:
        was_alive, self._alive = self._alive, False
        if self._process is not None:  # this adapter owns its core; a shared core belongs to its supervisor
            if self._writer is not None and was_alive:
                with contextlib.suppress(ConnectionError, RuntimeError):
                    self._writer.writelines(encode_frame({"op": "shutdown"}))
                    await self._writer.drain()
            elif self._process.poll() is None:
                self._process.terminate()
            try:
                await asyncio.wait_for(asyncio.to_thread(self._process.wait), timeout=10)
            except TimeoutError:
                self._process.send_signal(signal.SIGKILL)
                await asyncio.to_thread(self._process.wait)
        if self._reader_task is not None:
            self._reader_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._reader_task
        if self._writer is not None:
            self._writer.close()
        if self._workdir is not None:
            shutil.rmtree(self._workdir, ignore_errors=True)
        self._reader_task = self._writer = None
        # A dead core's store died with it: nothing of it is parked any more.
        self.kv_store_entries = self.kv_store_bytes = 0

    async def _restart(self) -> None:
        """A core died under us: start another (the worker keeps serving once it is ready)."""
        for attempt in range(1, _MAX_RESTARTS + 1):
            await self._stop_core()
            try:
                await self._launch()
            except (EngineError, OSError) as exc:
                logger.error("engine core restart %d of %d failed: %s", attempt, _MAX_RESTARTS, exc)
                continue
            self.restarts += 1
            logger.warning("engine core restarted (pid %s)", self.core_pid)
            return
        logger.error("the engine core could not be restarted; /health stays 503")

    # -- the channel --------------------------------------------------------------------------------------
    def _send(self, header: Header, payload: bytes | memoryview = b"") -> None:
        if self._writer is None or not self._alive:
            raise EngineError("the engine core is not running")
        self._writer.writelines(encode_frame(header, payload))

    async def _read_loop(self, reader: asyncio.StreamReader) -> None:
        try:
            while True:
                header, payload = await read_frame(reader)
                op = header.get("op")
                if op == "kv_stats":
                    self.kv_store_entries, self.kv_store_bytes = int(header["entries"]), int(header["bytes"])
                    self.kv_handoff_totals_seen = {k: int(v) for k, v in (header.get("totals") or {}).items()}
                elif op in ("output", "error"):
                    request_queue = self._queues.get(str(header["id"]))
                    if request_queue is not None:
                        request_queue.put_nowait((header, payload))
                elif op in ("pong", "released", "handoffs"):
                    waiter = self._pings.get(int(header["ping"]))
                    if waiter is not None and not waiter.done():
                        waiter.set_result({k: v for k, v in header.items() if k not in ("op", "ping")})
                elif op == "fatal":
                    logger.error("engine core failed: %s", header.get("message"))
        except ChannelClosed:
            pass
        finally:
            lost = self._alive and not self._closing
            self._alive = False
            self._fail_all("the engine core went away")
            if lost:
                logger.error("the engine core went away (status %s)",
                             self._process.poll() if self._process is not None else "unknown")
                if self._process is not None and self.options.restart_dead_core:
                    self._restart_task = asyncio.get_running_loop().create_task(self._restart(),
                                                                                name="reference-core-restart")

    def _fail_all(self, message: str) -> None:
        for waiter in self._pings.values():
            if not waiter.done():
                waiter.set_exception(EngineError(message))
        for request_queue in self._queues.values():
            request_queue.put_nowait(({"op": "error", "kind": "engine", "message": message}, b""))

    # -- requests -----------------------------------------------------------------------------------------
    def generate(self, request: GenerationRequest) -> AsyncGenerator[EngineOutput, None]:
        return self._generate(request)

    async def _generate(self, request: GenerationRequest) -> AsyncGenerator[EngineOutput, None]:
        request_id = request.request_id
        outputs: asyncio.Queue[tuple[Header, bytes]] = asyncio.Queue()
        self._queues[request_id] = outputs
        finished = False
        try:
            header, payload = submit_frame(request)
            self._send(header, payload)
            while True:
                message, payload = await outputs.get()
                if message["op"] == "error":
                    finished = True
                    raise core_error(message)
                finished = bool(message.get("done"))  # the request's last frame: every sequence has finished
                yield engine_output(message, payload)
                if finished:
                    return
        finally:
            del self._queues[request_id]
            if not finished and self._alive:
                # The consumer stopped early (client gone, stop string, error): free the request in the core.
                with contextlib.suppress(EngineError, ConnectionError, RuntimeError):
                    self._send({"op": "abort", "id": request_id})

    async def abort(self, request_id: str) -> None:
        if self._alive:
            self._send({"op": "abort", "id": request_id})

    async def stop_sequence(self, request_id: str, index: int) -> None:
        if self._alive:
            self._send({"op": "stop_sequence", "id": request_id, "index": index})



def create(options: EngineOptions) -> ReferenceEngine:
    """The factory ``workers.engines.factory`` calls for ``--engine reference``."""
    return ReferenceEngine(reference_options(options))
