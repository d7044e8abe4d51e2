from __future__ import annotations

import itertools
from collections.abc import AsyncGenerator

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from frontend.errors import UnsupportedParameterError
from frontend.sampling import SamplingParams
from frontend.token_codec import TOKEN_DTYPE, TokenArray
from workers.engines.outputs import EngineOutput
from workers.engines.request import GenerationRequest, Handoff, Phase, SequenceStart
from workers.engines.synthetic import SYNTHETIC_TEXT, SyntheticEngine
from workers.text_stream import StopStringMatcher, TextStep, stream_text

ALPHABET = "abc\n"


@st.composite
def texts_and_chunks(draw: st.DrawFn) -> tuple[str, list[str]]:
    text = draw(st.text(alphabet=ALPHABET, max_size=40))
    cuts = sorted(draw(st.lists(st.integers(min_value=0, max_value=len(text)), max_size=10)))
    bounds = [0, *cuts, len(text)]
    return text, [text[a:b] for a, b in itertools.pairwise(bounds)]


@given(texts_and_chunks(), st.lists(st.text(alphabet=ALPHABET, min_size=1, max_size=4), max_size=3))
def test_the_text_stops_where_a_stop_string_first_appears(case: tuple[str, list[str]], stops: list[str]) -> None:
    """Generation ends at the first chunk after which some stop string is present; the text is cut where the
    earliest present stop string begins, and no stop string (or part of one) is ever emitted before that."""
    text, chunks = case
    matcher = StopStringMatcher(stops)
    emitted, stopped, seen = "", False, ""
    expected: str | None = None
    for chunk in chunks:
        seen += chunk
        hits = [i for i in (seen.find(s) for s in stops) if i >= 0]
        out, stopped = matcher.push(chunk)
        emitted += out
        assert not any(s in emitted for s in stops)
        if hits:
            expected = seen[: min(hits)]
            break
        assert seen.startswith(emitted)
    if expected is None:
        assert not stopped
        assert emitted + matcher.flush() == text
    else:
        assert stopped
        assert emitted == expected


def test_partial_stop_is_held_back_until_decided() -> None:
    matcher = StopStringMatcher(["</s>"])
    assert matcher.push("Hello </") == ("Hello ", False)
    assert matcher.push("b>") == ("</b>", False)
    assert matcher.push(" bye</s> more") == (" bye", True)


def test_no_stops_passes_everything_through() -> None:
    matcher = StopStringMatcher(["", ""])
    assert matcher.push("abc") == ("abc", False)
    assert matcher.flush() == ""


async def collect(engine: SyntheticEngine, request: GenerationRequest) -> list[TextStep]:
    return [step async for step in stream_text(engine, engine.get_tokenizer().detokenizer, request)]


def prompt() -> TokenArray:
    return np.frombuffer(b"prompt", dtype=np.uint8).astype(TOKEN_DTYPE)


async def test_aggregated_text_and_finish() -> None:
    engine = SyntheticEngine()
    steps = await collect(engine, GenerationRequest("a", prompt(), SamplingParams(max_tokens=5)))
    assert "".join(s.text for s in steps) == SYNTHETIC_TEXT[:5].decode()
    assert [s.finish_reason for s in steps] == [None] * 4 + ["length"]


async def test_ctx_then_gen_gives_the_aggregated_text() -> None:
    engine = SyntheticEngine()
    sampling = SamplingParams(max_tokens=12)
    (ctx_step,) = await collect(engine, GenerationRequest("c", prompt(), sampling, phase=Phase.CONTEXT_ONLY))
    assert ctx_step.handoff_state is not None
    handoff = Handoff(ctx_step.token_ids, ctx_step.handoff_state)
    gen_steps = await collect(engine, GenerationRequest("g", prompt(), sampling, phase=Phase.GENERATION_ONLY,
                                                        handoff=handoff))
    assert ctx_step.text + "".join(s.text for s in gen_steps[1:]) == SYNTHETIC_TEXT[:12].decode()
    assert gen_steps[0].text == ctx_step.text  # GEN's answer opens with CTX's token
    assert sum(len(s.token_ids) for s in gen_steps) == 12


async def test_a_stop_string_at_ctx_releases_the_parked_handoff() -> None:
    engine = SyntheticEngine()
    sampling = SamplingParams(max_tokens=12, stop=("T",))
    (step,) = await collect(engine, GenerationRequest("c", prompt(), sampling, phase=Phase.CONTEXT_ONLY))
    assert step.finish_reason == "stop"
    assert step.handoff_state is None
    assert step.text == ""


