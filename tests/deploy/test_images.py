"""The images: one Dockerfile per service, built from the repository root, each stage's entry
command naming a module that exists and starts (``--help``, in this environment), the Makefile
building every image the overlays run, and the build context holding what the Dockerfiles copy.
No image is built here."""

from __future__ import annotations

import fnmatch
import importlib.util
import os
import re
import shlex
import subprocess
import sys
import tomllib

from packaging.specifiers import SpecifierSet

from tests.deploy.manifests import (
    OVERLAYS,
    ROOT,
    SERVICES,
    Stage,
    containers,
    one,
    render,
    stages,
)

# Which Dockerfile and stage builds each image name the overlays can run (base and components).
BUILDS = {
    "tinsmith/gateway": ("gateway", None),
    "tinsmith/checkpoint": ("checkpoint", None),
    "tinsmith/trainer": ("trainer", None),
    "tinsmith/trainer-cuda": ("trainer", None),
    "tinsmith/sampler": ("sampler", None),
    "tinsmith/sampler-cuda": ("sampler", "torch"),
    "tinsmith/sampler-vllm": ("sampler", "vllm"),
}


def _stage(service: str, target: str | None) -> Stage:
    found = stages(ROOT / "services" / service / "Dockerfile")
    return found[-1] if target is None else next(s for s in found if s.name == target)


def _module(stage: Stage) -> str:
    command = stage.command
    assert command[:2] == ["python", "-m"], f"{stage.dockerfile}: {command}"
    return command[2]


def test_every_service_has_a_dockerfile_whose_command_is_its_module() -> None:
    for service in SERVICES:
        for stage in stages(ROOT / "services" / service / "Dockerfile"):
            if stage.last("CMD") is None:
                continue  # a stage others build on
            assert _module(stage) == f"services.{service}"
            assert importlib.util.find_spec(_module(stage)) is not None
            user = stage.last("USER")
            assert user is not None and user.split(":")[0] not in ("0", "root"), stage


def test_every_image_command_starts() -> None:
    """``python -m <module> --help`` for each image's command: it imports everything the service
    imports, prints its usage and exits, without connecting to anything."""
    modules = sorted({_module(_stage(*build)) for build in BUILDS.values()})
    env = {**os.environ, "TINSMITH_NATS_URL": "nats://127.0.0.1:1"}
    runs = {
        module: subprocess.Popen(
            [sys.executable, "-m", module, "--help"],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env=env,
            cwd=ROOT,
        )
        for module in modules
    }
    for module, run in runs.items():
        out, _ = run.communicate(timeout=120)
        assert run.returncode == 0, out
        assert out.startswith(f"usage: python -m {module}"), out


def _make_builds() -> dict[str, tuple[str, str | None]]:
    """What ``make images images-cuda`` builds: image -> (Dockerfile's service, --target)."""
    out = subprocess.run(
        ["make", "-n", "images", "images-cuda", "DOCKER=docker"],
        capture_output=True,
        text=True,
        check=True,
        cwd=ROOT,
    ).stdout
    builds: dict[str, tuple[str, str | None]] = {}
    for command in (shlex.split(c) for c in out.replace("\\\n", " ").splitlines()):
        if command[:2] != ["docker", "build"]:
            continue
        assert command[-1] == ".", "build from the repository root"
        options = dict(zip(command[2:-1:2], command[3:-1:2], strict=True))
        if "--build-arg" in options:
            assert options["--build-arg"].startswith("TORCH_INDEX_URL=")
        service = options["-f"].split("/")[1]
        assert options["-f"] == f"services/{service}/Dockerfile"
        builds[options["-t"]] = (service, options.get("--target"))
    return builds


def test_make_builds_every_image_the_overlays_run_with_the_base_tag() -> None:
    version = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
    builds = _make_builds()
    assert builds == {f"{repo}:{version}": build for repo, build in BUILDS.items()}
    for overlay in OVERLAYS:
        for name in SERVICES:
            image = containers(one(render(f"overlays/{overlay}"), "Deployment", name))[0]["image"]
            assert image in builds, (overlay, image)


def test_the_build_context_holds_what_the_dockerfiles_copy() -> None:
    patterns = [
        line.strip()
        for line in (ROOT / ".dockerignore").read_text().splitlines()
        if line.strip() and not line.startswith("#")
    ]

    def ignored(path: str) -> bool:
        result = False
        for pattern in patterns:
            negate = pattern.startswith("!")
            bare = pattern.lstrip("!").rstrip("/")
            if fnmatch.fnmatch(path, bare) or path.startswith(bare + "/"):
                result = not negate
        return result

    for service in SERVICES:
        for stage in stages(ROOT / "services" / service / "Dockerfile"):
            for instruction, argument in stage.instructions:
                if instruction != "COPY" or "--from" in argument:
                    continue
                for source in argument.split()[:-1]:
                    assert (ROOT / source).exists(), source
                    assert not ignored(source), f".dockerignore leaves out {source}"


def test_every_image_runs_a_python_the_project_accepts() -> None:
    """Each Dockerfile's default base image is a Python within pyproject.toml's requires-python."""
    accepted = SpecifierSet(
        tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["requires-python"]
    )
    for service in SERVICES:
        text = (ROOT / "services" / service / "Dockerfile").read_text()
        images = re.findall(r"^ARG PYTHON_IMAGE=python:(\d+\.\d+)\S*$", text, re.MULTILINE)
        assert len(images) == 1, f"{service}: one ARG PYTHON_IMAGE=python:X.Y..."
        assert accepted.contains(images[0]), (service, images[0], str(accepted))


def _chain(stage: Stage) -> list[Stage]:
    """The stage and those it is built FROM, within its Dockerfile."""
    found = {s.name: s for s in stages(stage.dockerfile)}
    chain = [stage]
    while (parent := stage.instructions[0][1].split()[0]) in found:
        stage = found[parent]
        chain.append(stage)
    return chain


def test_the_cuda_images_ask_the_nvidia_runtime_for_cuda() -> None:
    """A base image that is not NVIDIA's has no NVIDIA_DRIVER_CAPABILITIES of its own; some
    container runtimes then mount only NVML, not the CUDA driver, and TINSMITH_DEVICE=cuda
    (components/gpu) would stop the engine at start."""
    for image, build in BUILDS.items():
        if not image.endswith(("-cuda", "-vllm")):
            continue
        env = " ".join(
            argument
            for stage in _chain(_stage(*build))
            for instruction, argument in stage.instructions
            if instruction == "ENV"
        )
        capabilities = re.search(r"\bNVIDIA_DRIVER_CAPABILITIES=(\S+)", env)
        assert capabilities, f"{image}: no NVIDIA_DRIVER_CAPABILITIES"
        assert {"compute", "utility"} <= set(capabilities.group(1).split(",")), image
