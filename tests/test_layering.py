"""The layering contract (``[tool.importlinter]`` in pyproject.toml), checked on the real source tree.

Entry points on top may import everything; ``orchestrator`` and ``workers`` never import each other; the shared
layer (``frontend``) imports neither; ``workers.engines`` imports no HTTP server module; the upstream client's
interface (``orchestrator.upstream.base``) imports none of its clients, and the upstream package has no import
cycle; Anthropic's wire (``frontend.anthropic``) stays at the edge, out of the flow, the worker protocols and the
worker's service and renderer. A second test proves the contract bites: the same configuration over a small tree
that breaks each rule reports every break. And no module imports uvicorn's submodules (its protocol and cycle
classes are private code: docs/http.md); only ``entrypoints.http`` imports uvicorn at all.
"""

from __future__ import annotations

import ast
import os
import subprocess
import sys
import tomllib
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def _lint_imports(cwd: Path, extra_path: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(extra_path)}
    code = "import sys; from importlinter.cli import lint_imports; sys.exit(lint_imports(no_cache=True, no_logo=True))"
    return subprocess.run([sys.executable, "-c", code], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=300, check=False)


def test_the_source_tree_keeps_every_layering_contract() -> None:
    result = _lint_imports(REPO, REPO)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "0 broken" in result.stdout


def test_the_contract_reports_each_kind_of_break(tmp_path: Path) -> None:
    files = {
        "bench/__init__.py": "",
        "bench/driver/__init__.py": "",
        "bench/driver/common.py": "import bench.peers.mock_workers\n",  # the driver, a peer
        "bench/peers/__init__.py": "",
        "bench/peers/mock_workers.py": "",
        "entrypoints/__init__.py": "",
        "entrypoints/cli.py": "import orchestrator.flow\nimport workers.server\n",  # allowed: on top
        "entrypoints/http/__init__.py": "import uvicorn\n",  # allowed: the HTTP server
        "entrypoints/launcher.py": "import uvicorn\n",  # uvicorn outside the HTTP server
        "frontend/__init__.py": "",
        "frontend/shared.py": "import workers.server\n",  # the shared layer imports a service
        "frontend/anthropic/__init__.py": "",
        "frontend/anthropic/stream.py": "",
        "orchestrator/__init__.py": "",
        "orchestrator/flow/__init__.py": "import workers.engines.engine\n",  # one service imports the other
        "orchestrator/flow/steps.py": "import orchestrator.protocols.trtllm.wire\n",  # the flow names a protocol
        "orchestrator/protocols/__init__.py": "",
        "orchestrator/protocols/base.py": "import orchestrator.protocols.native\n",  # the interface, its implementation
        "orchestrator/protocols/native.py": "",
        "orchestrator/protocols/vllm.py": "",
        "orchestrator/protocols/registry.py": "",
        "orchestrator/protocols/choice.py": "",
        "orchestrator/protocols/trtllm/__init__.py": "",
        "orchestrator/protocols/trtllm/wire.py": "",
        "orchestrator/upstream/__init__.py": "",
        "orchestrator/upstream/base.py": "import orchestrator.upstream.httptools.pool\n",  # the interface, a client
        "orchestrator/upstream/choice.py": "",
        "orchestrator/upstream/aiohttp.py": "",
        "orchestrator/upstream/httptools/__init__.py": "",
        "orchestrator/upstream/httptools/pool.py": "",
        "orchestrator/upstream/httptools/stream.py": "import orchestrator.upstream.httptools.pool\n",  # its pool
        "orchestrator/upstream/httptools/connection.py": "",
        "workers/__init__.py": "",
        "workers/server.py": "import frontend.shared\n",
        "workers/service.py": "import frontend.anthropic.stream\n",  # the path speaks an edge's wire
        "workers/registration.py": "",
        "workers/engines/__init__.py": "",
        "workers/engines/engine.py": "import workers.server\nimport entrypoints.cli\n",  # HTTP server; a launcher
        "workers/rendering.py": "",
        "workers/dialects.py": "import workers.trtllm.answers\n",  # the interface, its implementation
        "workers/trtllm/__init__.py": "",
        "workers/trtllm/answers.py": "import workers.service\n",  # the variant reaches back into the path
    }
    for name, text in files.items():
        path = tmp_path / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    config = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["importlinter"]
    contracts = config["contracts"]
    lines = ["[importlinter]", "root_packages =", *(f"    {p}" for p in config["root_packages"]),
             "include_external_packages = True"]
    for index, contract in enumerate(contracts):
        lines.append(f"[importlinter:contract:{index}]")
        for key, value in contract.items():
            lines.append(f"{key} =" + "".join(f"\n    {v}" for v in value) if isinstance(value, list)
                         else f"{key} = {value}")
    (tmp_path / ".importlinter").write_text("\n".join(lines) + "\n")
    result = _lint_imports(tmp_path, tmp_path)
    assert result.returncode == 1, result.stdout + result.stderr
    assert f"{len(contracts)} broken" in result.stdout, result.stdout
    for broken in ("bench.driver.common -> bench.peers.mock_workers",
                   "frontend.shared -> workers.server", "entrypoints.launcher -> uvicorn",
                   "orchestrator.flow -> workers.engines.engine",
                   "workers.engines.engine -> entrypoints.cli", "workers.engines.engine -> workers.server",
                   "workers.dialects -> workers.trtllm.answers", "workers.trtllm.answers -> workers.service",
                   "orchestrator.upstream.base -> orchestrator.upstream.httptools.pool",
                   "orchestrator.upstream.httptools.stream -> orchestrator.upstream.httptools.pool",
                   "orchestrator.flow.steps -> orchestrator.protocols.trtllm.wire",
                   "orchestrator.protocols.base -> orchestrator.protocols.native",
                   "workers.service -> frontend.anthropic.stream"):
        assert broken in result.stdout, result.stdout


# What a module may import of uvicorn: its public ``Config`` and ``Server`` (through ``import uvicorn``). Its
# protocol and cycle classes are private code (docs/http.md): the connection is the project's own protocol's.
_UVICORN_ALLOWED = {"uvicorn"}


def uvicorn_imports(source: str) -> list[str]:
    """The uvicorn modules ``source`` imports, by name."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found += [alias.name for alias in node.names if alias.name.split(".")[0] == "uvicorn"]
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "uvicorn":
            found.append(node.module)
    return found


def test_no_module_imports_uvicorns_internals() -> None:
    offending = {}
    for package in ("entrypoints", "frontend", "orchestrator", "workers", "bench", "tests"):
        for path in (REPO / package).rglob("*.py"):
            names = [name for name in uvicorn_imports(path.read_text()) if name not in _UVICORN_ALLOWED]
            if names:
                offending[str(path.relative_to(REPO))] = names
    assert offending == {}


def test_the_uvicorn_import_check_sees_each_form() -> None:
    assert uvicorn_imports("import uvicorn\nfrom uvicorn.protocols.http.httptools_impl import STATUS_LINE\n"
                           "import uvicorn.server as s\nfrom uvicorn import Config\nimport json\n") == \
        ["uvicorn", "uvicorn.protocols.http.httptools_impl", "uvicorn.server", "uvicorn"]
