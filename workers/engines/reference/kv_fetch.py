"""GEN's side of the hand-off: fetch the KV from CTX's transfer server and import it, in a worker thread."""

from __future__ import annotations

import urllib.error
import urllib.request
from dataclasses import dataclass

import orjson

from workers.engines.reference.kv_handoff import HandoffFormatError, KVHandoff, decode_handoff
from workers.engines.reference.kv_store import KV_KEY_HEADER
from workers.engines.reference.model_file import ModelConfig
from workers.engines.reference.transformer import KVCache, import_kv

FETCH_TIMEOUT_S = 60.0


class HandoffUnavailable(Exception):
    """The hand-off cannot be used: unknown, expired, replayed, tampered or mismatched. The message says which."""


class HandoffUnreachable(HandoffUnavailable):
    """CTX's KV transfer server could not be reached: an upstream failure, not a bad request."""


@dataclass(frozen=True, slots=True)
class FetchedHandoff:
    handoff: KVHandoff
    cache: KVCache
    nbytes: int = 0  # as fetched over the wire: reported in the core's traces


def parse_state(state: bytes) -> dict[str, object]:
    try:
        parsed = orjson.loads(state)
        if not isinstance(parsed, dict) or not {"kv_url", "key", "model_hash", "n_tokens"} <= parsed.keys():
            raise ValueError
    except (orjson.JSONDecodeError, ValueError) as exc:
        raise HandoffUnavailable("encoded_opaque_state is not a reference-engine hand-off") from exc
    return parsed


def fetch_handoff(state: bytes, config: ModelConfig, model_hash: str, prompt_len: int) -> FetchedHandoff:
    parsed = parse_state(state)
    if parsed["model_hash"] != model_hash:
        raise HandoffUnavailable("the hand-off comes from a different model (model hash mismatch)")
    if parsed["n_tokens"] != prompt_len:
        raise HandoffUnavailable(
            f"the hand-off holds {parsed['n_tokens']} tokens but the request's prompt has {prompt_len}"
        )
    url = str(parsed["kv_url"])
    if not url.startswith(("http://", "https://")):
        raise HandoffUnavailable("the hand-off's KV address is not an http(s) URL")
    request = urllib.request.Request(url, headers={KV_KEY_HEADER: str(parsed["key"])})
    try:
        with urllib.request.urlopen(request, timeout=FETCH_TIMEOUT_S) as response:
            data = response.read()
    except urllib.error.HTTPError as exc:
        detail = exc.read().decode(errors="replace")
        raise HandoffUnavailable(f"CTX refused the KV fetch ({exc.code}): {detail}") from exc
    except (urllib.error.URLError, OSError) as exc:
        raise HandoffUnreachable(f"the KV fetch from {url} failed: {exc}") from exc
    try:
        handoff = decode_handoff(
            data, model_hash=model_hash, rope_base=config.rope_base, layers=config.n_layers,
            kv_heads=config.n_kv_heads, head_dim=config.head_dim, expected_tokens=prompt_len,
        )
    except HandoffFormatError as exc:
        raise HandoffUnavailable(f"the KV hand-off was refused: {exc}") from exc
    return FetchedHandoff(handoff, import_kv(handoff.k, handoff.v, config, capacity=prompt_len + 64), len(data))
