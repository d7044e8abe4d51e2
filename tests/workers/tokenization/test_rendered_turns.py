"""A chat template's render through the rendered-turns cache is the whole render, turn after turn, whatever the
client does to its history; a template that is not message-wise is rendered whole; the cache stays in its bytes."""

from __future__ import annotations

import re

import pytest
from gguf import GGUFReader
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.workers.tokenization.test_prompt_encoder import FRAGMENTS, ROLES, SHIFTING_TEMPLATE
from workers.engines.reference.model_file import _read_tokenizer, default_model_path
from workers.engines.reference.tokenizer import ChatTemplateError, GGUFTokenizer, compile_chat_template
from workers.tokenization.rendered_turns import ChatRenderer


def _smollm2() -> str:
    field = GGUFReader(default_model_path()).get_field("tokenizer.chat_template")
    assert field is not None
    return str(field.contents())


# Message-wise templates: the reference model's, and shapes other models ship (a BOS before the loop, a default
# system prompt on the first message, filters, a refusal, the message's optional keys).
MESSAGE_WISE = {
    "smollm2": _smollm2(),
    "bos_before": "{{ bos_token }}{% for m in messages %}[{{ m['role'] | upper }}] {{ m['content'] | trim }}"
                  "{{ eos_token }}{% endfor %}{% if add_generation_prompt %}[ASSISTANT] {% endif %}",
    "first_and_refusal": "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
                         "<<SYS>>default<</SYS>>\n{% endif %}{% if message['role'] not in ['system', 'user', "
                         "'assistant'] %}{{ raise_exception('bad role ' + message['role']) }}{% endif %}"
                         "<|{{ message.role }}|>{% if message.name is defined %}({{ message.name }}){% endif %}"
                         "{{ message['content'].strip() }}\n{% endfor %}{% if add_generation_prompt %}<|assistant|>"
                         "{% else %}<|end|>{% endif %}",
}
# Templates whose pieces depend on more than their message: each must be rendered whole.
NOT_MESSAGE_WISE = {
    "latest_marked": SHIFTING_TEMPLATE,
    "last": "{% for m in messages %}{{ m['content'] }}{% if loop.last %}!{% endif %}{% endfor %}",
    "count": "{% for m in messages %}{{ loop.index }}:{{ m['content'] }}{% endfor %}",
    "length": "{{ messages | length }}{% for m in messages %}{{ m['content'] }}{% endfor %}",
    "last_message": "{% for m in messages %}{{ m['content'] }}{{ messages[-1]['role'] }}{% endfor %}",
    "namespace": "{% set ns = namespace(n=0) %}{% for m in messages %}{% set ns.n = ns.n + 1 %}{{ ns.n }}"
                 "{{ m['content'] }}{% endfor %}",
    "generation_prompt_in_loop": "{% for m in messages %}{{ m['content'] }}{% if add_generation_prompt %}>"
                                 "{% endif %}{% endfor %}",
    "random": "{% for m in messages %}{{ m['content'] }}{{ [1, 2] | random }}{% endfor %}",
    "two_loops": "{% for m in messages %}{{ m['role'] }}{% endfor %}{% for m in messages %}{{ m['content'] }}"
                 "{% endfor %}",
    "changed": "{% for m in messages %}{% if loop.changed(m['role']) %}#{% endif %}{{ m['content'] }}{% endfor %}",
    "system_outside": "{% if messages[0]['role'] == 'system' %}S{% endif %}{% for m in messages %}{{ m['content'] }}"
                      "{% endfor %}",
}

message_text = st.lists(st.sampled_from(FRAGMENTS), min_size=0, max_size=8).map(" ".join)
messages = st.lists(st.tuples(st.sampled_from(ROLES), message_text), min_size=1, max_size=6)
# What a client does next: add turns, rewrite an earlier one, regenerate the last, change the system prompt, or
# render the same conversation without the generation prompt.
edits = st.lists(st.tuples(st.sampled_from(["append", "rewrite", "regenerate", "system", "no_prompt"]),
                           message_text, st.integers(min_value=0, max_value=20)), min_size=1, max_size=8)
