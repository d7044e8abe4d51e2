"""The client's body with its long prompt strings kept as the JSON bytes they came in: found without parsing,
written back verbatim, and parsed whole whenever anything is off."""

from __future__ import annotations

import json
import re
from typing import Any

import numpy as np
import orjson
import pytest
from hypothesis import given
from hypothesis import strategies as st

from frontend.errors import InvalidRequestError
from frontend.http import parse_json_object
from orchestrator.b64_splice import splice_b64_span
from orchestrator.client_body import (
    MIN_BODY,
    MIN_LITERAL,
    RawText,
    _GiveUp,
    _long_prompt_literals,
    _Walk,
    encode,
    parse_client_body,
)
from orchestrator.protocols.base import WorkerProtocol
from orchestrator.protocols.native import NativeProtocol
from orchestrator.protocols.trtllm.wire import TrtllmProtocol
from orchestrator.protocols.vllm import VllmProtocol
from orchestrator.routers import routing_key
from orchestrator.upstream.base import body_bytes

# Characters that make a JSON string hard: quotes, backslashes (alone and in runs), controls, non-ASCII of every
# UTF-8 width, an astral character (a surrogate pair when escaped).
TRICKY = st.lists(st.sampled_from(['"', "\\", "\\" * 5 + '"', "\n", "\t", "\x01", "/", "a", " ", "é", "中", "😀"]),
                  max_size=200).map("".join)
