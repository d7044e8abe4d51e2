"""Our orchestrator in front of two plain vLLM OpenAI servers, a prefill (P) and a decode (D) instance sharing
ExampleConnector's folder, speaking vLLM's P/D protocol (``protocol: vllm``): the answer equals a single vLLM
instance's, token for token, whole and streamed, and D loads the prompt's KV instead of computing it."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.cluster import Node, start_orchestrator
from tests.vllm.answers import ASK, Answer, case_variant, reference_answers, sdk_client
from tests.vllm.availability import needs_vllm
from tests.vllm.processes import EXTERNAL_HITS, VllmProcess, example_connector, vllm_api_server, vllm_processes
from tests.vllm.prompts import MODEL

pytestmark = needs_vllm


@dataclass
class Fleet:
    prefill: VllmProcess
    decode: VllmProcess
    orchestrator: Node
    single: dict[tuple[str, bool], Answer]  # what one vLLM instance answers by itself


@pytest.fixture(scope="module")
def fleet(hf_checkpoint: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    connector = example_connector(tmp_path_factory.mktemp("vllm-fleet-kv"))
    logs = tmp_path_factory.mktemp("vllm-fleet")
    with contextlib.ExitStack() as stack:
        prefill, decode = stack.enter_context(vllm_processes(
            (vllm_api_server(hf_checkpoint, MODEL, connector), logs / "p.log"),
            (vllm_api_server(hf_checkpoint, MODEL, connector), logs / "d.log")))
        with sdk_client(prefill.url) as client:  # P alone is an ordinary vLLM server: the aggregated answer
            single = reference_answers(client)
        group = {"urls": [prefill.url], "protocol": "vllm"}
        orchestrator = start_orchestrator(stack, [prefill.url], [decode.url], request_timeout_s=600,
                                          context_servers=group,
                                          generation_servers={"urls": [decode.url], "protocol": "vllm"})
        yield Fleet(prefill, decode, orchestrator, single)


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
@pytest.mark.parametrize("endpoint", ["chat", "completions"])
def test_orchestrated_pd_equals_one_vllm_server(fleet: Fleet, endpoint: str, stream: bool) -> None:
    hits_before = fleet.decode.metric(EXTERNAL_HITS)
    with sdk_client(fleet.orchestrator.url) as client:
        answer = ASK[endpoint](client, stream, case_variant(endpoint, stream))
    expected = fleet.single[endpoint, stream]
    assert expected.completion_tokens > 1  # the first token did not end it: the decode side had work to do
    assert answer.tokens == expected.tokens
    assert answer.text == expected.text
    assert answer.completion_tokens == expected.completion_tokens
    # D's vLLM loaded the prompt's KV through the connector (at least one 128-token block) instead of computing it.
    assert fleet.decode.loaded_external_kv(hits_before), fleet.decode.metric(EXTERNAL_HITS) - hits_before
