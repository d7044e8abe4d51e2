"""The ``disagg-serve`` command line: help, configuration errors, and one real ``up`` run end to end."""

from __future__ import annotations

import contextlib
import os
import pathlib
import queue
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator

import openai
import pytest

from entrypoints.arguments import build_parser, engine_arguments
from entrypoints.cli import main
from entrypoints.launcher import worker_engine_arguments

REPO = pathlib.Path(__file__).resolve().parents[2]


def clean_env() -> dict[str, str]:
    """This environment without DISAGG_* settings, which the CLI would take as defaults."""
    return {k: v for k, v in os.environ.items() if not k.startswith("DISAGG_")}


def test_console_script_help() -> None:
    script = pathlib.Path(sys.executable).with_name("disagg-serve")
    result = subprocess.run([str(script), "--help"], capture_output=True, text=True, timeout=60, env=clean_env())
    assert result.returncode == 0
    for command in ("worker", "orchestrator", "up"):
        assert command in result.stdout


@pytest.mark.parametrize("command", ["worker", "orchestrator", "up"])
def test_each_subcommand_help_exits_0(command: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        main([command, "--help"])
    assert exited.value.code == 0
    assert f"usage: disagg-serve {command}" in capsys.readouterr().out


@pytest.mark.parametrize(
    "argv",
    [
        ["worker", "--role", "decode"],
        ["worker", "--engine", "gpt"],
        ["worker", "--synthetic-ttft-ms", "-5"],
        ["orchestrator"],
        ["teleport"],
        [],
    ],
)
def test_bad_arguments_exit_2(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        main(argv)
    assert exited.value.code == 2
    assert "usage:" in capsys.readouterr().err


def run_cli(*argv: str, timeout_s: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "entrypoints.cli", *argv], capture_output=True, text=True,
                          timeout=timeout_s, cwd=REPO, env=clean_env())


def test_orchestrator_with_an_unknown_config_key_exits_naming_it(tmp_path: pathlib.Path) -> None:
    config = tmp_path / "bad.yaml"
    config.write_text("context_servers: {urls: ['http://127.0.0.1:1']}\n"
                      "generation_servers: {urls: ['http://127.0.0.1:2']}\n"
                      "gen_tokids_metadata_onyl: true\n")
    result = run_cli("orchestrator", "--config", str(config))
    assert result.returncode != 0
    assert "gen_tokids_metadata_onyl" in result.stderr
    assert "unknown key" in result.stderr


def test_orchestrator_with_a_missing_config_file_exits_non_zero(tmp_path: pathlib.Path) -> None:
    result = run_cli("orchestrator", "--config", str(tmp_path / "absent.yaml"))
    assert result.returncode != 0
    assert "absent.yaml" in result.stderr


def test_engine_arguments_round_trip_to_a_worker_command_line() -> None:
    parser = build_parser()
    up = parser.parse_args(["up", "--engine", "synthetic", "--synthetic-ttft-ms", "5", "--synthetic-itl-ms", "1.5",
                            "--served-model-name", "m", "--synthetic-output-tokens", "7", "--kv-block-reuse"])
    worker = parser.parse_args(["worker", *engine_arguments(up)])
    for name in ("engine", "synthetic_ttft_ms", "synthetic_itl_ms", "served_model_name", "synthetic_output_tokens",
                 "kv_block_reuse"):
        assert getattr(worker, name) == getattr(up, name), name


def test_vllm_memory_arguments_round_trip_to_a_worker_command_line() -> None:
    parser = build_parser()
    up = parser.parse_args(["up", "--engine", "vllm", "--kv-cache-memory-bytes", "3G",
                            "--gpu-memory-utilization", "0.4", "--engines-on-host", "3"])
    worker = parser.parse_args(["worker", *engine_arguments(up)])
    assert (worker.kv_cache_memory_bytes, worker.gpu_memory_utilization, worker.engines_on_host) == (3 << 30, 0.4, 3)


def test_up_tells_each_vllm_engine_it_shares_the_host_with_the_other() -> None:
    parser = build_parser()
    # vLLM alone on a CPU reserves 0.92 of the node's memory, so of CTX and GEN the second could never start.
    worker = parser.parse_args(["worker", *worker_engine_arguments(parser.parse_args(["up", "--engine", "vllm"]))])
    assert worker.engines_on_host == 2
    # The user's count, and their own sizes, go through as given (the engine then computes no share).
    mine = parser.parse_args(["up", "--engine", "vllm", "--engines-on-host", "4", "--kv-cache-memory-bytes", "1G"])
    worker = parser.parse_args(["worker", *worker_engine_arguments(mine)])
    assert (worker.engines_on_host, worker.kv_cache_memory_bytes) == (4, 1 << 30)
    assert "--engines-on-host" not in worker_engine_arguments(parser.parse_args(["up", "--engine", "reference"]))


@pytest.mark.parametrize("argv", [["--kv-cache-memory-bytes", "lots"], ["--gpu-memory-utilization", "1.5"],
                                  ["--engines-on-host", "0"]])
def test_bad_vllm_memory_arguments_exit_2(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as caught:
        build_parser().parse_args(["worker", "--engine", "vllm", *argv])
    assert caught.value.code == 2
    assert argv[0] in capsys.readouterr().err


# -- disagg-serve up, for real ------------------------------------------------------------------------------
def descendants(pid: int) -> set[int]:
    """Every live descendant of ``pid``, from /proc/<pid>/task/*/children."""
    found: set[int] = set()
    pending = [pid]
    while pending:
        parent = pending.pop()
        for children in pathlib.Path(f"/proc/{parent}/task").glob("*/children"):
            with contextlib.suppress(OSError):
                for child in map(int, children.read_text().split()):
                    if child not in found:
                        found.add(child)
                        pending.append(child)
    return found


def is_running(pid: int) -> bool:
    try:
        stat = pathlib.Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"  # a zombie has already exited


def read_lines(stream: Iterator[str], sink: queue.Queue[str]) -> None:
    for line in stream:
        sink.put(line)


def test_up_serves_a_chat_completion_and_stops_cleanly_on_sigterm(tmp_path: pathlib.Path) -> None:
    stderr = (tmp_path / "stderr.log").open("w")
    process = subprocess.Popen(
        [sys.executable, "-m", "entrypoints.cli", "--log-level", "warning", "up", "--engine", "synthetic",
         "--port", "0", "--startup-timeout", "120"],  # port 0: up binds any free one, and says which
        stdout=subprocess.PIPE, stderr=stderr, text=True, cwd=REPO, env=clean_env(),
    )
    children: set[int] = set()
    try:
        assert process.stdout is not None
        lines: queue.Queue[str] = queue.Queue()
        threading.Thread(target=read_lines, args=(process.stdout, lines), daemon=True).start()
        deadline = time.monotonic() + 150
        serving = None
        while serving is None:
            remaining = deadline - time.monotonic()
            assert remaining > 0, "no 'Serving on' within the start-up bound: " + (tmp_path / "stderr.log").read_text()
            assert process.poll() is None, "up exited early: " + (tmp_path / "stderr.log").read_text()
            with contextlib.suppress(queue.Empty):
                serving = re.search(r"Serving on (\S+)", lines.get(timeout=min(remaining, 1.0)))
        url = serving.group(1)
        assert re.fullmatch(r"http://127\.0\.0\.1:[1-9][0-9]*", url), url

        children = descendants(process.pid)
        assert len(children) == 3  # orchestrator, CTX and GEN
        with openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=30) as client:
            chat = client.chat.completions.create(model="synthetic", messages=[{"role": "user", "content": "hi"}],
                                                  max_tokens=9)
        assert chat.choices[0].message.content == "The quick"
        assert chat.usage is not None and chat.usage.completion_tokens == 9

        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=90) == 0
        assert [pid for pid in children if is_running(pid)] == []
    finally:
        for pid in [process.pid, *children]:
            if is_running(pid):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            process.wait(timeout=10)
        if process.stdout is not None:
            process.stdout.close()
        stderr.close()
