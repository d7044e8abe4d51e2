"""``--tool-call-parser``: a worker reads ``tool_choice: "auto"`` answers in the format it names, else in the one its
model's chat template declares; a name no parser has is refused at the command line, naming the known ones."""

from __future__ import annotations

import pytest

from entrypoints.arguments import build_parser
from frontend.metrics import Metrics
from frontend.openai_models import ChatCompletionRequest
from frontend.tool_parsers import FORMATS
from workers.engines.synthetic import SyntheticEngine
from workers.service import WorkerService
from workers.settings import WorkerSettings

AUTO = ChatCompletionRequest.model_validate({"model": "m", "messages": [{"role": "user", "content": "hi"}],
                                             "tools": [{"type": "function", "function": {"name": "f"}}]})


def test_the_flag_names_a_parser_and_refuses_others(capsys: pytest.CaptureFixture[str]) -> None:
    assert build_parser().parse_args(["worker", "--tool-call-parser", "mistral"]).tool_call_parser == "mistral"
    assert build_parser().parse_args(["worker"]).tool_call_parser is None
    with pytest.raises(SystemExit):
        build_parser().parse_args(["worker", "--tool-call-parser", "pythonic"])
    assert "hermes" in capsys.readouterr().err


@pytest.mark.parametrize(("flag", "expected"), [("mistral", "mistral"), ("llama3_json", "llama3_json"),
                                                (None, "hermes")])  # the synthetic engine's bytes have no template
def test_a_worker_reads_auto_answers_in_the_format_the_flag_names(flag: str | None, expected: str) -> None:
    service = WorkerService(SyntheticEngine(), WorkerSettings(tool_call_parser=flag), Metrics())
    calling = service.tool_calling(AUTO, None)
    assert calling is not None and calling.format is FORMATS[expected]
