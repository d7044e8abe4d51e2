"""The real SmolLM2-135M model: disaggregated serving (CTX + GEN) equals aggregated serving, token for token."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import numpy as np
import pytest
from openai.types.chat import ChatCompletionMessageParam

from frontend.sampling import SamplingParams
from tests.workers.engines.reference.cluster import RefCluster, reference_cluster
from tests.workers.engines.reference.conftest import Engine
from tests.workers.engines.reference.ledger import assert_ledger_balances
from workers.engines.reference.options import ReferenceOptions
from workers.engines.reference.sampler import Sampler
from workers.engines.reference.transformer import export_kv, import_kv

pytestmark = pytest.mark.real_model

FRANCE: list[ChatCompletionMessageParam] = [{"role": "user", "content": "What is the capital of France?"}]
PROMPTS: list[list[ChatCompletionMessageParam]] = [
    FRANCE,
    [{"role": "system", "content": "You answer in one short sentence."},
     {"role": "user", "content": "Why is the sky blue?"}],
    [{"role": "user", "content": "Write a haiku about the sea."}],
]


@pytest.fixture(scope="module")
def real_cluster() -> Iterator[RefCluster]:
    with reference_cluster(ReferenceOptions(blas_threads=1)) as cluster:
        yield cluster


def test_greedy_france_answers_paris(real_cluster: RefCluster) -> None:
    with real_cluster.orchestrator.client() as client:
        reply = client.chat.completions.create(model=real_cluster.model, messages=FRANCE, max_tokens=16,
                                               temperature=0)
    assert reply.choices[0].message.content == "The capital of France is Paris."
    assert reply.choices[0].finish_reason == "stop"
    assert reply.usage is not None and reply.usage.prompt_tokens == 37


@pytest.mark.parametrize(
    "options",
    [
        {"temperature": 0},
        {"temperature": 0, "frequency_penalty": 0.8, "presence_penalty": 0.4,
         "extra_body": {"repetition_penalty": 1.3}},
        {"temperature": 0, "stop": [" is", "."]},
        {"temperature": 0.8, "top_p": 0.9, "seed": 1234, "extra_body": {"top_k": 40}},
    ],
    ids=["greedy", "penalties", "stop-strings", "seeded-sampling"],
)
def test_disaggregated_equals_aggregated(real_cluster: RefCluster, options: dict[str, Any]) -> None:
    with real_cluster.orchestrator.client() as disagg, real_cluster.aggregated.client() as agg:
        for messages in PROMPTS:
            a = disagg.chat.completions.create(model=real_cluster.model, messages=messages,
                                               max_tokens=12, **options)
            b = agg.chat.completions.create(model=real_cluster.model, messages=messages,
                                            max_tokens=12, **options)
            assert a.choices[0].message.content == b.choices[0].message.content
            assert a.choices[0].finish_reason == b.choices[0].finish_reason
            assert a.usage == b.usage


def test_n_seeded_choices_disaggregated_equal_aggregated(real_cluster: RefCluster) -> None:
    """One prefill, three sequences (seed + i each): the same three answers through CTX + GEN as aggregated."""
    answers = []
    for node in (real_cluster.orchestrator, real_cluster.aggregated):
        with node.client() as client:
            reply = client.chat.completions.create(model=real_cluster.model, messages=PROMPTS[2], max_tokens=10,
                                                   temperature=0.9, seed=77, n=3)
        answers.append([(c.index, c.message.content, c.finish_reason) for c in reply.choices])
        assert reply.usage is not None and reply.usage.completion_tokens > 10
    assert answers[0] == answers[1]
    assert len({text for _, text, _ in answers[0]}) > 1


def test_streamed_disaggregated_completion_equals_aggregated(real_cluster: RefCluster) -> None:
    with real_cluster.orchestrator.client() as disagg, real_cluster.aggregated.client() as agg:
        stream = disagg.completions.create(model=real_cluster.model, prompt="The three primary colours are",
                                           max_tokens=12, temperature=0, stream=True)
        streamed = "".join(chunk.choices[0].text for chunk in stream if chunk.choices)
        whole = agg.completions.create(model=real_cluster.model, prompt="The three primary colours are",
                                       max_tokens=12, temperature=0)
    assert streamed == whole.choices[0].text


def test_kv_store_is_empty_after_the_real_model_requests(real_cluster: RefCluster) -> None:
    text = httpx.get(real_cluster.ctx.url + "/metrics", timeout=10).text
    assert "disagg_kv_store_entries 0.0" in text
    assert "disagg_kv_store_bytes 0.0" in text
    assert assert_ledger_balances(real_cluster.ctx.url)["totals"]["taken"] >= 1


def test_metadata_only_through_the_orchestrator_equals_aggregated(real_cluster: RefCluster) -> None:
    import contextlib

    from tests.workers.engines.reference.cluster import start_orchestrator

    with contextlib.ExitStack() as stack:
        metadata_only = start_orchestrator(stack, [real_cluster.ctx.url], [real_cluster.gen.url],
                                           gen_tokids_metadata_only=True)
        cases: list[dict[str, Any]] = [{"temperature": 0},
                                       {"temperature": 0, "extra_body": {"repetition_penalty": 1.3}}]
        with metadata_only.client() as disagg, real_cluster.aggregated.client() as agg:
            for options in cases:
                a = disagg.chat.completions.create(model=real_cluster.model, messages=FRANCE, max_tokens=24,
                                                   **options)
                b = agg.chat.completions.create(model=real_cluster.model, messages=FRANCE, max_tokens=24,
                                                **options)
                assert a.choices[0].message.content == b.choices[0].message.content
        metrics = real_cluster.gen.app.state.metrics
        assert metrics.registry.get_sample_value("disagg_gen_prompt_path_total", {"path": "metadata_only"}) == 2


def test_the_guardrail_is_not_decorative(real: Engine) -> None:
    """Decode on a placeholder prompt under repetition penalty 1.3 (what the guardrail forbids when the hand-off
    carries no tokens): the output changes. Without the penalty the placeholder is harmless."""
    model, tokenizer = real.transformer, real.tokenizer
    prompt = tokenizer.encode(tokenizer.render_chat([{"role": "user", "content": "What is the capital of France?"}]))
    placeholder = np.zeros_like(prompt)
    # CTX's side is the same in every run (same prompt, same cache): prefill and export once, import per run.
    ctx_cache = model.new_cache()
    logits = model.prefill(prompt, ctx_cache)
    exported = export_kv(ctx_cache)

    def continue_on_gen(config: SamplingParams) -> tuple[list[int], list[int]]:
        """GEN's continuation on the placeholder and on the true prompt, decoded side by side up to 24 tokens or
        EOS, stopping early once they differ (the rest cannot make them equal again)."""
        first = Sampler(config, prompt, model.config.vocab_size).sample(logits).token_id  # chosen on CTX
        runs = [(import_kv(*exported, model.config),
                 Sampler(config, gen_prompt, model.config.vocab_size, output_so_far=[first]), [first])
                for gen_prompt in (placeholder, prompt)]
        for _ in range(24):
            for cache, sampler, out in runs:
                out.append(sampler.sample(model.decode(out[-1], cache)).token_id)
            (_, _, a), (_, _, b) = runs
            if a != b or a[-1] in tokenizer.eos_token_ids:
                break
        return runs[0][2], runs[1][2]

    on_placeholder, on_prompt = continue_on_gen(SamplingParams(temperature=0.0))
    assert on_placeholder == on_prompt and on_prompt[-1] in tokenizer.eos_token_ids
    on_placeholder, on_prompt = continue_on_gen(SamplingParams(temperature=0.0, repetition_penalty=1.3))
    assert on_placeholder != on_prompt


CAPITAL_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 30}, "country": {"type": "string", "maxLength": 30}},
    "required": ["city", "country"],
    "additionalProperties": False,
}
WEATHER_TOOL: Any = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 30}},
                   "required": ["city"], "additionalProperties": False}}}


def test_structured_output_on_the_real_model_is_valid_and_disaggregated_equals_aggregated(
    real_cluster: RefCluster,
) -> None:
    """Greedy, so CTX's first token under the grammar and GEN's continuation must match one worker's answer."""
    import jsonschema
    import orjson

    json_schema: Any = {"type": "json_schema", "json_schema": {"name": "capital", "schema": CAPITAL_SCHEMA,
                                                               "strict": True}}
    with real_cluster.orchestrator.client() as disagg, real_cluster.aggregated.client() as agg:
        answers = [client.chat.completions.create(model=real_cluster.model, messages=FRANCE, max_tokens=40,
                                                  temperature=0, response_format=json_schema)
                   for client in (disagg, agg)]
        calls = [client.chat.completions.create(model=real_cluster.model, messages=FRANCE, max_tokens=40,
                                                temperature=0, tools=[WEATHER_TOOL], tool_choice="required")
                 for client in (disagg, agg)]
    assert answers[0].choices[0].message.content == answers[1].choices[0].message.content
    assert answers[0].choices[0].finish_reason == "stop"
    capital = orjson.loads(answers[0].choices[0].message.content or "")
    jsonschema.validate(capital, CAPITAL_SCHEMA)
    assert "Paris" in capital["city"]
    (disagg_call,), (agg_call,) = [c.choices[0].message.tool_calls or [] for c in calls]
    assert disagg_call.model_dump()["function"] == agg_call.model_dump()["function"]
    assert calls[0].choices[0].finish_reason == "tool_calls"
    arguments = orjson.loads(disagg_call.model_dump()["function"]["arguments"])
    jsonschema.validate(arguments, WEATHER_TOOL["function"]["parameters"])


