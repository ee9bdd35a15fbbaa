"""The tinker-cookbook's chat SFT recipe (``chat_sl``) runs offline and unmodified, from its own
virtual environment, against ``tinsmith up`` on the built-in tiny model: a few steps, a checkpoint,
and a resume from it.

The recipe is the published wheel's ``python -m tinker_cookbook.recipes.chat_sl.train`` with the
conversations file that ships in it. The model is named by the path of the materialised
``tinsmith/tiny`` directory: the cookbook loads the tokenizer from that path itself, offline, and
the server accepts the same path as a base model. ``role_colon`` is the tokenizer-agnostic renderer.
"""

from __future__ import annotations

import json
import math
import re
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import RunningSystem, start_system, stop_system
from tests.cookbook_env import example_conversations, user_environment
from tinsmith import models

RUN_TIMEOUT_S = 300
FIRST_STEPS = 3  # steps 0, 1, 2; the periodic checkpoint is at step 2
SECOND_STEPS = 5
SAVE_EVERY = 2


@dataclass
class RecipeRun:
    returncode: int
    output: str
    metrics: list[dict[str, Any]]  # this run's rows of metrics.jsonl
    checkpoints: list[dict[str, Any]]  # this run's rows of checkpoints.jsonl


@dataclass
class Runs:
    system: RunningSystem
    first: RecipeRun
    resumed_from: dict[str, Any]  # the checkpoint record the second run starts from
    second: RecipeRun


