"""The tinker-cookbook's multi-turn RL recipe (``multiplayer_rl.guess_number``) runs offline and
unmodified, from its own virtual environment, against ``tinsmith up`` on the built-in tiny model.

In each episode the player guesses a number between 0 and 1024 and the environment answers; the
episode ends on the right guess or after ten turns. Every turn is its own ``sample`` call on a
prompt that holds the whole conversation so far, so the prompts grow turn by turn, and each
turn is trained as its own datum with ``importance_sampling``.

The model is random: it never writes ``Guess: <n>``, so every turn earns the recipe's format
penalty (-1) and every episode runs all ten turns. The tiny model's context is 1024 tokens and its
512-token vocabulary spends about 85 tokens on each exchange of the transcript (the guess and the
"Failed to parse" answer), so the guesses are kept to ``MAX_TOKENS`` tokens: ten turns fit.

The recipe's CLI has no ``base_url``: the user sets ``TINKER_BASE_URL``.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import tinker
from tokenizers import Tokenizer

from tests.conftest import RunningSystem, start_system, stop_system
from tests.e2e.cookbook_runs import RecipeRun, Request, run_recipe
from tinsmith import models, tensors
from tinsmith._proto import tinker_public_pb2

pytestmark = pytest.mark.e2e

API_KEY = "tml-cookbook-guess-number-e2e"
STEPS = 2
SAVE_EVERY = 1  # step 1 samples from the sampler weights of the step-1 checkpoint
GROUPS = 1  # batch_size: numbers to guess per step
GROUP_SIZE = 2  # episodes per number
EPISODES = GROUPS * GROUP_SIZE
MAX_TOKENS = 3
# The recipe's own rules (tinker_cookbook/recipes/multiplayer_rl/guess_number/env.py).
TURNS = 10  # MAX_TURNS
FORMAT_PENALTY = -1.0
FAIL_TO_PARSE = "Failed to parse. Please output in the format Guess: <guess>"
ROLE_COLON_STOP = "\n\nUser:"


@pytest.fixture(scope="module")
def guess_system(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningSystem]:
    system = start_system(tmp_path_factory.mktemp("cookbook-guess-tinsmith"))
    yield system
    stop_system(system)


@pytest.fixture(scope="module")
def run(
    cookbook_python: Path, guess_system: RunningSystem, tmp_path_factory: pytest.TempPathFactory
) -> RecipeRun:
    work = tmp_path_factory.mktemp("cookbook-guess")
    arguments = [
        f"model_name={models.materialize(models.TINY)}",
        "renderer_name=role_colon",
        f"batch_size={GROUPS}",
        f"group_size={GROUP_SIZE}",
        f"max_tokens={MAX_TOKENS}",
        f"max_steps={STEPS}",
        "eval_every=0",
        f"save_every={SAVE_EVERY}",
    ]
    recipe = run_recipe(
        cookbook_python,
        guess_system,
        "tinker_cookbook.recipes.multiplayer_rl.guess_number.train",
        arguments,
        work,
        API_KEY,
        {"TINKER_BASE_URL": guess_system.url},
    )
    print(f"guess_number: {STEPS} steps in {recipe.seconds:.1f} s")
    return recipe


def _steps(run: RecipeRun) -> list[list[Request]]:
    """The sample requests of each step: one sampler per step, its requests in log order."""
    blocks: dict[str, list[Request]] = {}
    for request in run.server.of("sample"):
        blocks.setdefault(request.body.adapter_key, []).append(request)
    return list(blocks.values())


def _sampled(request: Request) -> list[int]:
    response = tinker_public_pb2.SampleResponse()
    response.ParseFromString(request.result)
    (sequence,) = response.sequences
    return [int(t) for t in tensors.tokens_from_bytes(sequence.tokens)]


def _common_suffix(prompts: list[list[int]]) -> int:
    length = 0
    while all(len(p) > length for p in prompts) and len({p[-1 - length] for p in prompts}) == 1:
        length += 1
    return length


def test_the_recipe_plays_every_episode_to_its_last_turn(run: RecipeRun) -> None:
    assert run.returncode == 0, run.failure()
    assert [row["step"] for row in run.metrics] == list(range(STEPS)), run.metrics
    for row in run.metrics:
        assert row["env/all/total_episodes"] == EPISODES, row
        assert row["env/all/turns_per_episode"] == TURNS, row
        assert row["env/all/total_turns"] == EPISODES * TURNS, row
        # a format penalty on every turn: no episode ends early on a right guess
        assert row["env/all/reward/total"] == FORMAT_PENALTY * TURNS, row
        assert 0 < row["env/all/ac_tokens_per_turn"] <= MAX_TOKENS, row
        for key in ("optim/entropy", "optim/kl_sample_train_v1", "env/all/ob_tokens_per_turn"):
            assert math.isfinite(row[key]), (key, row)
        # the sampler's logprobs are those the trainer computes for the same tokens
        assert abs(row["optim/kl_sample_train_v1"]) < 1e-3, row


def test_each_turn_samples_the_conversation_so_far(run: RecipeRun) -> None:
    assert run.returncode == 0, run.failure()
    steps = _steps(run)
    assert [len(requests) for requests in steps] == [EPISODES * TURNS] * STEPS
    tokenizer = Tokenizer.from_file(str(models.materialize(models.TINY) / "tokenizer.json"))
    for requests in steps:
        for request in requests:
            assert request.outcome == "completed", run.failure()
            assert request.body.num_samples == 1
            assert list(request.body.params.stop_strs.values) == [ROLE_COLON_STOP]
            assert request.body.params.max_tokens == MAX_TOKENS

        # Each turn's prompt is an earlier turn's prompt (without the generation prompt that
        # ends them all) followed by that turn's guess and the environment's answer, asked for
        # only once the earlier turn was answered: ten turns per episode, chained.
        prompts = [list(r.body.prompt) for r in requests]
        header = _common_suffix(prompts)
        assert header > 0, prompts
        depth: list[int] = []
        for i, (request, prompt) in enumerate(zip(requests, prompts, strict=True)):
            earlier = [
                j
                for j in range(i)
                if len(prompts[j]) < len(prompt)
                and prompt[: len(prompts[j]) - header] == prompts[j][:-header]
                and requests[j].done_position < request.position
            ]
            depth.append(1 + max((depth[j] for j in earlier), default=0))
        assert Counter(depth) == dict.fromkeys(range(1, TURNS + 1), EPISODES), depth

        # The last turn's prompt holds the nine exchanges before it, each answered with the
        # environment's "Failed to parse" (the random model never writes "Guess: <n>").
        for i in (i for i, d in enumerate(depth) if d == TURNS):
            text = tokenizer.decode(prompts[i])
            assert text.count(FAIL_TO_PARSE) == TURNS - 1, text


def test_each_turn_is_trained_on_what_was_sampled(run: RecipeRun) -> None:
    assert run.returncode == 0, run.failure()
    model_id = run.training_run()
    trainings = run.server.of("forward_backward", model_id)
    assert len(trainings) == STEPS and all(r.outcome == "completed" for r in trainings)
    for step, (training, samples) in enumerate(zip(trainings, _steps(run), strict=True)):
        assert training.body.loss_fn == "importance_sampling"
        assert max(r.done_position for r in samples) < training.position, step
        # one datum per turn: the turn's prompt and its sampled tokens, shifted by one
        turns = sorted(tuple(list(r.body.prompt) + _sampled(r)[:-1]) for r in samples)
        datums = sorted(
            tuple(int(t) for t in tensors.model_input_tokens(d.model_input))
            for d in training.body.data
        )
        assert datums == turns, step
        for datum in training.body.data:
            # every episode has the same return, so no turn has an advantage over another
            advantages = tensors.decode_tensor(datum.loss_fn_inputs["advantages"], "advantages")
            assert np.all(advantages == 0), advantages
        output = tinker_public_pb2.ForwardBackwardOutput()
        output.ParseFromString(training.result)
        assert math.isfinite(output.metrics["loss:sum"]), output.metrics
    optim = run.server.of("optim_step", model_id)
    assert len(optim) == STEPS and all(r.outcome == "completed" for r in optim)


def test_the_checkpoint_is_written_and_listed(run: RecipeRun) -> None:
    assert run.returncode == 0, run.failure()
    model_id = run.training_run()
    name = f"{SAVE_EVERY:06d}"
    names = [r["name"] for r in run.checkpoints]
    assert name in names and names[-1] == "final", run.checkpoints
    record = run.checkpoints[names.index(name)]
    assert record["state_path"] == f"tinker://{model_id}/weights/{name}"
    assert record["sampler_path"] == f"tinker://{model_id}/sampler_weights/{name}"
    # step 1 samples from the checkpoint's sampler weights
    assert _steps(run)[1][0].body.adapter_key == f"runs/{model_id}/sampler_weights/{name}"
    stored = run.system.data_dir / "blobs" / "runs" / model_id
    for segment in ("weights", "sampler_weights"):
        assert (stored / segment / name / "adapter_model.safetensors").is_file()

    rest = tinker.RestClient(base_url=run.system.url, api_key=API_KEY)
    listed = rest.list_checkpoints(model_id).result().checkpoints
    paths = {c.tinker_path for c in listed}
    for record in run.checkpoints:
        assert {record["state_path"], record["sampler_path"]} <= paths, (record, paths)
    metadata = rest.get_training_run(model_id).result().user_metadata or {}
    assert metadata.get("renderer_name") == "role_colon", metadata
