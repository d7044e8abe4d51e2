"""docs/conformance.md's table, checked against the suite and against ``frontend.openai_parameters``: every
parameter the server treats specially has a row, every row marked refused is refused by a test here, and every row
marked supported names a parameter the suite sends."""

from __future__ import annotations

import pathlib
import re

from frontend.openai_parameters import UNSUPPORTED_BY_ENDPOINT
from tests.conformance.test_sdk_fields import (
    CHAT_FIELDS,
    COMPLETION_FIELDS,
    NEUTRAL_CHAT_VALUES,
    REFUSED_CHAT_VALUES,
    REFUSED_COMPLETIONS_VALUES,
    REFUSED_RESPONSES_VALUES,
    RESPONSES_FIELDS,
)

DOC = pathlib.Path(__file__).parents[2] / "docs" / "conformance.md"
# Rows proved by a test of their own rather than by the parameter lists, and the test that proves each.
PROVED_ELSEWHERE = {
    "messages[].audio": "test_sdk_fields.test_a_message_with_audio_is_refused_naming_it",
    "input": "test_sdk_fields.test_responses_input_items_this_server_cannot_render_are_refused",
    "messages[].name": "test_sdk_fields.test_multi_turn_with_the_sdks_own_message_dump",
    "messages[].tool_calls": "test_sdk_fields.test_tool_call_history_is_accepted_whole_and_streamed",
    "function_call": "test_sdk_fields.test_tool_call_history_is_accepted_whole_and_streamed",
    "messages[]": "test_sdk_fields.test_tool_call_history_is_accepted_whole_and_streamed",
    "tool_call_id": "test_sdk_fields.test_tool_call_history_is_accepted_whole_and_streamed",
    "messages[].refusal": "test_sdk_fields.test_multi_turn_with_the_sdks_own_message_dump",
    "annotations": "test_sdk_fields.test_tool_call_history_is_accepted_whole_and_streamed",
    "reasoning_content": "test_sdk_fields.test_tool_call_history_is_accepted_whole_and_streamed",
    "echo": "test_logprob_conformance.test_echo_gives_every_prompt_token_its_text_and_logprob",
    "prompt_logprobs": "test_logprob_conformance.test_prompt_logprobs_are_returned_and_disaggregated_equals_aggregated",
    "system_fingerprint": "test_response_details.test_whole_answers_carry_the_fingerprint_and_cached_tokens",
    "usage.prompt_tokens_details.cached_tokens": "test_cached_tokens.test_a_repeated_long_prompt_reports_its_reused",
    "GET /v1/models/{id}": "test_status_codes.test_models_retrieve_works_everywhere",
    "GET /v1/responses/{id}": "test_responses_multi_turn.test_a_stored_response_can_be_retrieved_and_deleted",
    "DELETE /v1/responses/{id}": "test_responses_multi_turn.test_a_stored_response_can_be_retrieved_and_deleted",
    "n": "test_n_conformance.test_n_choices_disaggregated_equal_aggregated",
    "tools": "test_responses_tools.test_a_bad_tools_request_is_a_400_naming_the_parameter",  # a built-in tool's type
}


def table() -> list[tuple[list[str], str]]:
    rows = []
    for line in DOC.read_text().splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) != 4 or cells[0] in ("parameter", "---"):
            continue
        rows.append((re.findall(r"`([^`]+)`", cells[0]), cells[2]))
    return rows


def test_every_specially_treated_parameter_has_a_row() -> None:
    documented = {name for names, _ in table() for name in names}
    special = {name for names in UNSUPPORTED_BY_ENDPOINT.values() for name in names}
    assert special - documented == set()


def test_every_row_says_supported_refused_or_null_only() -> None:
    assert {support for _, support in table()} <= {"supported", "refused (400)", "null only"}


def test_every_refused_row_is_refused_by_the_suite() -> None:
    refused = {name for name, _ in REFUSED_CHAT_VALUES + REFUSED_RESPONSES_VALUES + REFUSED_COMPLETIONS_VALUES}
    for names, support in table():
        if support != "supported":
            assert set(names) - refused - PROVED_ELSEWHERE.keys() == set(), names


def test_every_supported_row_is_sent_by_the_suite() -> None:
    sent = set(CHAT_FIELDS) | set(COMPLETION_FIELDS) | set(RESPONSES_FIELDS) | {n for n, _ in NEUTRAL_CHAT_VALUES}
    for names, support in table():
        if support == "supported":
            assert set(names) - sent - PROVED_ELSEWHERE.keys() == set(), names