def _jsonl(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _recipe(
    python: Path, system: RunningSystem, work: Path, log_path: Path, max_steps: int, exists: str
) -> RecipeRun:
    metrics_before = len(_jsonl(log_path / "metrics.jsonl"))
    checkpoints_before = len(_jsonl(log_path / "checkpoints.jsonl"))
    env = user_environment(work, "tml-cookbook-e2e")
    command = [
        str(python),
        "-m",
        "tinker_cookbook.recipes.chat_sl.train",
        f"model_name={models.materialize(models.TINY)}",
        "renderer_name=role_colon",
        f"dataset={example_conversations(python)}",
        f"base_url={system.url}",
        "batch_size=4",
        "max_length=256",
        "lora_rank=8",
        f"max_steps={max_steps}",
        "eval_every=0",
        f"save_every={SAVE_EVERY}",
        f"log_path={log_path}",
        f"behavior_if_log_dir_exists={exists}",
    ]
    result = subprocess.run(
        command,
        cwd=work,
        env=env,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        timeout=RUN_TIMEOUT_S,
    )
    return RecipeRun(
        returncode=result.returncode,
        output=result.stdout,
        metrics=_jsonl(log_path / "metrics.jsonl")[metrics_before:],
        checkpoints=_jsonl(log_path / "checkpoints.jsonl")[checkpoints_before:],
    )


@pytest.fixture(scope="module")
def cookbook_system(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningSystem]:
    system = start_system(tmp_path_factory.mktemp("cookbook-tinsmith"))
    yield system
    stop_system(system)


@pytest.fixture(scope="module")
def runs(
    cookbook_python: Path,
    cookbook_system: RunningSystem,
    tmp_path_factory: pytest.TempPathFactory,
) -> Runs:
    work = tmp_path_factory.mktemp("cookbook")
    log_path = work / "chat_sl"
    first = _recipe(cookbook_python, cookbook_system, work, log_path, FIRST_STEPS, "raise")
    assert first.returncode == 0, _failure("first run", first, cookbook_system)

    # A finished run ends with a "final" record (epoch = num_epochs), after which a re-run has
    # nothing left to do. Leave the log as a run interrupted right after its step-2 checkpoint
    # would have: the records up to that one.
    records = _jsonl(log_path / "checkpoints.jsonl")
    names = [r["name"] for r in records]
    assert f"{SAVE_EVERY:06d}" in names, names
    kept = records[: names.index(f"{SAVE_EVERY:06d}") + 1]
    (log_path / "checkpoints.jsonl").write_text("".join(json.dumps(r) + "\n" for r in kept))

    second = _recipe(cookbook_python, cookbook_system, work, log_path, SECOND_STEPS, "resume")
    assert second.returncode == 0, _failure("resumed run", second, cookbook_system)
    return Runs(cookbook_system, first, kept[-1], second)


def _failure(what: str, run: RecipeRun, system: RunningSystem) -> str:
    return f"{what} exited {run.returncode}:\n{run.output[-8000:]}\n\nserver logs:\n{system.logs()}"


_PATH = re.compile(r"tinker://(?P<run>[^/]+)/(?P<segment>weights|sampler_weights)/(?P<name>[^/]+)")


def _run_of(record: dict[str, Any]) -> str:
    """The training run both of the record's paths belong to, checking their form."""
    state = _PATH.fullmatch(record["state_path"])
    sampler = _PATH.fullmatch(record["sampler_path"])
    assert state and sampler, record
    assert (state["segment"], state["name"]) == ("weights", record["name"])
    assert (sampler["segment"], sampler["name"]) == ("sampler_weights", record["name"])
    assert state["run"] == sampler["run"]
    return state["run"]


def _assert_finite_losses(run: RecipeRun) -> None:
    for row in run.metrics:
        for key in ("train_mean_nll", "train_mean_bpb"):
            assert math.isfinite(row[key]) and row[key] > 0, row
        assert row["num_sequences"] == 4, row


def test_the_recipe_trains_a_few_steps_and_saves_checkpoints(runs: Runs) -> None:
    first = runs.first
    assert [row["step"] for row in first.metrics] == list(range(FIRST_STEPS))
    _assert_finite_losses(first)
    # the linear schedule starts at the recipe's default learning rate and decays each step
    rates = [row["learning_rate"] for row in first.metrics]
    assert rates[0] == pytest.approx(1e-4) and rates == sorted(rates, reverse=True)

    assert [r["name"] for r in first.checkpoints] == [f"{SAVE_EVERY:06d}", "final"]
    assert {_run_of(r) for r in first.checkpoints} == {_run_of(runs.resumed_from)}
    run, name = _run_of(runs.resumed_from), runs.resumed_from["name"]
    for segment in ("weights", "sampler_weights"):
        stored = runs.system.data_dir / "blobs" / "runs" / run / segment / name
        assert (stored / "adapter_model.safetensors").is_file(), stored


def test_a_second_run_resumes_from_the_checkpoint(runs: Runs) -> None:
    second, checkpoint = runs.second, runs.resumed_from
    assert f"Resumed training from {checkpoint['state_path']}" in second.output
    # it starts at the checkpoint's batch, not at 0, and runs on to the new max_steps
    assert checkpoint["batch"] == SAVE_EVERY
    assert [row["step"] for row in second.metrics] == list(range(SAVE_EVERY, SECOND_STEPS))
    _assert_finite_losses(second)
    # the schedule is the one of a 5-step run, at step 2
    assert second.metrics[0]["learning_rate"] == pytest.approx(1e-4 * (1 - SAVE_EVERY / 5))

    # a new training run, created from the checkpoint, which saves its own checkpoints
    names = [r["name"] for r in second.checkpoints]
    assert names[-2:] == [f"{SECOND_STEPS - 1:06d}", "final"], names
    resumed_runs = {_run_of(r) for r in second.checkpoints}
    assert len(resumed_runs) == 1
    assert resumed_runs != {_run_of(checkpoint)}
    assert second.checkpoints[-1]["elapsed_tokens"] > checkpoint["elapsed_tokens"]


def test_the_resume_reads_the_renderer_back_from_the_training_run(runs: Runs) -> None:
    # Before resuming, the cookbook fetches the checkpoint's training run through the REST API
    # and compares its user_metadata["renderer_name"] with the renderer it was given. A failed
    # fetch is only a warning, so the resume itself does not depend on it.
    output = runs.second.output
    assert "Could not fetch renderer metadata" not in output
    assert f"Renderer metadata matches for checkpoint {runs.resumed_from['state_path']}" in output