FILLER = "words and spaces " * (MIN_BODY // 17 + 1)  # long enough for a body to be looked at


def long_text(core: str) -> str:
    return core + FILLER + core  # the tricky part at both ends: the prefix and the closing quote see it


def raw_texts(value: Any) -> list[RawText]:
    if isinstance(value, RawText):
        return [value]
    if isinstance(value, dict):
        return [t for v in value.values() for t in raw_texts(v)]
    if isinstance(value, list):
        return [t for v in value for t in raw_texts(v)]
    return []


def longest_str(value: Any) -> int:
    if isinstance(value, str):
        return len(value)
    if isinstance(value, dict):
        return max((longest_str(v) for v in value.values()), default=0)
    if isinstance(value, list):
        return max((longest_str(v) for v in value), default=0)
    return 0


def bodies(text: str) -> dict[str, dict[str, Any]]:
    return {
        "completion": {"model": "m", "prompt": text, "max_tokens": 3, "stream": True},
        "chat": {"model": "m", "messages": [{"role": "system", "content": "Be brief."},
                                            {"role": "user", "content": text},
                                            {"role": "assistant", "content": None},
                                            {"role": "user", "content": text[::-1]}]},
        "content parts": {"model": "m", "messages": [{"role": "user", "content": [
            {"type": "text", "text": text}, {"type": "image_url", "image_url": {"url": "data:,x"}}]}]},
    }


@given(core=TRICKY, ensure_ascii=st.booleans(), spaced=st.booleans(), shape=st.sampled_from(list(bodies("x"))))
def test_long_prompts_stay_the_clients_bytes_and_encode_back_to_the_same_json(
    core: str, ensure_ascii: bool, spaced: bool, shape: str
) -> None:
    value = bodies(long_text(core))[shape]
    raw = json.dumps(value, ensure_ascii=ensure_ascii, separators=(", ", ": ") if spaced else (",", ":")).encode()
    parsed = parse_client_body(raw)
    texts = raw_texts(parsed)
    if longest_backslash_run(raw) > 8:  # the walk gives up on those: parsed whole
        assert parsed == orjson.loads(raw) and not texts
        return
    assert texts, "every long prompt string is kept as its literal"
    assert longest_str(parsed) < MIN_LITERAL  # no long str was built
    for text in texts:
        assert text.literal.obj is raw  # a view of the very bytes the client sent
        decoded = orjson.loads(text.literal)
        for chars in (1, 5, 17, 1024):
            assert text.prefix(chars) == decoded[:chars]
    assert orjson.loads(body_bytes(encode(parsed))) == orjson.loads(raw)


def test_a_compact_body_encodes_back_byte_for_byte() -> None:
    raw = orjson.dumps({"model": "m", "prompt": long_text('"quoted"\n\\'), "max_tokens": 8, "stream": True})
    parsed = parse_client_body(raw)
    assert isinstance(parsed["prompt"], RawText)
    assert body_bytes(encode(parsed)) == raw


def test_the_routing_key_reads_a_kept_literal_as_the_parsed_text() -> None:
    raw = orjson.dumps({"model": "m", "messages": [{"role": "user", "content": "short one"},
                                                   {"role": "user", "content": long_text("é\n" * 600)}]})
    kept, whole = parse_client_body(raw), parse_json_object(raw)
    for prefix_chars in (4, 1024):
        assert routing_key(kept, prefix_chars).prompt_prefix == routing_key(whole, prefix_chars).prompt_prefix
    # The size is counted in bytes: each 'é' is 2 of them, each '\n' 2 ('\' and 'n'), 1,200 of each.
    assert routing_key(kept, 1024).prompt_tokens == (len("short one") + len(long_text("é\n" * 600)) + 2400) // 4 + 1


def test_a_prefix_cut_from_text_the_worker_will_refuse_is_still_a_key() -> None:
    text = RawText(memoryview(b'"bad \\x escape' + b"a" * MIN_LITERAL + b'"'))
    assert text.prefix(4) == "bad "


@pytest.mark.parametrize("value", [
    {"model": "m", "prompt": FILLER[: MIN_BODY // 2]},  # a body too short to look at
    {"model": "m", "prompt": "short", "user": FILLER},  # the long string is not a prompt
    {"model": "m", "metadata": {"prompt": FILLER}},  # a prompt key, not at a prompt position
    {"model": "m", "prompt": [FILLER, FILLER]},  # a list of prompts: their strings are not members' values
    {"model": "m", "prompt": "short", "messages": [{"role": "user", "content": "x"}] * 20_000},  # many strings
])
def test_bodies_without_a_long_prompt_at_a_prompt_position_are_parsed_whole(value: dict[str, Any]) -> None:
    raw = orjson.dumps(value)
    parsed = parse_client_body(raw)
    assert parsed == value and not raw_texts(parsed)


def test_a_repeated_key_means_what_the_full_parse_says() -> None:
    raw = b'{"model":"m","prompt":"' + FILLER.encode() + b'","prompt":"the last one"}'
    assert parse_client_body(raw) == {"model": "m", "prompt": "the last one"}


def test_a_client_cannot_forge_the_marker() -> None:
    forged = "\x00disagg-raw-text:0000000000000000:0"
    value = {"model": "m", "messages": [{"role": "user", "content": forged},
                                        {"role": "user", "content": FILLER}]}
    parsed = parse_client_body(orjson.dumps(value))
    assert parsed["messages"][0]["content"] == forged
    assert isinstance(parsed["messages"][1]["content"], RawText)


@pytest.mark.parametrize(("raw", "message"), [
    (b'{"model":"m","prompt":"' + b"a" * MIN_BODY, "not valid JSON"),  # unterminated
    (b'{"model":"m","prompt":"' + b"a" * MIN_BODY + b'"', "not valid JSON"),  # no closing brace
    (b'{"model":"m","prompt":"' + b"a" * MIN_BODY + b'"} trailing', "not valid JSON"),
    (b'{"model":"m" "prompt":"' + b"a" * MIN_BODY + b'"}', "not valid JSON"),  # a comma missing outside the text
    (b'[{"prompt":"' + b"a" * MIN_BODY + b'"}]', "must be a JSON object"),
])
def test_a_broken_body_gets_the_full_parses_error(raw: bytes, message: str) -> None:
    with pytest.raises(InvalidRequestError, match=message):
        parse_client_body(raw)


def test_text_inside_a_kept_literal_is_left_to_the_worker() -> None:
    # Invalid UTF-8 in the text is not looked at here; the worker that parses it answers 400 (tests of the
    # orchestrator's HTTP surface check that answer).
    raw = b'{"model":"m","prompt":"\xff' + b"a" * MIN_BODY + b'"}'
    parsed = parse_client_body(raw)
    assert isinstance(parsed["prompt"], RawText)
    assert body_bytes(encode(parsed)) == raw


def reference_closing_quote(literal: bytes, at: int) -> int:
    """A character-by-character scan: an escape takes two bytes."""
    while at < len(literal):
        if literal[at] == ord("\\"):
            at += 2
        elif literal[at] == ord('"'):
            return at
        else:
            at += 1
    return -1


def longest_backslash_run(data: bytes) -> int:
    """The longest run of backslashes just before a quote."""
    return max((len(run) for run in re.findall(rb'\\+(?=")', data)), default=0)


@given(st.lists(st.sampled_from(["a", "\\", '"', '\\"', "\\\\", "\\" * 7 + '"', "\\" * 9 + '"']), max_size=80),
       st.integers(min_value=0, max_value=3))
def test_both_ways_to_find_the_closing_quote_agree_with_a_scan_or_give_up(pieces: list[str], filler_kib: int) -> None:
    literal = b'"' + "".join(pieces).encode() + b"x" * (filler_kib * 40_000) + b'"'
    expected = reference_closing_quote(literal, 1)
    for numpy in (False, True):
        walk = _Walk(literal)
        try:
            found = walk.closing_quote_by_numpy(0, 1) if numpy else walk.closing_quote(0)
        except _GiveUp:
            # Only where the body is better parsed whole: unterminated, or a run of backslashes longer than 8.
            assert expected < 0 or longest_backslash_run(literal[:expected + 1]) > 8
        else:
            assert found == expected


def test_a_backslash_run_across_a_numpy_window_is_counted_from_the_literals_start() -> None:
    # 16 escaped quotes send the walk to numpy, whose first window (4 KiB) ends inside the last run of three
    # backslashes: that quote is escaped, the string never ends, and the body is not JSON.
    literal = b'"' + b'\\"' * 16 + b"A" * 4094 + b'\\\\\\"'
    raw = b'{"prompt":' + literal + b',"model":"m"}'
    with pytest.raises(orjson.JSONDecodeError):
        orjson.loads(raw)
    with pytest.raises(InvalidRequestError, match="not valid JSON"):
        parse_client_body(raw + b" " * MIN_BODY)


@pytest.mark.parametrize("literal", [
    b'"' + b"\\" * 10 + b'"',  # long backslash runs: each would need an exact count
    b'"' + b'\\"' * 17 + b'"',  # many escaped quotes in short strings: each would go to numpy
], ids=["backslash runs", "escaped quotes"])
def test_a_body_built_to_make_the_walk_expensive_is_parsed_whole_after_bounded_work(
    literal: bytes, monkeypatch: pytest.MonkeyPatch
) -> None:
    raw = b'{"model":"m","x":[' + b",".join([literal] * (4 * 1024 * 1024 // len(literal))) + b"]}"
    scans: list[int] = []
    real = np.flatnonzero

    def counted(array: Any) -> Any:
        scans.append(int(array.size))
        return real(array)

    monkeypatch.setattr(np, "flatnonzero", counted)
    assert _long_prompt_literals(raw) is None
    assert sum(scans) <= 8 * 3 * 4096  # eight small windows at most, never the whole body
    assert parse_client_body(raw) == orjson.loads(raw)


def test_a_text_of_many_escaped_quotes_is_ended_by_numpy() -> None:
    text = ('say "hi" ' * 4000) + FILLER
    raw = orjson.dumps({"model": "m", "prompt": text, "n": 1})
    parsed = parse_client_body(raw)
    assert isinstance(parsed["prompt"], RawText) and orjson.loads(parsed["prompt"].literal) == text
    assert parsed["n"] == 1


@pytest.mark.parametrize("protocol", [NativeProtocol(), TrtllmProtocol(), VllmProtocol()],
                         ids=["native", "trtllm", "vllm"])
def test_each_workers_body_sends_the_literal_as_a_view_of_the_clients_bytes(protocol: WorkerProtocol) -> None:
    raw = orjson.dumps({"model": "m", "messages": [{"role": "user", "content": long_text("x")}], "stream": True})
    sent = protocol.context_request(parse_client_body(raw), return_prompt_tokens=False)
    assert isinstance(sent, tuple)
    (view,) = (chunk for chunk in sent if isinstance(chunk, memoryview))
    assert view.obj is raw  # never copied by the orchestrator
    assert sum(len(chunk) for chunk in sent if isinstance(chunk, bytes)) < 1024
    assert orjson.loads(body_bytes(sent))["messages"][0]["content"] == long_text("x")


def test_gens_b64_splice_goes_after_a_kept_literal() -> None:
    raw = orjson.dumps({"model": "m", "messages": [{"role": "user", "content": long_text("x")}]})
    b64 = b"QUJD" * 10
    sent = splice_b64_span(encode({**parse_client_body(raw), "prompt_token_ids_b64": ""}), memoryview(b64))
    assert isinstance(sent, tuple) and [type(chunk) for chunk in sent].count(memoryview) == 2
    assert orjson.loads(body_bytes(sent)) == {**orjson.loads(raw), "prompt_token_ids_b64": b64.decode()}