PROPERTY = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


def _apply(conversation: list[dict[str, str]], edit: tuple[str, str, int]) -> list[dict[str, str]]:
    kind, text, where = edit
    if kind in ("append", "no_prompt") or not conversation:
        role = "user" if not conversation or conversation[-1]["role"] != "user" else "assistant"
        return [*conversation, {"role": role, "content": text}]
    if kind == "rewrite":
        index = where % len(conversation)
        return [*conversation[:index], {**conversation[index], "content": text}, *conversation[index + 1:]]
    if kind == "system":
        return [{"role": "system", "content": text}, *conversation[1:]]
    return [*conversation[:-1], {"role": conversation[-1]["role"], "content": text}]


def _renderers(source: str) -> tuple[ChatRenderer, ChatRenderer]:
    cached, whole = compile_chat_template(source, 1 << 20), compile_chat_template(source, 0)
    assert cached is not None and whole is not None
    return cached, whole


def _render(renderer: ChatRenderer, conversation: list[dict[str, str]], prompt: bool = True) -> str:
    # Fresh dicts and strings, as each request parses its own.
    fresh = [{key: "".join(list(value)) for key, value in message.items()} for message in conversation]
    return renderer.render(messages=fresh, add_generation_prompt=prompt, bos_token="<s>", eos_token="</s>")


@pytest.mark.parametrize("name", [*MESSAGE_WISE, *(name for name in NOT_MESSAGE_WISE if name != "random")])
@PROPERTY
@given(start=messages, steps=edits)
def test_every_render_is_the_whole_render(name: str, start: list[tuple[str, str]],
                                          steps: list[tuple[str, str, int]]) -> None:
    cached, whole = _renderers({**MESSAGE_WISE, **NOT_MESSAGE_WISE}[name])
    conversation = [{"role": role, "content": text} for role, text in start]
    for step in [None, *steps]:
        if step is not None:
            conversation = _apply(conversation, step)
        prompt = step is None or step[0] != "no_prompt"
        try:
            want = _render(whole, conversation, prompt)
        except ChatTemplateError as exc:
            with pytest.raises(ChatTemplateError, match=re.escape(str(exc))):
                _render(cached, conversation, prompt)
            continue
        assert _render(cached, conversation, prompt) == want


@pytest.mark.parametrize("name", list(MESSAGE_WISE))
def test_message_wise_templates_render_only_what_a_turn_adds(name: str) -> None:
    cached, whole = _renderers(MESSAGE_WISE[name])
    conversation = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "x " * 1000}]
    first = _render(cached, conversation)
    follow_up = [*conversation, {"role": "assistant", "content": "Sure."}, {"role": "user", "content": "More?"}]
    text = _render(cached, follow_up)
    assert text == _render(whole, follow_up)
    stats = cached.stats()
    assert (stats.renders, stats.hits, stats.reused_messages, stats.entries) == (2, 1, 2, 1)  # the turn replaced it
    if name == "smollm2":  # its generation prompt opens the next answer: the text is built on the earlier one
        assert cached.extended(text) is first and text.startswith(first)
    assert cached.extended(first) is None


@pytest.mark.parametrize("name", list(NOT_MESSAGE_WISE))
def test_other_templates_are_rendered_whole_and_keep_nothing(name: str) -> None:
    cached, _ = _renderers(NOT_MESSAGE_WISE[name])
    assert cached._shape is None
    _render(cached, [{"role": "user", "content": "hi"}])
    assert cached.stats().entries == 0


