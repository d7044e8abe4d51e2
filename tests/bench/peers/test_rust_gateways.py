"""The Rust gateways: the launch commands, the skip-with-a-reason paths (nothing is downloaded here), and, where
the side venv already holds the pinned wheels (``python -m bench.peers.rust_gateways`` installs them), each gateway
streaming the mocks' tokens through with both legs called, and ``bench.orchestrator_cost`` measuring them."""

from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Any

import pytest

from bench.driver.load_point import Phases
from bench.orchestrator_cost import benchmark as orchestrator_cost
from bench.orchestrator_cost import report as orchestrator_cost_report
from bench.peers import rust_gateways

TINY = Phases(warmup_s=0.1, max_warmup_s=5.0, measure_s=0.3, max_measure_s=3.0, tail_s=5.0, max_total_s=20.0,
              quiet_wait_s=0.0)


def test_vllm_router_runs_in_vllm_pd_mode_on_loopback() -> None:
    argv = rust_gateways.VLLM_ROUTER.argv(Path("/venv"), 8000, "http://127.0.0.1:1", "http://127.0.0.1:2", 9000)
    assert argv[0] == "/venv/bin/vllm-router" and argv[1] == "--vllm-pd-disaggregation"
    pairs = dict(zip(argv[2::2], argv[3::2], strict=True))
    assert pairs == {"--host": "127.0.0.1", "--port": "8000", "--prefill": "http://127.0.0.1:1",
                     "--decode": "http://127.0.0.1:2", "--policy": "round_robin", "--prometheus-host": "127.0.0.1",
                     "--prometheus-port": "9000", "--log-level": "warning"}
    assert rust_gateways.VLLM_ROUTER.flavour == "vllm"


def test_smg_launches_in_pd_mode_without_a_tokenizer() -> None:
    argv = rust_gateways.SMG.argv(Path("/venv"), 8000, "http://127.0.0.1:1", "http://127.0.0.1:2", 9000,
                                  policy="cache_aware")
    assert argv[:3] == ["/venv/bin/smg", "launch", "--pd-disaggregation"]
    assert "--disable-tokenizer-autoload" in argv
    assert argv[argv.index("--model-alias") + 1] == "synthetic=mock"  # the clients' model name, the mocks' model
    assert argv[argv.index("--policy") + 1] == "cache_aware" and argv[argv.index("--log-level") + 1] == "warn"
    assert argv[argv.index("--prefill") + 1] == "http://127.0.0.1:1"
    assert argv[argv.index("--decode") + 1] == "http://127.0.0.1:2"
    assert rust_gateways.SMG.flavour == "sglang"


def test_without_install_a_missing_gateway_is_skipped_with_the_reason(tmp_path: Path,
                                                                      capsys: pytest.CaptureFixture[str]) -> None:
    venv = tmp_path / "venv"
    found = rust_gateways.prepare(venv, install=False)
    assert set(found) == {"vllm-router (Rust)", "smg (Rust)"}
    err = capsys.readouterr().err
    for name, availability in found.items():
        assert not availability.available
        assert f"{availability.gateway.package}=={availability.gateway.version} is not installed" in availability.note
        assert f"skipping {name}: {availability.note}" in err
    assert not venv.exists()  # nothing made, nothing downloaded
    assert found["smg (Rust)"].as_dict() == {"package": "smg==1.13.0", "available": False,
                                             "note": found["smg (Rust)"].note}


def test_a_side_venv_that_cannot_be_made_skips_both_gateways_and_says_why(tmp_path: Path,
                                                                         capsys: pytest.CaptureFixture[str]) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    found = rust_gateways.prepare(blocker / "venv", install=True)  # fails before pip could download anything
    for availability in found.values():
        assert not availability.available
        assert availability.note.startswith(f"could not create the side venv {blocker / 'venv'}: exit ")
    err = capsys.readouterr().err
    assert "skipping vllm-router (Rust): could not create the side venv" in err
    assert "skipping smg (Rust): could not create the side venv" in err