async def test_a_stop_string_inside_the_first_gen_token_ends_at_once() -> None:
    engine = SyntheticEngine()
    handoff = Handoff((ord("T"),), b'{"engine":"synthetic","prompt_len":6,"position":1}')
    request = GenerationRequest("g", prompt(), SamplingParams(max_tokens=12, stop=("T",)),
                                phase=Phase.GENERATION_ONLY, handoff=handoff)
    steps = await collect(engine, request)
    assert [(s.text, s.finish_reason) for s in steps] == [("", "stop")]


async def test_closing_the_stream_early_aborts_the_engine_request() -> None:
    engine = SyntheticEngine()
    steps = stream_text(engine, engine.get_tokenizer().detokenizer,
                        GenerationRequest("a", prompt(), SamplingParams(max_tokens=1000)))
    await anext(steps)
    await anext(steps)
    assert engine._running == {"a"}
    await steps.aclose()
    assert engine._running == set()


@pytest.mark.parametrize("stops", [("quick",), ("quick", "The")])
async def test_stop_strings_across_tokens(stops: tuple[str, ...]) -> None:
    engine = SyntheticEngine()
    steps = await collect(engine, GenerationRequest("a", prompt(), SamplingParams(max_tokens=40, stop=stops)))
    expected = "" if "The" in stops else "The "
    assert "".join(s.text for s in steps) == expected
    assert steps[-1].finish_reason == "stop"


class ChoosesFirstTokensAgain(SyntheticEngine):
    """A GEN engine that, like the vllm adapter, chooses every sequence's first token again and yields it: ``n``
    sequences, each its own letters (byte tokens), the first output flagged ``chose_first_tokens``."""

    def __init__(self, texts: list[bytes]) -> None:
        super().__init__()
        self.texts = texts

    async def _chosen_again(self, request: GenerationRequest) -> AsyncGenerator[EngineOutput, None]:
        for position in range(max(map(len, self.texts))):
            for index, text in enumerate(self.texts):
                if position < len(text):
                    yield EngineOutput((text[position],), finish_reason="length" if position == len(text) - 1
                                       else None, index=index, chose_first_tokens=(position, index) == (0, 0))

    def generate(self, request: GenerationRequest) -> AsyncGenerator[EngineOutput, None]:
        return self._chosen_again(request)


async def test_an_engine_that_chose_the_first_tokens_again_opens_the_answer_with_its_own() -> None:
    engine = ChoosesFirstTokensAgain([b"Yes", b"No"])
    # CTX chose "W" and "M": GEN's engine chose otherwise, and its choice is the answer's, nothing of CTX's.
    handoff = Handoff((ord("W"),), b"state", more_sequences=(SequenceStart((ord("M"),)),), cached_tokens=3)
    request = GenerationRequest("g", prompt(), SamplingParams(max_tokens=3, n=2), phase=Phase.GENERATION_ONLY,
                                handoff=handoff)
    steps = await collect(engine, request)
    assert ["".join(s.text for s in steps if s.index == i) for i in (0, 1)] == ["Yes", "No"]
    assert sum(len(s.token_ids) for s in steps) == 5
    assert steps[0].cached_tokens == 3  # CTX's figure, as on the path that opens with CTX's tokens
    assert [s.finish_reason for s in steps if s.finish_reason] == ["length", "length"]


async def test_a_continued_stream_replays_the_tokens_handed_over_in_their_steps_then_goes_on() -> None:
    # Another GEN broke after the client had 5 tokens, streamed in steps of 1, 2 and 2: this one opens with the same
    # steps (the text a detokenizer writes depends on them) and decodes on after them.
    engine = SyntheticEngine()
    sampling = SamplingParams(max_tokens=12)
    (ctx_step,) = await collect(engine, GenerationRequest("c", prompt(), sampling, phase=Phase.CONTEXT_ONLY))
    assert ctx_step.handoff_state is not None
    sent = tuple(SYNTHETIC_TEXT[:5])
    handoff = Handoff(sent, ctx_step.handoff_state, first_gen_steps=(1, 2, 2))
    steps = await collect(engine, GenerationRequest("g", prompt(), sampling, phase=Phase.GENERATION_ONLY,
                                                    handoff=handoff))
    assert [s.token_ids for s in steps[:3]] == [sent[:1], sent[1:3], sent[3:5]]
    assert "".join(s.text for s in steps) == SYNTHETIC_TEXT[:12].decode()
    assert sum(len(s.token_ids) for s in steps) == 12


async def test_an_engine_that_chooses_the_first_tokens_again_refuses_to_continue_a_stream() -> None:
    engine = ChoosesFirstTokensAgain([b"Yes"])
    handoff = Handoff((ord("Y"), ord("e")), b"state", first_gen_steps=(1, 1))
    request = GenerationRequest("g", prompt(), SamplingParams(max_tokens=3), phase=Phase.GENERATION_ONLY,
                                handoff=handoff)
    with pytest.raises(UnsupportedParameterError) as refused:
        await collect(engine, request)
    assert refused.value.param == "disaggregated_params.first_gen_steps"
