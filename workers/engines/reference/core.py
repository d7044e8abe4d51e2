"""The reference engine core: its own process, so the HTTP event loop never blocks on the model.

It connects to the front end's Unix socket, loads the model, announces itself with a ``ready`` frame (model
facts, tokenizer vocabulary, load time, memory), then alternates between reading frames and scheduler steps.
A reader thread moves incoming frames onto a queue, so a long prefill chunk never stalls the socket.

    python -m workers.engines.reference.core --socket PATH [--model GGUF] [options]
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import queue
import resource
import socket
import sys
import threading
import time
from typing import Any

import numpy as np

from frontend.token_codec import TOKEN_DTYPE
from workers.engines.reference.ipc import ChannelClosed, Header, read_frame_blocking, send_frame_blocking
from workers.engines.reference.kv_store import KVStore, KVTransferServer
from workers.engines.reference.model_file import load_model_file
from workers.engines.reference.sampler import SamplingConfig
from workers.engines.reference.scheduler import Scheduler, SchedulerConfig, SubmitSpec
from workers.engines.reference.tokenizer import GGUFTokenizer
from workers.engines.reference.transformer import Transformer

logger = logging.getLogger("disagg_serve.reference_core")

_IDLE_WAIT_S = 0.5
_EXPIRY_EVERY_S = 1.0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description="reference engine core (started by the worker)")
    parser.add_argument("--socket", required=True)
    parser.add_argument("--model", default=None)
    parser.add_argument("--kv-host", default="127.0.0.1", help="address the KV transfer server binds")
    parser.add_argument("--kv-port", type=int, default=0)
    parser.add_argument("--kv-advertise-host", default=None, help="host GEN workers use to reach this one")
    parser.add_argument("--kv-store-bytes", type=int, default=4 * 1024**3)
    parser.add_argument("--kv-ttl-s", type=float, default=120.0)
    parser.add_argument("--prefill-chunk", type=int, default=512)
    parser.add_argument("--no-prompt-tokens-in-handoff", action="store_true")
    parser.add_argument("--prefix-cache-bytes", type=int, default=0, help="KV block reuse budget; 0 = off")
    return parser


class Core:
    def __init__(self, args: argparse.Namespace, channel: socket.socket) -> None:
        self.args = args
        self.channel = channel
        self.send_lock = threading.Lock()
        self.inbox: queue.Queue[tuple[Header, bytes] | None] = queue.Queue()

    def send(self, header: Header, payload: bytes | memoryview = b"") -> None:
        with self.send_lock:
            send_frame_blocking(self.channel, header, payload)

    def _read_loop(self) -> None:
        try:
            while True:
                self.inbox.put(read_frame_blocking(self.channel))
        except (ChannelClosed, OSError):
            self.inbox.put(None)  # the front end is gone: shut down

    def run(self) -> int:
        started = time.perf_counter()
        loaded = load_model_file(self.args.model)
        model = Transformer(loaded.weights)
        tokenizer = GGUFTokenizer(loaded.tokenizer)
        load_s = time.perf_counter() - started
        rss_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
        store = KVStore(self.args.kv_store_bytes, self.args.kv_ttl_s)
        store.on_change = lambda entries, size: self.send({"op": "kv_stats", "entries": entries, "bytes": size})
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
            kv_url_base=f"http://{advertise}:{transfer.port}",
            prefix_cache_bytes=self.args.prefix_cache_bytes,
        )
        scheduler = Scheduler(model, config, store, self.send)
        meta = loaded.tokenizer
        self.send({
            "op": "ready",
            "model_path": str(loaded.path),
            "model_hash": loaded.model_hash,
            "vocab_size": loaded.config.vocab_size,
            "context_length": loaded.config.context_length,
            "load_s": round(load_s, 2),
            "rss_mb": round(rss_mb, 1),
            "prompt_tokens_in_handoff": config.prompt_tokens_in_handoff,
            "tokenizer": {
                "model": meta.model, "pre": meta.pre, "tokens": list(meta.tokens), "merges": list(meta.merges),
                "token_types": list(meta.token_types), "bos_token_id": meta.bos_token_id,
                "eos_token_id": meta.eos_token_id, "chat_template": meta.chat_template,
            },
        })
        threading.Thread(target=self._read_loop, name="ipc-reader", daemon=True).start()
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
            return True
        while True:
            if item is None or item[0].get("op") == "shutdown":
                return False
            self._handle(scheduler, *item)
            try:
                item = self.inbox.get_nowait()
            except queue.Empty:
                return True

    def _handle(self, scheduler: Scheduler, header: Header, payload: bytes) -> None:
        op = header.get("op")
        if op == "abort":
            scheduler.abort(str(header["id"]))
        elif op == "submit":
            try:
                scheduler.submit(_submit_spec(header, payload))
            except (KeyError, TypeError, ValueError) as exc:  # a malformed submit fails that request only
                self.send({"op": "error", "id": header.get("id"), "kind": "engine",
                           "message": f"bad submit frame: {type(exc).__name__}: {exc}"})
        elif op == "ping":
            self.send({"op": "pong", "ping": header.get("ping", 0), **scheduler.stats()})
        else:
            logger.warning("unknown frame op %r", op)


def _submit_spec(header: Header, payload: bytes) -> SubmitSpec:
    prompt_len = int(header["prompt_len"])
    placeholder = bool(header.get("placeholder"))
    # A placeholder is rebuilt from its length; real tokens are the raw int32 buffer as it crossed the socket.
    prompt = np.full(prompt_len, 0, dtype=TOKEN_DTYPE) if placeholder else np.frombuffer(payload, TOKEN_DTYPE)
    s: dict[str, Any] = header["sampling"]
    state = header.get("handoff_state")
    return SubmitSpec(
        request_id=str(header["id"]),
        phase=str(header["phase"]),
        prompt=prompt,
        placeholder=placeholder,
        max_tokens=int(s["max_tokens"]),
        sampling=SamplingConfig(
            temperature=s["temperature"], top_p=s["top_p"], top_k=s["top_k"], seed=s["seed"],
            frequency_penalty=s["frequency_penalty"], presence_penalty=s["presence_penalty"],
            repetition_penalty=s["repetition_penalty"], logprobs=s["logprobs"],
        ),
        ignore_eos=bool(s["ignore_eos"]),
        logit_bias=tuple((int(t), float(b)) for t, b in s["logit_bias"]),
        prompt_logprobs=s["prompt_logprobs"],
        first_gen_tokens=tuple(int(t) for t in header.get("first_gen_tokens") or ()),
        handoff_state=state.encode() if isinstance(state, str) else None,
        reads_prompt_values=bool(header.get("reads_prompt_values")),
        echo=bool(s.get("echo")),
    )


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level="INFO", format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    channel = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    channel.connect(args.socket)
    try:
        return Core(args, channel).run()
    except Exception as exc:
        logger.exception("engine core failed")
        with contextlib.suppress(OSError):
            send_frame_blocking(channel, {"op": "fatal", "message": f"{type(exc).__name__}: {exc}"})
        return 1
    finally:
        channel.close()


if __name__ == "__main__":
    sys.exit(main())
