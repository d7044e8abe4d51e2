"""What reading a client's body and writing it on to CTX costs the orchestrator, in-process: parsed whole (a
``str`` of the prompt, encoded again) against the prompt kept as the client's bytes (``orchestrator.client_body``).

``python -m bench.client_body_parse``. A /v1/completions body of 131,072 tokens' worth of text (4 characters a
token), three kinds of text: words and spaces (``bench.orchestrator_cost``'s prompt), the same with a newline every
80 characters (an escape the walk does not look at), and with a ``"`` every 500 characters too (each an escape the
walk must check: past 16 in one string it finds them all with numpy). Each figure is the best of 5 repeats of
``rounds`` reads, in ms per request: parse, the routing key (prefix_affinity's 1,024 characters and the token
estimate), and CTX's body (the native protocol's).
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from typing import Any

import orjson

from bench.driver.bodies import SYNTHETIC_MODEL, prompt_text
from bench.driver.common import arguments
from bench.driver.report import markdown_table
from frontend.http import parse_json_object
from orchestrator.client_body import parse_client_body
from orchestrator.protocols.native import NativeProtocol
from orchestrator.routers import routing_key

CHARS = 131_072 * 4
PREFIX_CHARS = 1024
ROUNDS = 200


def texts(chars: int) -> dict[str, str]:
    plain = prompt_text(chars)
    lines = list(plain)
    for at in range(80, chars, 80):
        lines[at] = "\n"
    quoted = lines[:]
    for at in range(500, chars, 500):
        quoted[at] = '"'
    return {"words and spaces": plain, "a newline every 80 characters": "".join(lines),
            'newlines, and a " every 500 characters': "".join(quoted)}


def best_ms(work: Callable[[], Any], rounds: int) -> float:
    best = float("inf")
    for _ in range(5):
        started = time.perf_counter()
        for _ in range(rounds):
            work()
        best = min(best, (time.perf_counter() - started) / rounds)
    return best * 1e3


def measure(text: str, rounds: int = ROUNDS) -> dict[str, float]:
    raw = orjson.dumps({"model": SYNTHETIC_MODEL, "prompt": text, "max_tokens": 8, "temperature": 0,
                        "stream": True})
    protocol = NativeProtocol()

    def read(parse: Callable[[bytes], dict[str, Any]]) -> None:
        body = parse(raw)
        routing_key(body, PREFIX_CHARS)
        protocol.context_request(body, return_prompt_tokens=False)

    return {"whole": best_ms(lambda: read(parse_json_object), rounds),
            "kept": best_ms(lambda: read(parse_client_body), rounds)}


def run(chars: int = CHARS, rounds: int = ROUNDS) -> dict[str, Any]:
    """Both ways of reading the body, for every kind of text."""
    return {"benchmark": "client_body_parse", "chars": chars, "rounds": rounds,
            "texts": {kind: measure(text, rounds) for kind, text in texts(chars).items()}}


def tables(result: dict[str, Any]) -> str:
    rows = [[kind, f"{figures['whole']:.3f}", f"{figures['kept']:.3f}", f"{figures['kept'] / figures['whole']:.2f}x"]
            for kind, figures in result["texts"].items()]
    return (f"A /v1/completions body of {result['chars']:,} characters of prompt: parse + routing key + CTX's body, "
            "ms per request (best of 5)\n"
            + markdown_table(["prompt text", "parsed whole", "kept as the client's bytes", "kept / whole"], rows))


def main(argv: list[str] | None = None) -> int:
    parser = arguments(__doc__)
    parser.add_argument("--chars", type=int, default=CHARS)
    parser.add_argument("--rounds", type=int, default=ROUNDS)
    args = parser.parse_args(argv)
    print(tables(run(args.chars, args.rounds)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
