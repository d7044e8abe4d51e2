from __future__ import annotations

from typing import Any

import httpx
import numpy as np
import orjson
import pytest

from frontend.errors import EngineError, HandoffError
from frontend.sampling import SamplingParams
from frontend.token_codec import TOKEN_DTYPE
from workers.engines.factory import EngineOptions, create_engine
from workers.engines.outputs import EngineOutput
from workers.engines.request import GenerationRequest, Handoff, Phase
from workers.engines.synthetic import EOS_TOKEN_ID, SYNTHETIC_TEXT, SyntheticConfig, SyntheticEngine

PROMPT = np.arange(10, dtype=TOKEN_DTYPE)


async def run(engine: SyntheticEngine, request: GenerationRequest) -> list[EngineOutput]:
    return [output async for output in engine.generate(request)]


def tokens(outputs: list[EngineOutput]) -> list[int]:
    return [t for o in outputs for t in o.token_ids]


async def test_aggregated_emits_the_text_cyclically_to_max_tokens() -> None:
    outputs = await run(SyntheticEngine(), GenerationRequest("a", PROMPT, SamplingParams(max_tokens=100)))
    assert tokens(outputs) == [SYNTHETIC_TEXT[i % len(SYNTHETIC_TEXT)] for i in range(100)]
    assert [o.finish_reason for o in outputs[-2:]] == [None, "length"]


async def test_context_only_yields_one_output_with_a_handoff() -> None:
    (output,) = await run(SyntheticEngine(), GenerationRequest("c", PROMPT, SamplingParams(max_tokens=9),
                                                               phase=Phase.CONTEXT_ONLY))
    assert output.token_ids == (SYNTHETIC_TEXT[0],)
    assert output.finish_reason is None
    assert output.handoff_state is not None
    assert orjson.loads(output.handoff_state) == {"engine": "synthetic", "prompt_len": 10, "position": 1}


async def test_generation_only_continues_where_ctx_stopped() -> None:
    engine = SyntheticEngine()
    (ctx,) = await run(engine, GenerationRequest("c", PROMPT, SamplingParams(max_tokens=9), phase=Phase.CONTEXT_ONLY))
    assert ctx.handoff_state is not None
    gen = await run(engine, GenerationRequest("g", PROMPT, SamplingParams(max_tokens=9), phase=Phase.GENERATION_ONLY,
                                              handoff=Handoff(ctx.token_ids, ctx.handoff_state)))
    assert list(ctx.token_ids) + tokens(gen) == list(SYNTHETIC_TEXT[:9])


@pytest.mark.parametrize(
    "state",
    [b"not json", b'{"engine": "reference", "prompt_len": 10, "position": 1}',
     b'{"engine": "synthetic", "prompt_len": 11, "position": 1}', b'{"engine": "synthetic"}'],
)
async def test_an_unusable_handoff_is_a_handoff_error(state: bytes) -> None:
    request = GenerationRequest("g", PROMPT, SamplingParams(max_tokens=3), phase=Phase.GENERATION_ONLY,
                                handoff=Handoff((1,), state))
    with pytest.raises(HandoffError):
        await run(SyntheticEngine(), request)


async def test_eos_after_output_tokens_unless_ignored() -> None:
    engine = SyntheticEngine(SyntheticConfig(output_tokens=3))
    outputs = await run(engine, GenerationRequest("a", PROMPT, SamplingParams(max_tokens=10)))
    assert tokens(outputs) == [*SYNTHETIC_TEXT[:3], EOS_TOKEN_ID]
    assert outputs[-1].finish_reason == "stop"
    ignoring = await run(engine, GenerationRequest("b", PROMPT, SamplingParams(max_tokens=6, ignore_eos=True)))
    assert len(tokens(ignoring)) == 6
    assert ignoring[-1].finish_reason == "length"


