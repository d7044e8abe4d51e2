"""Where a tokenizer provably starts afresh, read from its ``tokenizer.json``: the cuts that keep ids exact.

``tokenizers`` splits text at its added tokens first, so the ids of ``text`` are those of ``text[:c]`` then of
``text[c:]`` where ``c`` ends an added-token match, provided no added token strips or absorbs its neighbours or is
matched after normalization, no match can straddle ``c`` (an added token's last character occurs in no other added
token but as its last), and no step depends on a piece's position (``_POSITION_FREE``, no BPE dropout). Byte-level
BPE also restarts before a space that follows a non-space. Any other tokenizer is encoded whole, never wrongly."""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import orjson

# Pre-tokenizers whose pieces do not depend on where in the whole text the piece lies.
_POSITION_FREE = frozenset({"ByteLevel", "Digits", "Split", "Punctuation", "Whitespace", "WhitespaceSplit",
                            "BertPreTokenizer", "UnicodeScripts", "CharDelimiterSplit", "FixedLength"})


@dataclass(frozen=True, slots=True)
class CutRules:
    """What may be cut in this tokenizer's text, and why not where something may not."""

    # Matches every added token, leftmost-longest as the tokenizer does; a cut after a match is exact. None: no cuts.
    added_tokens: re.Pattern[str] | None
    cut_before_spaces: bool  # a space after a non-space character starts a fresh piece (byte-level BPE)
    refusals: tuple[str, ...]  # why a cut is not allowed, for the one log line that says so

    def ends_of_added_tokens(self, text: str, start: int = 0) -> list[int]:
        """Offsets in ``text`` (from ``start``) right after each added-token match: where a cut is exact."""
        if self.added_tokens is None:
            return []
        return [match.end() for match in self.added_tokens.finditer(text, start)]


def cut_rules_of(tokenizer_json: str | bytes) -> CutRules:
    """The cuts this ``tokenizer.json`` allows (an unreadable or unknown shape allows none)."""
    try:
        spec = orjson.loads(tokenizer_json)
    except orjson.JSONDecodeError as exc:
        return CutRules(None, False, (f"tokenizer.json does not parse: {exc}",))
    if not isinstance(spec, dict):
        return CutRules(None, False, ("tokenizer.json is not an object",))
    refusals = _piece_refusals(spec)
    added = [t for t in spec.get("added_tokens") or () if isinstance(t, dict)]
    pattern = None if refusals else _added_token_pattern(added)
    spaces = pattern is not None and _byte_level_only(spec) and not any(
        any(c.isspace() for c in str(t.get("content", ""))) for t in added)
    return CutRules(pattern, spaces, tuple(refusals))


def _piece_refusals(spec: Mapping[str, Any]) -> list[str]:
    refusals: list[str] = []
    added = [t for t in spec.get("added_tokens") or () if isinstance(t, dict)]
    if not added:
        refusals.append("the tokenizer has no added tokens to cut at")
    normalizer = spec.get("normalizer")
    for token in added:
        content = str(token.get("content", ""))
        flags = [flag for flag in ("lstrip", "rstrip", "single_word") if token.get(flag)]
        if token.get("normalized") and normalizer is not None:
            flags.append("normalized")
        if flags or not content:
            refusals.append(f"added token {content!r} has {', '.join(flags) or 'no content'}")
    last_chars = {str(t.get("content", ""))[-1:] for t in added}
    for token in added:
        inner = str(token.get("content", ""))[:-1]
        clash = sorted(c for c in last_chars if c and c in inner)
        if clash:
            refusals.append(f"added token {token.get('content')!r} holds {clash[0]!r} before its end, where another "
                            "added token ends: a match could straddle a cut")
    for kind in _pre_tokenizer_kinds(spec.get("pre_tokenizer")):
        if kind not in _POSITION_FREE:
            refusals.append(f"pre-tokenizer {kind} may treat a text's first piece differently")
    model = spec.get("model")
    if isinstance(model, dict) and model.get("dropout"):
        refusals.append("the model samples its merges (BPE dropout)")
    for setting in ("truncation", "padding"):  # applied to each piece, they would cut or pad inside the prompt
        if spec.get(setting):
            refusals.append(f"the tokenizer has {setting} configured")
    return refusals


def _pre_tokenizer_kinds(pre: Any) -> list[str]:
    if pre is None:
        return []
    if not isinstance(pre, dict):
        return ["(unreadable)"]
    if pre.get("type") == "Sequence":
        return [kind for inner in pre.get("pretokenizers") or () for kind in _pre_tokenizer_kinds(inner)]
    kind = str(pre.get("type"))
    if kind == "ByteLevel" and pre.get("add_prefix_space"):
        return ["ByteLevel(add_prefix_space)"]
    return [kind]


def _byte_level_only(spec: Mapping[str, Any]) -> bool:
    """GPT-2's regex behind, at most, a digit split, on text no normalizer touches: where spaces start pieces."""
    if spec.get("normalizer") is not None:
        return False
    pre = spec.get("pre_tokenizer")
    steps = (pre.get("pretokenizers") if isinstance(pre, dict) and pre.get("type") == "Sequence" else [pre]) or []
    kinds = [step.get("type") if isinstance(step, dict) else None for step in steps]
    byte_level = [s for s in steps if isinstance(s, dict) and s.get("type") == "ByteLevel"]
    return (kinds in (["ByteLevel"], ["Digits", "ByteLevel"]) and bool(byte_level)
            and bool(byte_level[0].get("use_regex", True)) and not byte_level[0].get("add_prefix_space"))


def _added_token_pattern(added: list[dict[str, Any]]) -> re.Pattern[str]:
    # Longest first: Python's alternation takes the first alternative that matches at the leftmost position, so
    # this is the tokenizer's leftmost-longest match.
    contents = sorted({str(t["content"]) for t in added}, key=len, reverse=True)
    return re.compile("|".join(re.escape(c) for c in contents))
