"""Which parser reads a model's calls: the one ``--tool-call-parser`` names, else the chat template's."""

from __future__ import annotations

import orjson
import pytest

from frontend.tool_parsers import DEFAULT_FORMAT, FORMATS, UnknownToolCallParser, choose_format, format_of_template
from frontend.tool_parsers.base import parse_whole
from tests.workers.engines.reference.tiny_model import CHAT_TEMPLATE

QWEN_LIKE = ("{% if tools %}...<tool_call>\\n{\"name\": <function-name>, \"arguments\": <args-json-object>}\\n"
             "</tool_call>{% endif %}")
MISTRAL_LIKE = "{% if message.tool_calls %}[TOOL_CALLS][{% for tool in message.tool_calls %}...{% endif %}"
LLAMA_LIKE = "{% if builtin_tools %}<|python_tag|>{% endif %}{{- '{\"name\": \"' + tool_call.name }}"


@pytest.mark.parametrize(("template", "name"), [(QWEN_LIKE, "hermes"), (MISTRAL_LIKE, "mistral"),
                                                (LLAMA_LIKE, "llama3_json")])
def test_a_template_that_writes_calls_gets_its_format(template: str, name: str) -> None:
    assert format_of_template(template) is FORMATS[name]


def test_a_template_that_knows_no_tools_gets_the_format_the_prompt_asks_for() -> None:
    assert format_of_template(CHAT_TEMPLATE) is FORMATS[DEFAULT_FORMAT] is FORMATS["hermes"]
    assert format_of_template(None) is FORMATS["hermes"]


def test_a_template_whose_calls_no_parser_reads_gets_none() -> None:
    assert format_of_template("{% for tool in tools %}<|tool_call|>{{ tool.name }}{% endfor %}") is None


def test_the_flag_wins_and_an_unknown_name_says_the_known_ones() -> None:
    assert choose_format("mistral", QWEN_LIKE) is FORMATS["mistral"]
    assert choose_format(None, QWEN_LIKE) is FORMATS["hermes"]
    with pytest.raises(UnknownToolCallParser, match="hermes, llama3_json, mistral"):
        choose_format("pythonic", None)


@pytest.mark.parametrize("name", sorted(FORMATS))
def test_each_format_reads_back_the_history_it_writes(name: str) -> None:
    # Earlier calls are written into the prompt in the model's format: what it is asked to write, it reads back.
    written = FORMATS[name].calls_text([("weather", {"city": "Oslo"}), ("time", {})])
    parsed = parse_whole(FORMATS[name].parser(True, {"weather", "time"}), written)
    assert parsed is not None and parsed.content is None
    assert [(call.name, orjson.loads(call.arguments)) for call in parsed.calls] == [("weather", {"city": "Oslo"}),
                                                                                    ("time", {})]
