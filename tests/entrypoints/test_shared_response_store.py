"""Two orchestrator processes sharing one Redis store, as two replicas behind a Kubernetes Service: every turn of a
conversation goes to the other one, and each finds the turn before, reads and deletes what the other stored.

Real ``disagg-serve`` subprocesses, a real Redis, the official client. One takes the store's URL on its command
line, the other from ``DISAGG_RESPONSE_STORE_URL`` (what the Helm chart sets from a Secret)."""

from __future__ import annotations

from pathlib import Path

import openai
import pytest

from bench.driver.common import Processes, child_env, free_port, orchestrator_config, wait_healthy, worker_args


def test_each_turn_on_the_other_orchestrator_continues_the_conversation(tmp_path: Path, redis_url: str) -> None:
    ports = [free_port() for _ in range(4)]
    with Processes(log_dir=tmp_path) as processes:
        ctx = processes.disagg_serve("ctx", worker_args("context", "synthetic", ports[0]), ports[0])
        gen = processes.disagg_serve("gen", worker_args("generation", "synthetic", ports[1]), ports[1])
        replicas = []
        for n, port in enumerate(ports[2:]):
            config = orchestrator_config(tmp_path / f"orchestrator-{n}.yaml", port, [ctx.url], [gen.url])
            argv = ["orchestrator", "--config", str(config)]
            if n == 0:
                replicas.append(processes.disagg_serve(f"orchestrator-{n}", [*argv, "--response-store-url",
                                                                               redis_url], port))
            else:
                replicas.append(processes.disagg_serve(f"orchestrator-{n}", argv, port,
                                                       child_env(DISAGG_RESPONSE_STORE_URL=redis_url)))
        wait_healthy([ctx, gen, *replicas], 60)
        clients = [openai.OpenAI(base_url=r.url + "/v1", api_key="test", max_retries=0, timeout=30)
                   for r in replicas]
        turns = [clients[0].responses.create(model="synthetic", input="Hello", max_output_tokens=2)]
        for n in range(1, 6):
            turns.append(clients[n % 2].responses.create(model="synthetic", input=f"And then {n}?",
                                                         previous_response_id=turns[-1].id, max_output_tokens=2))
        inputs = [turn.usage.input_tokens for turn in turns if turn.usage is not None]
        assert len(inputs) == 6 and inputs == sorted(set(inputs))  # each turn carried the whole conversation
        for n, turn in enumerate(turns):
            assert clients[(n + 1) % 2].responses.retrieve(turn.id).output_text == turn.output_text
        clients[1].responses.delete(turns[0].id)
        with pytest.raises(openai.NotFoundError):
            clients[0].responses.retrieve(turns[0].id)
        # Entries are self-contained: deleting the first turn shortens no later conversation.
        later = clients[0].responses.create(model="synthetic", input="Still there?",
                                            previous_response_id=turns[-1].id, max_output_tokens=2)
        assert later.usage is not None and later.usage.input_tokens > inputs[-1]
        for client in clients:
            client.close()