def test_the_grammar_state_survives_the_kv_hand_off_on_the_real_model(real: Engine) -> None:
    """In process, the hand-off as the workers do it: CTX picks the first token under the grammar and exports the
    KV; GEN imports it, rebuilds the grammar from the schema and replays the first token. The answer equals one
    engine's whole run, and is valid."""
    import jsonschema
    import orjson

    from workers.engines.reference.grammar import GrammarCompiler

    model, tokenizer = real.transformer, real.tokenizer
    vocab = model.config.vocab_size
    grammars = GrammarCompiler(tokenizer, vocab)
    schema = orjson.dumps(CAPITAL_SCHEMA).decode()
    prompt = tokenizer.encode(tokenizer.render_chat([{"role": "user", "content": "What is the capital of France? "
                                                      "Answer in JSON with the city and its country."}]))
    greedy = SamplingParams(temperature=0.0)

    def run(split: bool) -> list[int]:
        cache = model.new_cache()
        constraint, sampler = grammars.constraint(schema), Sampler(greedy, prompt, vocab)
        token = sampler.sample(model.prefill(prompt, cache), constraint.allowed()).token_id
        constraint.advance(token)
        if split:  # GEN: the KV crosses; the grammar is rebuilt from the request, never sent
            cache = import_kv(*export_kv(cache), model.config)
            constraint, sampler = grammars.constraint(schema), Sampler(greedy, prompt, vocab, output_so_far=[token])
            constraint.advance_all([token])
        out = [token]
        while len(out) < 40:
            token = sampler.sample(model.decode(token, cache), constraint.allowed()).token_id
            if token in tokenizer.eos_token_ids:
                return out
            constraint.advance(token)
            out.append(token)
        raise AssertionError(f"no EOS within 40 tokens: {tokenizer.decode(out)!r}")

    whole = run(split=False)
    assert run(split=True) == whole
    answer = orjson.loads(tokenizer.decode(whole))
    jsonschema.validate(answer, CAPITAL_SCHEMA)
    assert "Paris" in answer["city"]
    assert grammars.compilations == 1