def test_an_edited_earlier_turn_or_another_system_prompt_is_rendered_afresh() -> None:
    cached, whole = _renderers(MESSAGE_WISE["smollm2"])
    conversation = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello."},
                    {"role": "assistant", "content": "Hi."}, {"role": "user", "content": "Again."}]
    _render(cached, conversation)
    edited = [*conversation[:2], {"role": "assistant", "content": "Hi!"}, conversation[3],
              {"role": "assistant", "content": "Ok."}]
    assert _render(cached, edited) == _render(whole, edited)
    other_system = [{"role": "system", "content": "Be long."}, *conversation[1:]]
    assert _render(cached, other_system) == _render(whole, other_system)
    renamed = [conversation[0], {**conversation[1], "name": "ann"}, *conversation[2:]]
    assert _render(cached, renamed) == _render(whole, renamed)
    assert cached.stats().hits == 0


def test_other_variables_are_not_reused_across() -> None:
    cached, whole = _renderers(MESSAGE_WISE["bos_before"])
    conversation = [{"role": "user", "content": "Hello."}]
    cached.render(messages=conversation, add_generation_prompt=True, bos_token="<s>", eos_token="</s>")
    longer = [*conversation, {"role": "assistant", "content": "Hi."}]
    assert cached.render(messages=longer, add_generation_prompt=True, bos_token="<s>", eos_token="<e>") == \
        whole.render(messages=longer, add_generation_prompt=True, bos_token="<s>", eos_token="<e>")
    assert cached.stats().hits == 0


def test_messages_that_are_not_dicts_of_strings_are_rendered_whole_and_not_kept() -> None:
    cached, whole = _renderers(MESSAGE_WISE["bos_before"])
    conversation: list[dict[str, object]] = [{"role": "user", "content": ["a", "b"]}]
    assert cached.render(messages=conversation, add_generation_prompt=True) == \
        whole.render(messages=conversation, add_generation_prompt=True)
    assert "['a', 'b']" in whole.render(messages=conversation)
    assert cached.stats().entries == 0


def test_the_cache_stays_within_its_bytes_least_recently_used_out_first() -> None:
    source = MESSAGE_WISE["smollm2"]
    renderer = ChatRenderer(compile_chat_template(source, 0)._template,  # type: ignore[union-attr]
                            source, max_bytes=60_000)
    conversations = [[{"role": "user", "content": f"conversation {i} " + "word " * 2_000}] for i in range(6)]
    for conversation in conversations:
        _render(renderer, conversation)
    stats = renderer.stats()
    assert stats.bytes <= 60_000 and stats.evictions > 0 and stats.entries < 6
    assert stats.bytes == sum(entry.nbytes for _, entry in renderer._lru.values())

    def hits_after(conversation: list[dict[str, str]]) -> int:
        before = renderer.stats().hits
        _render(renderer, [*conversation, {"role": "assistant", "content": "ok"}])
        return renderer.stats().hits - before

    assert hits_after(conversations[-1]) == 1  # the newest is held
    assert hits_after(conversations[0]) == 0  # the oldest went first


def test_off_keeps_nothing() -> None:
    cached = compile_chat_template(MESSAGE_WISE["smollm2"], 0)
    assert cached is not None
    _render(cached, [{"role": "user", "content": "hi"}])
    assert cached.stats().entries == 0 and cached._shape is None


def test_the_tokenizers_stats_carry_its_rendered_turns() -> None:
    tokenizer = GGUFTokenizer(_read_tokenizer(GGUFReader(default_model_path())))
    conversation = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello."}]
    tokenizer.encode(tokenizer.render_chat(conversation))
    follow_up = [*conversation, {"role": "assistant", "content": "Hi."}, {"role": "user", "content": "Again."}]
    tokenizer.encode(tokenizer.render_chat(follow_up))
    stats = tokenizer.tokenize_stats()
    assert stats is not None and stats.rendered is not None and stats.cache is not None
    assert (stats.rendered.renders, stats.rendered.hits, stats.rendered.entries) == (2, 1, 1)
    assert stats.cache.hits == 1
