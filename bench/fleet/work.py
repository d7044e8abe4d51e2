"""bench.fleet's work: seeded sessions (conversations over shared system prompts, unrelated one-turn prompts, agent
loops over one long tool prompt, agent loops that grow past 100k tokens), the very same for every router.

Sizes are in tokens of the workers' tokenizer: ``sessions`` writes ``chars_per_token`` characters for each (1 for the
byte tokenizer; ``chars_per_token`` measures it for ``--tokenizer reference``). For a real tokenizer the
text is real too (``corpus``: what a real BPE pays for depends on the text, and on a few repeated words its word cache
answers nearly every word)."""

from __future__ import annotations

import random
from dataclasses import dataclass

MODEL = "simulated"


@dataclass(frozen=True)
class Workload:
    """Sessions of ``turns`` turns that start open-loop at ``session_rate`` per second for ``window_s`` seconds.

    A session opens with one of ``systems`` shared system prompts (none: nothing is shared); each turn adds a
    message of ``turn_tokens`` tokens, sent ``think_mean_s`` (mean, exponential) after the previous answer came
    back."""

    name: str
    systems: int
    system_tokens: int
    session_rate: float
    window_s: float
    turns: int
    turn_tokens: tuple[int, int]
    think_mean_s: float
    max_tokens: int = 24
    sessions_named: bool = True  # send x-session-id
    turn_prefix: str = ""

    @property
    def request_rate(self) -> float:
        return self.session_rate * self.turns


@dataclass(frozen=True)
class Session:
    key: str
    system: str | None
    turns: tuple[str, ...]
    start_s: float
    think_s: tuple[float, ...]


CHAT = Workload("chat", systems=2, system_tokens=6_000, session_rate=12.5, window_s=16.0, turns=4,
                turn_tokens=(800, 2_000), think_mean_s=1.0)
UNRELATED = Workload("unrelated", systems=0, system_tokens=0, session_rate=40.0, window_s=10.0, turns=1,
                     turn_tokens=(1_500, 3_500), think_mean_s=0.0, sessions_named=False)
AGENT = Workload("agent", systems=1, system_tokens=8_000, session_rate=2.5, window_s=12.0, turns=8,
                 turn_tokens=(400, 1_500), think_mean_s=0.3, turn_prefix="Tool result:\n")
# An agent over a large context (a repository, a long document: 96k tokens) whose loop of short tool results grows it
# past 100k tokens (to ~107k): the work where re-tokenizing the whole conversation every turn (what vLLM's server
# does) sets the follow-ups' TTFT. Each step waits 2 s (mean) for its tool, so that the sessions (7, one in --quick,
# on real text) together keep the machine far from saturated even on a full encode every turn. Four such contexts,
# drawn at random; run it with --cache-tokens 1048576, so that a worker's cache holds every session routed to it.
AGENT_GROWING = Workload("agent_growing", systems=4, system_tokens=96_000, session_rate=0.35, window_s=10.0,
                         turns=30, turn_tokens=(100, 600), think_mean_s=2.0, turn_prefix="Tool result:\n")
WORKLOADS = {w.name: w for w in (CHAT, UNRELATED, AGENT, AGENT_GROWING)}


_WORDS = ("the", "of", "and", "to", "in", "is", "for", "that", "with", "as", "on", "are", "by", "this", "be", "or",
          "from", "an", "at", "it", "which", "can", "not", "all", "each", "data", "model", "request", "worker",
          "cache", "prompt", "token", "system", "answer", "query", "value", "result", "table", "index", "route")


def text(rng: random.Random, chars: int, head: str = "") -> str:
    """About ``chars`` characters of words; ``head`` first (what makes two texts differ from their start)."""
    words = [head] if head else []
    length = len(head)
    while length < chars:
        word = rng.choice(_WORDS) if rng.random() < 0.8 else f"{rng.getrandbits(24):06x}"
        words.append(word)
        length += len(word) + 1
    return " ".join(words)[:chars]


def corpus(rng: random.Random, chars: int, head: str = "") -> str:
    """About ``chars`` characters of real text (``corpus_text``: the Python standard library's source,
    what a coding agent sends) from an offset ``rng`` draws; ``head`` first."""
    from bench.driver.bodies import corpus_text

    body = corpus_text(max(chars - len(head) - 1, 1), seed=rng.getrandbits(32))
    return f"{head}\n{body}" if head else body


def sessions(workload: Workload, seed: int, chars_per_token: float = 1.0, real_text: bool = False) -> list[Session]:
    """The workload's sessions, the same for every router (one seed per workload); ``chars_per_token`` characters
    of text for each token of a size, of words (the default: with 1, the byte tokenizer's, the work it always gave)
    or, with ``real_text``, of ``corpus``."""

    def chars(tokens: int) -> int:
        return round(tokens * chars_per_token)

    write = corpus if real_text else text
    rng = random.Random(f"{seed}-{workload.name}")
    systems = [write(rng, chars(workload.system_tokens), f"System prompt {i} ({workload.name}).")
               for i in range(workload.systems)]
    out: list[Session] = []
    t = rng.expovariate(workload.session_rate)
    index = 0
    while t < workload.window_s:
        system = systems[rng.randrange(len(systems))] if systems else None
        turns = tuple(write(rng, chars(rng.randint(*workload.turn_tokens)),
                           f"{workload.turn_prefix}[{workload.name} {index}.{turn}]")
                      for turn in range(workload.turns))
        think = tuple(rng.expovariate(1 / workload.think_mean_s) if workload.think_mean_s > 0 else 0.0
                      for _ in range(workload.turns))
        out.append(Session(f"{workload.name}-{index}", system, turns, t, think))
        index += 1
        t += rng.expovariate(workload.session_rate)
    return out
