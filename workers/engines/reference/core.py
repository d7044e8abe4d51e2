"""The reference engine core: its own process, so no HTTP event loop ever blocks on the model.

It serves one or more front ends (``--api-workers``) over a Unix socket; reader threads queue incoming frames, so a
long prefill chunk never stalls a socket, and the main thread alternates between that queue and scheduler steps.

    python -m workers.engines.reference.core --listen PATH [--model GGUF] [options]"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import queue
import resource
import signal
import socket
import sys
import threading
import time

import numpy as np

from frontend import tracing
from frontend.sampling import SamplingParams
from frontend.token_codec import TOKEN_DTYPE
from workers.engines.options import KV_LOAD_FAILURE_POLICIES
from workers.engines.reference.core_tracing import SERVICE_NAME, CoreSpans
from workers.engines.reference.grammar import GrammarCompiler
from workers.engines.reference.ipc import ChannelClosed, Header, read_frame_blocking, send_frame_blocking
from workers.engines.reference.kv_store import KVStore, KVTransferServer
from workers.engines.reference.model_file import load_model_file
from workers.engines.reference.prefix_cache import capacity_tokens
from workers.engines.reference.sampler import check_sampling
from workers.engines.reference.scheduler import Scheduler, SchedulerConfig
from workers.engines.reference.sequences import SubmitSpec
from workers.engines.reference.tokenizer import GGUFTokenizer
from workers.engines.reference.transformer import Transformer

logger = logging.getLogger("disagg_serve.reference_core")

_IDLE_WAIT_S = 0.5
_EXPIRY_EVERY_S = 1.0

Inbound = tuple[int, Header, bytes]  # (channel id, header, payload); header {"op": "closed"} when one goes


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description="reference engine core (started by the worker)")
    parser.add_argument("--listen", required=True, help="Unix socket path the front ends connect to")
    parser.add_argument("--model", default=None)
    parser.add_argument("--kv-host", default="127.0.0.1", help="address the KV transfer server binds")
    parser.add_argument("--kv-port", type=int, default=0)
    parser.add_argument("--kv-advertise-host", default=None, help="host GEN workers use to reach this one")
    parser.add_argument("--kv-store-bytes", type=int, default=4 * 1024**3)
    parser.add_argument("--kv-ttl-s", type=float, default=120.0)
    parser.add_argument("--prefill-chunk", type=int, default=512)
    parser.add_argument("--no-prompt-tokens-in-handoff", action="store_true")
    parser.add_argument("--prefix-cache-bytes", type=int, default=0, help="KV block reuse budget; 0 = off")
    parser.add_argument("--kv-load-failure-policy", choices=KV_LOAD_FAILURE_POLICIES, default="fail",
                        help="GEN, when the hand-off's KV cannot be fetched: fail the request, or recompute the prompt")
    return parser


class Channel:
    def __init__(self, channel_id: int, sock: socket.socket) -> None:
        self.id = channel_id
        self.sock = sock
        self.lock = threading.Lock()
        self.open = True

    def send(self, header: Header, payload: bytes | memoryview = b"") -> None:
        if not self.open:
            return
        try:
            with self.lock:
                send_frame_blocking(self.sock, header, payload)
        except OSError:
            self.open = False  # its reader thread reports the close


class Core:
    def __init__(self, args: argparse.Namespace, listener: socket.socket) -> None:
        self.args = args
        self.listener = listener
        self.inbox: queue.Queue[Inbound] = queue.Queue()
        self.channels: dict[int, Channel] = {}
        self.channels_lock = threading.Lock()
        self.owner_of: dict[str, int] = {}  # request id -> channel id
        # Request ids whose abort a reader thread has seen and the main loop has not handled yet: the scheduler
        # reads it within every layer, so an abort cuts a long prefill chunk short instead of waiting it out, and
        # the loop reads it at a submit, so a request abandoned before the core got to it is never queued.
        self.aborts_pending: set[str] = set()
        self.ready_frame: Header | None = None
        self.stopping = threading.Event()
        self.spans = CoreSpans()

    # -- channels -----------------------------------------------------------------------------------------
    def _accept_loop(self) -> None:
        next_id = 0
        while not self.stopping.is_set():
            try:
                sock, _ = self.listener.accept()
            except OSError:
                return
            next_id += 1
            channel = Channel(next_id, sock)
            with self.channels_lock:
                self.channels[channel.id] = channel
                if self.ready_frame is not None:
                    channel.send(self.ready_frame)
            threading.Thread(target=self._read_loop, args=(channel,), name=f"ipc-reader-{channel.id}",
                             daemon=True).start()

    def _read_loop(self, channel: Channel) -> None:
        try:
            while True:
                header, payload = read_frame_blocking(channel.sock)
                if not isinstance(header, dict):
                    raise ChannelClosed("a frame header must be a JSON object")
                if header.get("op") == "abort":
                    self.aborts_pending.add(str(header.get("id")))
                self.inbox.put((channel.id, header, payload))
        except (ChannelClosed, OSError, ValueError) as exc:
            # A closed socket, or a peer that breaks the framing (not JSON, not an object): either way this
            # channel is done, and only this one. orjson's decode error is a ValueError.
            if not isinstance(exc, ChannelClosed | ConnectionError):
                logger.warning("closing engine channel %d: %s", channel.id, exc)
            channel.open = False
            with contextlib.suppress(OSError):
                channel.sock.shutdown(socket.SHUT_RDWR)
            # Everything this front end ran has no one to answer to: stop it at the next layer too.
            self.aborts_pending.update(rid for rid, owner in list(self.owner_of.items()) if owner == channel.id)
            self.inbox.put((channel.id, {"op": "closed"}, b""))

    def emit(self, header: Header, payload: bytes | memoryview = b"") -> None:
        """Scheduler output: to the channel that submitted the request."""
        request_id = str(header.get("id"))
        channel = self.channels.get(self.owner_of.get(request_id, -1))
        if channel is not None:
            channel.send(header, payload)
        self.spans.answered(header)
        if header.get("op") == "error" or header.get("done"):  # the request's last frame
            self.owner_of.pop(request_id, None)

    def broadcast(self, header: Header) -> None:
        with self.channels_lock:
            channels = list(self.channels.values())
        for channel in channels:
            channel.send(header)

    # -- run ----------------------------------------------------------------------------------------------
    def run(self) -> int:
        threading.Thread(target=self._accept_loop, name="ipc-accept", daemon=True).start()
        started = time.perf_counter()
        loaded = load_model_file(self.args.model)
        model = Transformer(loaded.weights)
        tokenizer = GGUFTokenizer(loaded.tokenizer)
        load_s = time.perf_counter() - started
        rss_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
        store = KVStore(self.args.kv_store_bytes, self.args.kv_ttl_s)
        self.spans.store = store
        store.on_change = lambda entries, size: self.broadcast(
            {"op": "kv_stats", "entries": entries, "bytes": size, "totals": dict(store.totals)})
        transfer = KVTransferServer(store, self.args.kv_host, self.args.kv_port)
        transfer.start()
        advertise = self.args.kv_advertise_host or self.args.kv_host
        if advertise in ("0.0.0.0", "::", ""):
            advertise = socket.gethostbyname(socket.gethostname())
        config = SchedulerConfig(
            model_hash=loaded.model_hash,
            eos_token_ids=tokenizer.eos_token_ids,
            prefill_chunk=self.args.prefill_chunk,
            prompt_tokens_in_handoff=not self.args.no_prompt_tokens_in_handoff,
            kv_url_base=f"http://{f'[{advertise}]' if ':' in advertise else advertise}:{transfer.port}",
            prefix_cache_bytes=self.args.prefix_cache_bytes,
            kv_load_failure=self.args.kv_load_failure_policy,
        )
        scheduler = Scheduler(model, config, store, self.emit,
                              wake=lambda: self.inbox.put((0, {"op": "wake"}, b"")),
                              abort_pending=self.aborts_pending.__contains__,
                              grammars=GrammarCompiler(tokenizer, loaded.config.vocab_size))
        meta = loaded.tokenizer
        logger.info("model %s loaded in %.1f s, RSS %.0f MB; KV transfer on %s", loaded.path.name, load_s, rss_mb,
                    config.kv_url_base)
        with self.channels_lock:
            self.ready_frame = {
                "op": "ready",
                "model_path": str(loaded.path),
                "model_hash": loaded.model_hash,
                "vocab_size": loaded.config.vocab_size,
                "context_length": loaded.config.context_length,
                "load_s": round(load_s, 2),
                "rss_mb": round(rss_mb, 1),
                "prompt_tokens_in_handoff": config.prompt_tokens_in_handoff,
                # KV block reuse: tokens of prompt KV the prefix cache holds (0: reuse is off)
                "prefix_cache_tokens": capacity_tokens(config.prefix_cache_bytes, loaded.config),
                "tokenizer": {
                    "model": meta.model, "pre": meta.pre, "tokens": list(meta.tokens), "merges": list(meta.merges),
                    "token_types": list(meta.token_types), "bos_token_id": meta.bos_token_id,
                    "eos_token_id": meta.eos_token_id, "chat_template": meta.chat_template,
                },
            }
            for channel in self.channels.values():
                channel.send(self.ready_frame)
        try:
            self._serve(scheduler, store)
        finally:
            scheduler.close()
            transfer.stop()
        return 0

    def _serve(self, scheduler: Scheduler, store: KVStore) -> None:
        next_expiry = time.monotonic() + _EXPIRY_EVERY_S
        while self._drain_inbox(scheduler, block=not scheduler.busy):
            if time.monotonic() >= next_expiry:
                store.expire()
                next_expiry = time.monotonic() + _EXPIRY_EVERY_S
            if scheduler.busy:
                scheduler.step()

    def _drain_inbox(self, scheduler: Scheduler, block: bool) -> bool:
        """Handle every frame waiting (waiting a little for one when idle); False when the core must stop."""
        try:
            item = self.inbox.get(timeout=_IDLE_WAIT_S) if block else self.inbox.get_nowait()
        except queue.Empty:
            return not self.stopping.is_set()
        while True:
            if not self._handle(scheduler, *item):
                return False
            try:
                item = self.inbox.get_nowait()
            except queue.Empty:
                return not self.stopping.is_set()

    def _handle(self, scheduler: Scheduler, channel_id: int, header: Header, payload: bytes) -> bool:
        try:
            return self._dispatch(scheduler, channel_id, header, payload)
        except (KeyError, TypeError, ValueError) as exc:  # a malformed frame must not take the shared core down
            logger.warning("ignoring a malformed %r frame on channel %d: %s", header.get("op"), channel_id, exc)
            return True

    def _dispatch(self, scheduler: Scheduler, channel_id: int, header: Header, payload: bytes) -> bool:
        op = header.get("op")
        channel = self.channels.get(channel_id)
        if op == "submit":
            request_id = str(header.get("id"))
            if request_id in self.aborts_pending or channel is None or not channel.open:
                # Abandoned while its submit waited in the inbox (behind a prefill chunk, say): never queued, no
                # KV, nothing answered; its abort frame (or the channel's close), handled next, finds nothing.
                return True
            self.owner_of[request_id] = channel_id
            self.spans.submitted(header)
            try:
                scheduler.submit(_submit_spec(header, payload))
            except (KeyError, TypeError, ValueError) as exc:  # a malformed submit fails that request only
                self.emit({"op": "error", "id": request_id, "kind": "request",
                           "message": f"bad submit frame: {type(exc).__name__}: {exc}"})
        elif op == "abort":
            scheduler.abort(str(header["id"]))
            self.spans.forget(str(header["id"]))
            self.owner_of.pop(str(header["id"]), None)
            self.aborts_pending.discard(str(header["id"]))
        elif op == "stop_sequence":
            scheduler.stop_sequence(str(header["id"]), int(header["index"]))
        elif op == "release":
            released = scheduler.store.discard_with_key(str(header["id"]), str(header.get("key", "")))
            if channel is not None:
                channel.send({"op": "released", "ping": header.get("ping", 0), "released": released})
        elif op == "handoffs" and channel is not None:
            channel.send({"op": "handoffs", "ping": header.get("ping", 0), **scheduler.store.ledger()})
        elif op == "ping" and channel is not None:
            channel.send({"op": "pong", "ping": header.get("ping", 0), **scheduler.stats()})
        elif op == "wake":
            pass  # a KV fetch finished: the next step admits it
        elif op == "closed":
            self._drop_channel(scheduler, channel_id)
        elif op == "shutdown":
            return False
        else:
            logger.warning("unknown frame op %r", op)
        return True

    def _drop_channel(self, scheduler: Scheduler, channel_id: int) -> None:
        # A front end went away: whatever it was running has no one to answer to.
        with self.channels_lock:
            channel = self.channels.pop(channel_id, None)
        if channel is not None:
            with contextlib.suppress(OSError):
                channel.sock.close()
        for request_id, owner in list(self.owner_of.items()):
            if owner == channel_id:
                scheduler.abort(request_id)
                del self.owner_of[request_id]
                self.aborts_pending.discard(request_id)


def _submit_spec(header: Header, payload: bytes) -> SubmitSpec:
    prompt_len = int(header["prompt_len"])
    placeholder = bool(header.get("placeholder"))
    # A placeholder is rebuilt from its length; real tokens are the raw int32 buffer as it crossed the socket.
    prompt = np.full(prompt_len, 0, dtype=TOKEN_DTYPE) if placeholder else np.frombuffer(payload, TOKEN_DTYPE)
    sampling = SamplingParams.from_wire(header["sampling"])
    check_sampling(sampling)
    if sampling.max_tokens is None:
        raise ValueError("max_tokens must be resolved before the core sees a request")
    state = header.get("handoff_state")
    more_starts = tuple(tuple(int(t) for t in start) for start in header.get("more_first_gen_tokens") or ())
    if state is not None and (len(more_starts) + 1 != sampling.n or not all(more_starts)):
        raise ValueError(f"a hand-off for n={sampling.n} needs a non-empty start for every sequence")
    return SubmitSpec(
        request_id=str(header["id"]),
        phase=str(header["phase"]),
        prompt=prompt,
        placeholder=placeholder,
        max_tokens=sampling.max_tokens,
        sampling=sampling,
        first_gen_tokens=tuple(int(t) for t in header.get("first_gen_tokens") or ()),
        handoff_state=state.encode() if isinstance(state, str) else None,
        more_first_gen_tokens=more_starts,
    )


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level="INFO", format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    tracing.configure(SERVICE_NAME, "engine-core")  # on only when the worker's environment names an endpoint
    with contextlib.suppress(FileNotFoundError):
        os.unlink(args.listen)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(args.listen)
    listener.listen(64)
    core = Core(args, listener)
    # SIGTERM (from a supervisor, or PR_SET_PDEATHSIG when the front end dies) ends the loop cleanly.
    def on_sigterm(_signum: int, _frame: object) -> None:
        core.stopping.set()
        core.inbox.put((0, {"op": "shutdown"}, b""))

    signal.signal(signal.SIGTERM, on_sigterm)
    try:
        return core.run()
    except Exception as exc:
        logger.exception("engine core failed")
        core.broadcast({"op": "fatal", "message": f"{type(exc).__name__}: {exc}"})
        # A front end that connects after the failure still needs to hear why.
        with core.channels_lock:
            core.ready_frame = {"op": "fatal", "message": f"{type(exc).__name__}: {exc}"}
        time.sleep(0.5)
        return 1
    finally:
        core.stopping.set()
        listener.close()
        tracing.shutdown()  # export the last spans before the process goes
        with contextlib.suppress(FileNotFoundError):
            os.unlink(args.listen)


if __name__ == "__main__":
    sys.exit(main())