def test_installed_versions_of_no_venv_are_none(tmp_path: Path) -> None:
    assert rust_gateways.installed_versions(tmp_path) == {"vllm-router": None, "smg": None}


# -- with the real wheels, where the side venv already has them ------------------------------------------------------
@pytest.fixture(scope="module")
def installed() -> Path:
    found = rust_gateways.installed_versions(rust_gateways.VENV_DIR)
    wanted = {g.package: g.version for g in rust_gateways.GATEWAYS}
    if found != wanted:
        pytest.skip(f"the side venv {rust_gateways.VENV_DIR} does not hold {wanted} (it has {found}); "
                    "`python -m bench.peers.rust_gateways` installs them (the suite downloads nothing)")
    return rust_gateways.VENV_DIR


def test_every_flag_we_pass_is_in_the_gateways_own_help(installed: Path) -> None:
    for gateway, help_argv in ((rust_gateways.VLLM_ROUTER, ["--help"]), (rust_gateways.SMG, ["launch", "--help"])):
        done = subprocess.run([str(installed / "bin" / gateway.script), *help_argv], capture_output=True, text=True,
                              timeout=120, env=rust_gateways._gateway_env())
        assert done.returncode == 0, done.stderr
        flags = [arg for arg in gateway.argv(installed, 1, "http://a", "http://b", 2) if arg.startswith("--")]
        assert flags and all(flag in done.stdout for flag in flags), (gateway.name, flags)


def test_each_gateway_streams_the_mocks_tokens_with_both_legs_called(installed: Path) -> None:
    report = rust_gateways.check(installed, install=False)
    assert set(report) == {"vllm-router (Rust)", "smg (Rust)"}
    for name, seen in report.items():
        for endpoint, answer in seen["answers"].items():
            assert answer == {"status": 200, "frames": 9, "done": True}, (name, endpoint)  # 8 tokens and [DONE]
        assert seen["posts"] == {"ctx": 2, "gen": 2}, name  # one prefill and one decode call per request


@pytest.fixture(scope="module")
def measured(installed: Path) -> dict[str, Any]:
    return orchestrator_cost.run((256,), (1,), TINY, idle_s=0.3, metadata_only=False,
                                 setups=dict(orchestrator_cost.ORCHESTRATORS), endpoints=("chat",),
                                 gateways_venv=installed, install=False)


def test_orchestrator_cost_measures_the_gateways_beside_ours(measured: dict[str, Any]) -> None:
    assert {c["setup"] for c in measured["cells"]} == {"orchestrator", "pass-through", "direct",
                                                         "vllm-router (Rust)", "smg (Rust)"}
    for cell in measured["cells"]:
        assert cell["errors"] == 0 and cell["endpoint"] == "chat", cell["error_samples"]
        assert cell["legs"]["ctx_posts"] >= 1 and cell["legs"]["gen_posts"] >= 1
        if cell["setup"] in orchestrator_cost_report.GATEWAYS:
            assert cell["cpu_ms_per_request"]["proxy"] >= 0
            assert abs(cell["legs"]["ctx_posts"] - cell["legs"]["gen_posts"]) <= 1  # a prefill for each decode
    assert all(g["available"] for g in measured["gateways"].values())
    table = orchestrator_cost_report.tables(measured)
    assert "| 256 | chat | 1 | vllm-router (Rust) |" in table and "| 256 | chat | 1 | smg (Rust) |" in table
    assert "/ best Rust gateway" in table and "| smg (Rust) | smg==1.13.0 | yes |" in table
    rows = [t for t in orchestrator_cost_report.targets(measured) if "best Rust gateway" in t["target"]]
    assert len(rows) == 1 and rows[0]["target"].endswith("at 256 tokens, c=1, chat")
    assert rows[0]["met"] is not None
