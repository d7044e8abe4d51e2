"""A GEN worker's account of its prompt: how many tokens it received through the KV hand-off, and how many it
computed itself.

A GEN whose KV transfer failed, or whose connector is misconfigured, may prefill the whole prompt again and still
answer correctly: only slower, at twice the cost. It says so in one response header, sent with the answer's head
(a GEN stream starts only once its engine has accepted the hand-off, so the count is known by then):

    x-disagg-prompt-tokens: received=4096, computed=0

The body is left as the client gets it (the orchestrator relays it byte for byte, and an OpenAI SDK's strict
types would trip on a field of ours in ``usage``); the orchestrator reads the header before the first byte
(``orchestrator.recompute_watch``) without parsing the answer. Only ``generation_only`` answers carry it.
"""

from __future__ import annotations

from dataclasses import dataclass

PROMPT_TOKENS_HEADER = "x-disagg-prompt-tokens"
PROMPT_TOKENS_HEADER_BYTES = PROMPT_TOKENS_HEADER.encode("latin-1")
_MAX_DIGITS = 18  # a prompt's token count fits many times over


@dataclass(frozen=True, slots=True)
class PromptReport:
    received: int  # prompt tokens whose KV came through the hand-off (or GEN's own prefix cache)
    computed: int  # prompt tokens GEN prefilled itself: KV the hand-off should have carried and did not

    def header_value(self) -> str:
        return f"received={self.received}, computed={self.computed}"


def read_prompt_report(value: bytes | str | None) -> PromptReport | None:
    """The report in a header's value; None for no header, or one that does not read as ours (never an error: a
    worker of another make sends none, and a malformed one must not fail the client's answer)."""
    if value is None:
        return None
    text = value.decode("latin-1") if isinstance(value, bytes) else value
    fields: dict[str, int] = {}
    for part in text.split(","):
        name, sep, number = part.strip().partition("=")
        # ASCII digits only, and no more than a count can have: int() raises on the rest ("²", 5,000 digits)
        if not sep or not (number.isascii() and number.isdigit()) or len(number) > _MAX_DIGITS:
            return None
        fields[name] = int(number)
    if set(fields) != {"received", "computed"}:
        return None
    return PromptReport(fields["received"], fields["computed"])