async def test_eos_as_the_first_token_finishes_ctx_without_a_handoff() -> None:
    engine = SyntheticEngine(SyntheticConfig(output_tokens=0))
    (output,) = await run(engine, GenerationRequest("c", PROMPT, SamplingParams(max_tokens=9),
                                                    phase=Phase.CONTEXT_ONLY))
    assert output.finish_reason == "stop"
    assert output.handoff_state is None


async def test_abort_ends_a_running_request() -> None:
    engine = SyntheticEngine()
    outputs = engine.generate(GenerationRequest("a", PROMPT, SamplingParams(max_tokens=1000)))
    await anext(outputs)
    await engine.abort("a")
    rest = [o async for o in outputs]
    assert rest[-1].finish_reason == "abort"
    assert len(rest) < 999
    await engine.abort("never-started")  # harmless


async def test_logprobs_and_prompt_logprobs() -> None:
    sampling = SamplingParams(max_tokens=2, logprobs=3, prompt_logprobs=0)
    outputs = await run(SyntheticEngine(), GenerationRequest("a", PROMPT, sampling))
    first = outputs[0]
    assert first.logprobs[0].token_id == SYNTHETIC_TEXT[0]
    assert len(first.logprobs[0].top) == 3
    assert first.prompt_logprobs is not None
    assert len(first.prompt_logprobs) == PROMPT.size
    assert first.prompt_logprobs[0] is None


async def test_the_synthetic_engine_never_reads_prompt_values_unless_asked() -> None:
    request = GenerationRequest("a", PROMPT, SamplingParams(max_tokens=5))
    await run(SyntheticEngine(), request)
    assert request.prompt_list_built is False


def test_engine_info() -> None:
    info = SyntheticEngine(SyntheticConfig(model="m", vocab_size=1000, max_context=77)).info
    assert (info.engine, info.model, info.vocab_size, info.max_context) == ("synthetic", "m", 1000, 77)
    assert info.kv_block_reuse is False
    assert info.prompt_tokens_in_handoff is False


# -- --tokenizer reference: the reference model's real tokenizer, served through real HTTP -------------------------
CHAT: list[dict[str, str]] = [
    {"role": "system", "content": "You answer in one line."},
    {"role": "user", "content": "Count 12345 and spell <|im_end|> as text, then 🙂."},
    {"role": "assistant", "content": "12345, <|im_end|>, 🙂"},
    {"role": "user", "content": "Again, please."},
]


def reference_count(messages: list[dict[str, str]]) -> int:
    """The reference tokenizer's count of the rendered chat, from a tokenizer of the test's own."""
    from workers.engines.reference.model_file import load_tokenizer_metadata
    from workers.engines.reference.tokenizer import GGUFTokenizer

    tokenizer = GGUFTokenizer(load_tokenizer_metadata())
    return int(tokenizer.encode(tokenizer.render_chat(messages)).size)


def serve_chats(engine_name: str, chats: list[list[dict[str, str]]], max_tokens: int) -> list[dict[str, Any]]:
    """Chat completions, one after another, from one worker of ``engine_name`` with ``--tokenizer reference``, over
    loopback HTTP (the simulated engine's tests use it too)."""
    from tests.servers import running
    from workers.server import create_worker_app
    from workers.settings import WorkerSettings

    engine = create_engine(engine_name, EngineOptions(tokenizer="reference"))
    app = create_worker_app(engine, WorkerSettings(role="both", kv_events_endpoint=None,
                                                   kv_events_replay_endpoint=None))
    answers: list[dict[str, Any]] = []
    with running(app) as url:
        model = httpx.get(f"{url}/v1/models", timeout=30).json()["data"][0]["id"]
        for messages in chats:
            reply = httpx.post(f"{url}/v1/chat/completions", timeout=60,
                               json={"model": model, "messages": messages, "max_tokens": max_tokens})
            assert reply.status_code == 200, reply.text
            answers.append(reply.json())
    return answers


