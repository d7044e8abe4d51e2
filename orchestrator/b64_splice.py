"""The b64 prompt relayed as a span of CTX's answer bytes: found, never parsed, spliced into GEN's body.

The span found by bytes can only be the value: a ``"`` inside a JSON string is always written ``\\"``, so
``"prompt_token_ids_b64":"`` opens that key's value, and base64 holds neither ``"`` nor ``\\``, so the value ends at
the next ``"``. A span with a backslash, a key written with spaces, or a rest whose top level lacks the emptied key
is parsed whole."""

from __future__ import annotations

from typing import Any

import orjson

from orchestrator.client_body import encode
from orchestrator.upstream.base import Body

FIELD = "prompt_token_ids_b64"
_KEY = b'"' + FIELD.encode() + b'":"'
_EMPTY_LAST = b'"' + FIELD.encode() + b'":""}'


def cut_b64_span(content: bytes) -> tuple[bytes, memoryview] | None:
    """CTX's answer without the b64 string's characters (the value left as ``""``), and those characters as a
    view of ``content``; None if the answer has no such span (then parse it whole)."""
    key_at = content.find(_KEY)
    if key_at < 0:
        return None
    start = key_at + len(_KEY)
    end = content.find(b'"', start)
    if end < 0 or content.find(b"\\", start, end) >= 0:
        return None
    return content[:start] + content[end:], memoryview(content)[start:end]


def splice_b64_span(encoded: Body, span: memoryview) -> Body:
    """GEN's body ``encoded`` (bytes, or chunks: a client's long prompt kept as its literal) with
    ``"prompt_token_ids_b64":""`` as its last member, as chunks that put ``span`` between the quotes."""
    front, last = ((), encoded) if isinstance(encoded, bytes) else (encoded[:-1], encoded[-1])
    if not (isinstance(last, bytes) and last.endswith(_EMPTY_LAST)):
        raise ValueError(f"the body must end with an empty {FIELD}")
    return *front, last[:-2], span, last[-2:]


def encode_with_b64(gen_body: dict[str, Any], b64: str | memoryview) -> Body:
    """``gen_body`` encoded with ``prompt_token_ids_b64`` as its last member: a span of CTX's bytes goes in as a
    chunk of its own (never joined), a ``str`` (an answer parsed whole) as the same object CTX's answer held."""
    gen_body.pop(FIELD, None)  # so that it is the last member, where a splice puts the span
    if isinstance(b64, memoryview):
        gen_body[FIELD] = ""
        return splice_b64_span(encode(gen_body), b64)
    gen_body[FIELD] = b64
    return encode(gen_body)


def parse_with_b64_span(content: bytes) -> tuple[Any, memoryview | None]:
    """CTX's answer parsed, and the b64 span cut out of it (the parsed value then ``""``), or None when the answer
    has none at its top level (then it was parsed whole). Raises ``orjson.JSONDecodeError``."""
    cut = cut_b64_span(content)
    if cut is not None:
        rest, span = cut
        parsed = orjson.loads(rest)
        if isinstance(parsed, dict) and parsed.get(FIELD) == "":
            return parsed, span
    return orjson.loads(content), None
