"""The tinker-cookbook's arithmetic RL recipe (``math_rl env=arithmetic``) runs offline and
unmodified, from its own virtual environment, against ``tinsmith up`` on the built-in tiny model:
a few steps, each sampling with the string stop of ``role_colon`` from a sampler refreshed after
the previous step, an ``importance_sampling`` forward_backward and an optim_step, and a
checkpoint.

The model is random, so rewards are about 0 and the advantages may all be 0; what is tested is the
loop and what it asks of the server, not learning. What the server did is read back from its event
log (the commands it accepted and the results it stored), beside the recipe's own metrics.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.conftest import RunningSystem, start_system, stop_system
from tests.e2e.cookbook_runs import RecipeRun, run_recipe
from tinsmith import models
from tinsmith._proto import bus_pb2, tinker_public_pb2

STEPS = 3
SAVE_EVERY = 2
GROUPS = 4  # groups_per_batch: problems per step
GROUP_SIZE = 4  # rollouts per problem
MAX_TOKENS = 5
ROLE_COLON_STOP = "\n\nUser:"


@pytest.fixture(scope="module")
def rl_system(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningSystem]:
    system = start_system(tmp_path_factory.mktemp("cookbook-rl-tinsmith"))
    yield system
    stop_system(system)


@pytest.fixture(scope="module")
def run(
    cookbook_python: Path, rl_system: RunningSystem, tmp_path_factory: pytest.TempPathFactory
) -> RecipeRun:
    work = tmp_path_factory.mktemp("cookbook-rl")
    arguments = [
        "env=arithmetic",
        f"model_name={models.materialize(models.TINY)}",
        "renderer_name=role_colon",
        f"base_url={rl_system.url}",
        f"groups_per_batch={GROUPS}",
        f"group_size={GROUP_SIZE}",
        f"max_tokens={MAX_TOKENS}",
        "lora_rank=8",
        f"max_steps={STEPS}",
        "eval_every=0",
        f"save_every={SAVE_EVERY}",
    ]
    module = "tinker_cookbook.recipes.math_rl.train"
    return run_recipe(cookbook_python, rl_system, module, arguments, work, "tml-cookbook-rl-e2e")


def test_the_recipe_runs_its_steps_and_logs_metrics_for_each(run: RecipeRun) -> None:
    assert run.returncode == 0, run.failure()
    assert [row["step"] for row in run.metrics] == list(range(STEPS)), run.metrics
    for row in run.metrics:
        # every rollout of the step made it into the batch
        assert row["env/all/total_episodes"] == GROUPS * GROUP_SIZE, row
        for key in ("env/all/reward/total", "optim/entropy", "optim/kl_sample_train_v1"):
            assert math.isfinite(row[key]), (key, row)
        # The sampler's logprobs (which the cookbook sends back as the importance-sampling
        # denominators) are those of the weights the trainer computes the step with: the sampler
        # was refreshed with the weights of the previous step.
        assert abs(row["optim/kl_sample_train_v1"]) < 1e-3, row


def test_each_step_samples_with_the_string_stop_from_a_fresh_sampler(run: RecipeRun) -> None:
    assert run.returncode == 0, run.failure()
    samples = run.server.of("sample")
    assert samples and all(r.outcome == "completed" for r in samples), run.failure()
    assert len(samples) * max(r.body.num_samples for r in samples) >= STEPS * GROUPS * GROUP_SIZE
    for request in samples:
        params = request.body.params
        assert list(params.stop_strs.values) == [ROLE_COLON_STOP], params
        assert params.max_tokens == MAX_TOKENS
        response = tinker_public_pb2.SampleResponse()
        response.ParseFromString(request.result)
        assert len(response.sequences) == request.body.num_samples
        for sequence in response.sequences:
            assert sequence.HasField("logprobs") and len(sequence.logprobs) == len(
                sequence.tokens
            ), sequence

    # One sampler per step, refreshed after each optim_step: 16 rollouts per step, all from the
    # weights saved after the previous step, sampled between that save and the step's training.
    model_id = run.training_run()
    blocks: list[tuple[str, list[int]]] = []  # (adapter key, log positions), in log order
    for request in samples:
        if not blocks or blocks[-1][0] != request.body.adapter_key:
            blocks.append((request.body.adapter_key, []))
        blocks[-1][1].append(request.position)
    keys = [key for key, _ in blocks]
    assert len(keys) == len(set(keys)) == STEPS, keys  # each sampler used in one step only
    assert all(len(positions) == GROUPS * GROUP_SIZE for _, positions in blocks), keys
    saves = [r for r in run.server.of("save_weights", model_id) if r.body.sampler_id]
    ephemeral = [run.server.samplers[r.body.sampler_id] for r in saves]
    # steps 0 and 1 sample from save_weights_and_get_sampling_client; step 2 from the sampler
    # weights of the step-2 checkpoint (the recipe's create_sampling_client(sampler_path))
    assert keys[:2] == ephemeral[:2], (keys, ephemeral)
    assert keys[2] == f"runs/{model_id}/sampler_weights/{SAVE_EVERY:06d}", keys
    trainings = [r.position for r in run.server.of("forward_backward", model_id)]
    assert len(trainings) == STEPS
    for step, (_, positions) in enumerate(blocks):
        after = trainings[step - 1] if step else -1
        assert after < min(positions) and max(positions) < trainings[step], (step, trainings)


def test_each_step_trains_with_importance_sampling(run: RecipeRun) -> None:
    assert run.returncode == 0, run.failure()
    model_id = run.training_run()
    steps = run.server.of("forward_backward", model_id)
    assert steps and all(r.outcome == "completed" for r in steps), run.failure()
    assert {r.body.loss_fn for r in steps} == {"importance_sampling"}
    assert not any(r.body.forward_only for r in steps)
    assert sum(len(r.body.data) for r in steps) == STEPS * GROUPS * GROUP_SIZE
    for request in steps:
        for datum in request.body.data:
            assert set(datum.loss_fn_inputs) == {"target_tokens", "logprobs", "advantages"}
        output = tinker_public_pb2.ForwardBackwardOutput()
        output.ParseFromString(request.result)
        assert sum(r.num_datums for r in output.loss_fn_outputs) == len(request.body.data)
        assert math.isfinite(output.metrics["loss:sum"]), output.metrics
        # the sampler's logprobs, sent back as the denominators, match the trainer's
        assert output.metrics["ratio:mean"] == pytest.approx(1.0, abs=1e-3), output.metrics

    optim = run.server.of("optim_step", model_id)
    assert len(optim) == STEPS and all(r.outcome == "completed" for r in optim)
    # the forward_backward and optim_step of each step, in this order
    order = [r.command for r in run.server.requests if r.aggregate_id == model_id]
    trained = [c for c in order if c in ("forward_backward", "optim_step")]
    assert Counter(trained) == {"optim_step": STEPS, "forward_backward": len(steps)}
    assert trained[-1] == "optim_step"


def test_the_checkpoint_is_written(run: RecipeRun) -> None:
    assert run.returncode == 0, run.failure()
    names = [r["name"] for r in run.checkpoints]
    assert f"{SAVE_EVERY:06d}" in names, run.checkpoints
    model_id = run.training_run()
    record = run.checkpoints[names.index(f"{SAVE_EVERY:06d}")]
    assert record["state_path"] == f"tinker://{model_id}/weights/{SAVE_EVERY:06d}"
    assert record["sampler_path"] == f"tinker://{model_id}/sampler_weights/{SAVE_EVERY:06d}"
    stored = run.system.data_dir / "blobs" / "runs" / model_id
    assert (stored / "weights" / f"{SAVE_EVERY:06d}" / "optimizer.safetensors").is_file()
    for segment in ("weights", "sampler_weights"):
        assert (stored / segment / f"{SAVE_EVERY:06d}" / "adapter_model.safetensors").is_file()
    kinds = {
        r.body.kind for r in run.server.of("save_weights", model_id) if r.body.name == "000002"
    }
    assert kinds == {bus_pb2.CHECKPOINT_KIND_TRAINING, bus_pb2.CHECKPOINT_KIND_SAMPLER}