def test_n_structured_choices_on_the_real_model_disaggregated_equal_aggregated(real_cluster: RefCluster) -> None:
    """n = 2 sampled under one schema: every sequence has its own grammar state, on CTX (first tokens) and GEN."""
    import jsonschema
    import orjson

    json_schema: Any = {"type": "json_schema", "json_schema": {"name": "capital", "schema": CAPITAL_SCHEMA}}
    answers = []
    for node in (real_cluster.orchestrator, real_cluster.aggregated):
        with node.client() as client:
            reply = client.chat.completions.create(model=real_cluster.model, messages=FRANCE, max_tokens=40,
                                                   temperature=0.9, seed=77, n=2, response_format=json_schema)
        answers.append([(c.index, c.message.content, c.finish_reason) for c in reply.choices])
    assert answers[0] == answers[1]
    assert [index for index, _, _ in answers[0]] == [0, 1]
    for _, content, finish in answers[0]:
        assert (content or "").startswith("{")
        if finish == "stop":  # sampled: a choice may still run out of max_tokens
            jsonschema.validate(orjson.loads(content or ""), CAPITAL_SCHEMA)


# One call and its result earlier in the conversation: SmolLM2 then calls the tool by itself when asked again.
ASKED_BEFORE: list[ChatCompletionMessageParam] = [
    {"role": "user", "content": "What is the weather in Rome?"},
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Rome"}'}}]},
    {"role": "tool", "tool_call_id": "c1", "content": "21 C, sunny"},
    {"role": "assistant", "content": "It is 21 C and sunny in Rome."},
    {"role": "user", "content": "What is the weather in Paris?"},
]


