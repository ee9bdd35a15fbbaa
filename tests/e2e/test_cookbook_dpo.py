"""The tinker-cookbook's DPO recipe (``preference.dpo``) runs offline and unmodified, from its own
virtual environment, against ``tinsmith up`` on the built-in tiny model.

DPO is the cookbook's ``forward_backward_custom`` user: each step the SDK asks the server for a
``forward`` of the chosen and rejected responses, computes the DPO loss on the client against the
reference logprobs (``compute_logprobs`` on a sampler frozen before the first step), and sends its
gradient back as a ``forward_backward`` with ``cross_entropy`` weights: positive on the chosen
responses, negative on the rejected ones.

``dataset=hhh`` is ``datasets.load_dataset("Anthropic/hh-rlhf")``, which loads a local directory of
that name before it asks the hub: the test writes a few preference pairs in the dataset's format
there (``Anthropic/hh-rlhf/{train,test}.jsonl`` under the recipe's working directory), as a user
with a local copy of the dataset would. Every chosen response is a helpful sentence and every
rejected one a curt "No.", so one step already teaches the preference for the next pairs.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from tests.conftest import RunningSystem, start_system, stop_system
from tests.e2e.cookbook_runs import RecipeRun, Request, run_recipe
from tinsmith import models, tensors
from tinsmith._proto import bus_pb2

pytestmark = pytest.mark.e2e

API_KEY = "tml-cookbook-dpo-e2e"
STEPS = 3
PAIRS = 2  # batch_size: preference pairs per step, a chosen and a rejected datum each
DPO_BETA = 0.1  # the recipe's default
TRAIN_PROMPTS = [
    "How do I boil an egg?",
    "What is the capital of France?",
    "Can you help me write a poem?",
    "How far away is the moon?",
    "What should I cook tonight?",
    "How do I learn to swim?",
]
TEST_PROMPTS = ["Why is the sky blue?", "What is a good name for a cat?"]


def _write_dataset(directory: Path) -> None:
    """A few pairs in Anthropic/hh-rlhf's format: two transcripts that differ in the last turn."""
    directory.mkdir(parents=True)
    for split, prompts in (("train", TRAIN_PROMPTS), ("test", TEST_PROMPTS)):
        rows = [
            {
                "chosen": f"\n\nHuman: {p}\n\nAssistant: Happy to help, here is a clear answer.",
                "rejected": f"\n\nHuman: {p}\n\nAssistant: No.",
            }
            for p in prompts
        ]
        (directory / f"{split}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


@pytest.fixture(scope="module")
def dpo_system(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningSystem]:
    system = start_system(tmp_path_factory.mktemp("cookbook-dpo-tinsmith"))
    yield system
    stop_system(system)


@pytest.fixture(scope="module")
def run(
    cookbook_python: Path, dpo_system: RunningSystem, tmp_path_factory: pytest.TempPathFactory
) -> RecipeRun:
    work = tmp_path_factory.mktemp("cookbook-dpo")
    _write_dataset(work / "Anthropic" / "hh-rlhf")
    arguments = [
        f"model_name={models.materialize(models.TINY)}",
        "renderer_name=role_colon",
        "dataset=hhh",
        f"base_url={dpo_system.url}",
        f"batch_size={PAIRS}",
        "max_length=128",
        "learning_rate=1e-3",
        f"max_steps={STEPS}",
    ]
    recipe = run_recipe(
        cookbook_python,
        dpo_system,
        "tinker_cookbook.recipes.preference.dpo.train",
        arguments,
        work,
        API_KEY,
    )
    print(f"dpo: {STEPS} steps in {recipe.seconds:.1f} s")
    return recipe


def _weights(request: Request) -> list[np.ndarray]:
    return [
        tensors.decode_tensor(d.loss_fn_inputs["weights"], "weights") for d in request.body.data
    ]


def test_dpo_starts_at_log_2_and_learns_the_preference(run: RecipeRun) -> None:
    assert run.returncode == 0, run.failure()
    assert [row["step"] for row in run.metrics] == list(range(STEPS)), run.metrics
    for row in run.metrics:
        assert row["num_pairs"] == PAIRS, row
        for key in ("dpo_loss", "accuracy", "margin", "chosen_reward", "rejected_reward"):
            assert math.isfinite(row[key]), (key, row)
    # The policy starts as the reference: the trainer's logprobs (the forward) and the reference
    # sampler's (compute_logprobs) agree, every log-ratio is 0, and the loss is -log sigmoid(0).
    first = run.metrics[0]
    assert first["dpo_loss"] == pytest.approx(math.log(2), abs=1e-5), first
    assert first["margin"] == pytest.approx(0, abs=1e-5), first
    # After the first step the chosen responses gained on the rejected ones, on pairs not yet seen.
    for row in run.metrics[1:]:
        assert row["accuracy"] == 1.0 and row["margin"] > 0, row
        assert row["chosen_reward"] > row["rejected_reward"], row
    losses = [row["dpo_loss"] for row in run.metrics]
    assert losses == sorted(losses, reverse=True) and losses[-1] < math.log(2) - 0.01, losses
    # the recipe's held-out NLL, on a sampler of the current weights, at the first and last step
    for row in (run.metrics[0], run.metrics[-1]):
        assert math.isfinite(row["test/nll"]) and row["test/nll"] > 0, row


def test_forward_backward_custom_sends_a_forward_then_the_dpo_gradient(run: RecipeRun) -> None:
    assert run.returncode == 0, run.failure()
    model_id = run.training_run()
    order = [
        "forward" if r.command == "forward_backward" and r.body.forward_only else r.command
        for r in run.server.requests
        if r.aggregate_id == model_id and r.command in ("forward_backward", "optim_step")
    ]
    assert order == ["forward", "forward_backward", "optim_step"] * STEPS
    passes = run.server.of("forward_backward", model_id)
    assert all(r.outcome == "completed" for r in passes), run.failure()
    for step in range(STEPS):
        forward, backward = passes[2 * step], passes[2 * step + 1]
        assert forward.body.loss_fn == backward.body.loss_fn == "cross_entropy"
        assert len(forward.body.data) == len(backward.body.data) == 2 * PAIRS
        for a, b in zip(forward.body.data, backward.body.data, strict=True):
            assert list(tensors.model_input_tokens(a.model_input)) == list(
                tensors.model_input_tokens(b.model_input)
            )
        mask = [w != 0 for w in _weights(forward)]  # the response tokens, weight 1
        # chosen (even) datums are pushed up, rejected (odd) ones down: negative weights
        for i, (on, gradient) in enumerate(zip(mask, _weights(backward), strict=True)):
            assert np.all(gradient[~on] == 0), (step, i)
            sign = 1 if i % 2 == 0 else -1
            assert np.all(sign * gradient[on] > 0), (step, i, gradient)
            if step == 0:
                # d(-log sigmoid(beta * (chosen - rejected))) / d logprob at 0, over the mean
                expected = DPO_BETA * 0.5 / PAIRS
                assert sign * gradient[on] == pytest.approx(expected, rel=1e-4), (i, gradient)


def test_the_reference_is_the_initial_sampler(run: RecipeRun) -> None:
    assert run.returncode == 0, run.failure()
    model_id = run.training_run()
    ephemeral = [
        run.server.samplers[r.body.sampler_id]
        for r in run.server.of("save_weights", model_id)
        if r.body.sampler_id
    ]
    # the reference before any step, then one for the evaluation at the first and last step
    assert len(ephemeral) == 3, ephemeral
    reference = [r for r in run.server.of("sample") if r.body.adapter_key == ephemeral[0]]
    assert all(r.outcome == "completed" and r.body.prompt_logprobs for r in reference)
    # every step scores its chosen and rejected sequences against the same frozen reference,
    # before the step's forward
    assert len(reference) == STEPS * 2 * PAIRS
    forwards = [r for r in run.server.of("forward_backward", model_id) if r.body.forward_only]
    for step, forward in enumerate(forwards):
        scored = reference[step * 2 * PAIRS : (step + 1) * 2 * PAIRS]
        assert max(r.done_position for r in scored) < forward.position, step
    first_training = min(r.position for r in run.server.of("forward_backward", model_id))
    assert min(r.position for r in reference) < first_training


def test_the_final_checkpoint_is_written(run: RecipeRun) -> None:
    assert run.returncode == 0, run.failure()
    model_id = run.training_run()
    assert [r["name"] for r in run.checkpoints] == ["final"], run.checkpoints
    assert run.checkpoints[0]["state_path"] == f"tinker://{model_id}/weights/final"
    stored = run.system.data_dir / "blobs" / "runs" / model_id
    assert (stored / "weights" / "final" / "optimizer.safetensors").is_file()
    for segment in ("weights", "sampler_weights"):
        assert (stored / segment / "final" / "adapter_model.safetensors").is_file()
    kinds = {r.body.kind for r in run.server.of("save_weights", model_id) if r.body.name == "final"}
    assert kinds == {bus_pb2.CHECKPOINT_KIND_TRAINING, bus_pb2.CHECKPOINT_KIND_SAMPLER}
