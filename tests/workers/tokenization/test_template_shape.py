"""Which chat templates render message by message, read from their syntax tree, and why the others do not."""

from __future__ import annotations

import pytest
from jinja2.sandbox import ImmutableSandboxedEnvironment

from tests.workers.tokenization.test_rendered_turns import MESSAGE_WISE, NOT_MESSAGE_WISE
from workers.tokenization.template_shape import MessageWise, message_wise

WHY = {
    "latest_marked": "loop.index", "last": "loop.last", "count": "loop.index", "length": "the messages as a whole",
    "last_message": "other than the first", "namespace": "Assign", "generation_prompt_in_loop": "add_generation_prompt",
    "random": "'random'", "two_loops": "no single top-level loop", "changed": "calls something other than",
    "system_outside": "outside its loop",
}


def _environment() -> ImmutableSandboxedEnvironment:
    return ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)


@pytest.mark.parametrize("name", list(MESSAGE_WISE))
def test_message_wise_templates_split_into_before_loop_and_after(name: str) -> None:
    shape = message_wise(_environment(), MESSAGE_WISE[name])
    assert isinstance(shape, MessageWise)
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]
    variables = {"add_generation_prompt": True, "bos_token": "<s>", "eos_token": "</s>"}
    whole = _environment().from_string(MESSAGE_WISE[name]).render(messages=messages, **variables)
    loop_variables = {"bos_token": "<s>", "eos_token": "</s>"}
    assert whole == (shape.before.render(**variables) + shape.loop.render(messages=messages, **loop_variables)
                     + shape.after.render(**variables))


@pytest.mark.parametrize("name", list(NOT_MESSAGE_WISE))
def test_other_templates_are_refused_with_the_reason(name: str) -> None:
    refusal = message_wise(_environment(), NOT_MESSAGE_WISE[name])
    assert isinstance(refusal, str) and WHY[name] in refusal, refusal


def test_a_template_that_does_not_parse_is_refused() -> None:
    assert "does not parse" in str(message_wise(_environment(), "{% for %}"))