def test_the_real_model_calls_a_tool_by_itself_under_auto_disaggregated_equal_to_aggregated(
    real_cluster: RefCluster,
) -> None:
    """tool_choice auto: the model chooses to call, in Hermes' tags, and the worker reads the call out of its text,
    whole and streamed (its arguments in pieces), the same through CTX and GEN as on one worker."""
    body: Any = {"model": real_cluster.model, "messages": ASKED_BEFORE, "tools": [WEATHER_TOOL], "max_tokens": 60,
                 "temperature": 0}
    with real_cluster.orchestrator.client() as disagg, real_cluster.aggregated.client() as agg:
        replies = [client.chat.completions.create(**body) for client in (disagg, agg)]
        chunks = list(disagg.chat.completions.create(**body, stream=True))
    calls = []
    for reply in replies:
        choice = reply.choices[0]
        assert choice.finish_reason == "tool_calls" and choice.message.content is None
        (call,) = choice.message.tool_calls or []
        calls.append(call.model_dump()["function"])
    assert calls[0] == calls[1] == {"name": "get_weather", "arguments": '{"city": "Paris"}'}
    pieces = [call for chunk in chunks if chunk.choices for call in chunk.choices[0].delta.tool_calls or ()]
    assert pieces[0].function is not None and pieces[0].function.name == "get_weather"
    assert "".join(piece.function.arguments or "" for piece in pieces if piece.function) == calls[0]["arguments"]
    assert len(pieces) > 2 and chunks[-1].choices[0].finish_reason == "tool_calls"


def test_the_real_models_call_under_anthropics_auto_is_a_tool_use_block(real_cluster: RefCluster) -> None:
    """The same conversation on Anthropic's Messages API with the official SDK: the call is a ``tool_use`` block,
    whole and assembled by the SDK's stream helper from its ``input_json_delta`` pieces."""
    import anthropic

    tool: Any = {"name": "get_weather", "description": WEATHER_TOOL["function"]["description"],
                 "input_schema": WEATHER_TOOL["function"]["parameters"]}
    messages: Any = [
        {"role": "user", "content": "What is the weather in Rome?"},
        {"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_1", "name": "get_weather",
                                           "input": {"city": "Rome"}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": "21 C, sunny"}]},
        {"role": "assistant", "content": "It is 21 C and sunny in Rome."},
        {"role": "user", "content": "What is the weather in Paris?"},
    ]
    client = anthropic.Anthropic(base_url=real_cluster.orchestrator.url, api_key="test", max_retries=0, timeout=120)
    # Greedy: this SDK no longer sends temperature, older clients do (extra_body sends it as they do).
    body: Any = {"model": real_cluster.model, "max_tokens": 60, "messages": messages, "tools": [tool],
                 "extra_body": {"temperature": 0}}
    whole = client.messages.create(**body)
    with client.messages.stream(**body) as stream:
        streamed = stream.get_final_message()
    for message in (whole, streamed):
        assert message.stop_reason == "tool_use"
        (block,) = message.content
        assert isinstance(block, anthropic.types.ToolUseBlock)
        assert (block.name, block.input) == ("get_weather", {"city": "Paris"})
