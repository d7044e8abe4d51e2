"""Just enough of a Dockerfile reader for the tests to take the image's entrypoint, environment and health check
from deploy/Dockerfile itself, rather than restating them (hadolint lints it; this only reads it)."""

from __future__ import annotations

import json
import shlex
from dataclasses import dataclass
from pathlib import Path

from tests.deploy.local_run import REPO

DOCKERFILE = REPO / "deploy" / "Dockerfile"


@dataclass(frozen=True)
class Instruction:
    keyword: str  # upper case: FROM, RUN, ENV, ...
    arguments: str  # continuation lines joined, comments dropped


def instructions(text: str) -> list[Instruction]:
    result: list[Instruction] = []
    pending = ""
    for raw in text.splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        keyword, _, arguments = (pending + line).partition(" ")
        result.append(Instruction(keyword.upper(), arguments.strip()))
        pending = ""
    return result


@dataclass(frozen=True)
class Image:
    """The final stage of deploy/Dockerfile, as a container started from it sees it."""

    stages: list[list[Instruction]]

    @classmethod
    def read(cls, path: Path = DOCKERFILE) -> Image:
        stages: list[list[Instruction]] = []
        for instruction in instructions(path.read_text()):
            if instruction.keyword == "FROM":
                stages.append([])
            if stages:
                stages[-1].append(instruction)
        return cls(stages)

    @property
    def final(self) -> list[Instruction]:
        return self.stages[-1]

    def last(self, keyword: str) -> str:
        found = [i.arguments for i in self.final if i.keyword == keyword]
        assert found, f"the final stage has no {keyword}"
        return found[-1]

    @property
    def entrypoint(self) -> list[str]:
        value = json.loads(self.last("ENTRYPOINT"))  # exec form only: a shell form would swallow SIGTERM
        assert isinstance(value, list)
        return [str(v) for v in value]

    @property
    def disagg_environment(self) -> dict[str, str]:
        """The DISAGG_* settings the image bakes in (ENV k=v ...)."""
        env: dict[str, str] = {}
        for instruction in self.final:
            if instruction.keyword == "ENV":
                for pair in shlex.split(instruction.arguments):
                    key, _, value = pair.partition("=")
                    if key.startswith("DISAGG_"):
                        env[key] = value
        return env

    @property
    def healthcheck_command(self) -> list[str]:
        """HEALTHCHECK [options] CMD ["exec", "form"]: the command, as a runtime runs it."""
        options, _, command = self.last("HEALTHCHECK").partition("CMD ")
        assert options.strip().startswith("--"), f"HEALTHCHECK without timing options: {options!r}"
        value = json.loads(command)
        assert isinstance(value, list)
        return [str(v) for v in value]
