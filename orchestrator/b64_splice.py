"""The b64 prompt relayed as a span of CTX's answer bytes: found, never parsed, spliced into GEN's body.

At 131k tokens ``prompt_token_ids_b64`` is ~700 KB of CTX's ~700.5 KB answer. Parsed whole, orjson builds a 700 KB
``str`` from it, and encoding GEN's body copies it once more. Neither is needed: the orchestrator never reads the
value. So CTX's answer is cut in two: the span of the string's characters (a ``memoryview`` into the answer, no
copy) and the rest (~500 bytes), which is parsed as usual with the value left empty. GEN's body is encoded with the
value still empty and goes out as three chunks, ``(head, span, tail)``, never joined by the orchestrator.

Why a span found by bytes is the value and nothing else: in JSON a ``"`` inside a string is always written ``\\"``,
so the byte sequence ``"prompt_token_ids_b64":"`` can only be a key followed by the start of its string value, and
base64 has neither ``"`` nor ``\\``, so the value ends at the next ``"``. A span holding a backslash (an escaped
character: not plain base64) is left to the ordinary parse. The rest, once parsed, must have the key at the top
level with the empty value, or the cut is not used. A CTX that writes the key with spaces (``": "``) is parsed
whole, as before.
"""

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