def test_a_reference_tokenizer_worker_counts_the_chat_in_real_tokens() -> None:
    (answer,) = serve_chats("synthetic", [CHAT], 25)
    assert answer["usage"]["prompt_tokens"] == reference_count(CHAT)
    assert answer["usage"]["prompt_tokens"] < len(str(CHAT).encode()) // 2  # real BPE, not one token per byte
    assert answer["usage"]["completion_tokens"] == 25
    # 25 tokens of the same fixed text: its 11 BPE tokens twice, then "The quick brown"
    text = SYNTHETIC_TEXT.decode()
    assert answer["choices"][0]["message"]["content"] == text * 2 + "The quick brown"


async def test_reference_tokens_and_their_answer() -> None:
    engine = SyntheticEngine(SyntheticConfig(output_tokens=12), tokenizer="reference")
    with pytest.raises(EngineError):
        engine.get_tokenizer()  # loaded by start
    await engine.start()
    tokenizer = engine.get_tokenizer()
    assert engine.info.vocab_size == tokenizer.vocab_size == 49_152
    assert engine.info.max_context == SyntheticConfig().max_context  # its own, not the model's 8k
    outputs = await run(engine, GenerationRequest("a", PROMPT, SamplingParams(max_tokens=20)))
    ids = tokens(outputs)
    assert outputs[-1].finish_reason == "stop"
    assert tokenizer.decode(ids) == SYNTHETIC_TEXT.decode() + "The"  # 11 tokens a sentence, then EOS: skipped
    assert ids[-1] in tokenizer.eos_token_ids  # type: ignore[attr-defined]


def test_the_byte_tokenizer_is_there_before_start_and_an_unknown_one_is_refused() -> None:
    assert SyntheticEngine().get_tokenizer().vocab_size == SyntheticConfig().vocab_size
    with pytest.raises(ValueError, match="unknown tokenizer"):
        SyntheticEngine(tokenizer="bpe")


async def test_the_workers_tokenize_settings_reach_the_reference_tokenizer() -> None:
    from workers.engines.options import TokenizeConfig
    from workers.engines.reference.tokenizer import GGUFTokenizer

    options = EngineOptions(tokenizer="reference", tokenize=TokenizeConfig(cache_bytes=0, backend="tokenizers"))
    engine = create_engine("synthetic", options)
    await engine.start()
    tokenizer = engine.get_tokenizer()  # type: ignore[attr-defined]
    assert isinstance(tokenizer, GGUFTokenizer)
    tokenizer.encode("What --tokenize-cache-mb 0 --tokenizer-backend tokenizers asks for: today's full encode.")
    stats = tokenizer.tokenize_stats()
    assert stats is not None and stats.encoder == "tokenizers" and stats.cache is None


async def test_a_stream_continued_after_its_eos_ends_at_once() -> None:
    # A GEN that broke after writing the answer's EOS and before its end marker: the continuation is handed the
    # tokens the client has, EOS last. It ends there, as the first answer did, rather than decode past its end.
    engine = SyntheticEngine(SyntheticConfig(output_tokens=3))
    (ctx,) = await run(engine, GenerationRequest("c", PROMPT, SamplingParams(max_tokens=9), phase=Phase.CONTEXT_ONLY))
    assert ctx.handoff_state is not None
    handed = (*SYNTHETIC_TEXT[:3], EOS_TOKEN_ID)
    gen = await run(engine, GenerationRequest("g", PROMPT, SamplingParams(max_tokens=9), phase=Phase.GENERATION_ONLY,
                                              handoff=Handoff(handed, ctx.handoff_state)))
    assert tokens(gen) == [] and [o.finish_reason for o in gen] == ["stop"]
    ignoring = await run(engine, GenerationRequest("i", PROMPT, SamplingParams(max_tokens=6, ignore_eos=True),
                                                   phase=Phase.GENERATION_ONLY,
                                                   handoff=Handoff(handed, ctx.handoff_state)))
    assert len(tokens(ignoring)) == 2 and ignoring[-1].finish_reason == "length"
