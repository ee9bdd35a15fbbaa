"""``examples.text_to_sql`` against the running system, on the tiny model: the whole program with
a tiny configuration (the evaluations, the warm start, the RL steps, the tables and the metrics
it reports), and the RL examples it builds, checked against what the trainer makes of them."""

from __future__ import annotations

import re
import uuid
from typing import Any

import httpx
import pytest
import tinker
from tinker import types

from examples.sft_pig_latin import ChatFormat
from examples.text_to_sql.__main__ import main
from examples.text_to_sql.loop import ACCURACY, MIXED, REWARD, Prompts, centred, chunks
from tests.conftest import RunningSystem

pytestmark = pytest.mark.e2e

SFT_STEPS, RL_STEPS = 2, 2


def _metrics(system: RunningSystem, key: str, run_id: str) -> dict[str, dict[int, float]]:
    response = httpx.get(
        f"{system.url}/api/v1/training_runs/{run_id}/metrics",
        headers={"X-API-Key": key},
        timeout=60,
    )
    assert response.status_code == 200, response.text
    series: dict[str, list[list[Any]]] = response.json()["metrics"]
    return {name: {int(step): value for step, value in points} for name, points in series.items()}


def test_the_program_evaluates_warm_starts_and_reinforces_and_reports_each_step(
    system: RunningSystem, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    key = f"tml-text-to-sql-{uuid.uuid4().hex[:8]}"
    monkeypatch.setenv("TINKER_API_KEY", key)
    argv = ["--url", system.url, "--base-model", "tinsmith/tiny", "--max-tokens", "12"]
    argv += ["--sft-steps", str(SFT_STEPS), "--sft-batch", "4", "--rl-steps", str(RL_STEPS)]
    argv += ["--rl-batch", "2", "--group", "3", "--eval-size", "6", "--show", "3"]
    argv += ["--tokens-per-call", "100"]  # each step in several requests, gradients added up
    assert main(argv) == 0
    out = capsys.readouterr().out

    # A table after each evaluation: three questions with the reference and the model's reply.
    for name, step in (("before", 0), ("warm start", SFT_STEPS), ("RL", SFT_STEPS + RL_STEPS)):
        title = f"Held-out questions, {name} (step {step}; 3 of 6 shown):"
        table = out.split(title, 1)[1].split("execution accuracy:", 1)[0]
        assert table.count("SELECT") >= 3  # the references, at least
        assert "✗" in table or "✓" in table
    assert "Held-out questions at every evaluation (3 of 6):" in out
    accuracy = re.search(
        r"after +step +all +new fillings +new templates\n.*\n(.*)\n(.*)\n(.*)", out
    )
    assert accuracy is not None
    assert [row.split()[0:2] for row in accuracy.groups()] == [
        ["before", "0"],
        ["warm", "start"],
        ["RL", str(SFT_STEPS + RL_STEPS)],
    ]
    assert f"RL: {RL_STEPS} steps, mean reward by step" in out
    assert f"warm start: {SFT_STEPS} steps, loss per answer token" in out

    # What it reported to the run: held-out accuracy at each evaluation's step, and each RL
    # step's reward at the step of the weights that were sampled.
    (run_id,) = re.findall(rf"{re.escape(system.url)}/console/#/runs/(\S+)", out)
    metrics = _metrics(system, key, run_id)
    assert sorted(metrics[ACCURACY]) == [0, SFT_STEPS, SFT_STEPS + RL_STEPS]
    assert all(0.0 <= value <= 1.0 for value in metrics[ACCURACY].values())
    rl_steps = list(range(SFT_STEPS, SFT_STEPS + RL_STEPS))
    assert sorted(metrics[REWARD]) == rl_steps and sorted(metrics[MIXED]) == rl_steps
    assert {f"{ACCURACY}/new_fillings", f"{ACCURACY}/new_templates"} <= set(metrics)
    assert sorted(metrics["loss:sum"]) == list(range(SFT_STEPS + RL_STEPS))  # the trainer's


def test_a_step_s_data_is_cut_into_requests_of_a_bounded_number_of_tokens() -> None:
    data = [
        types.Datum(model_input=types.ModelInput.from_ints([1] * n), loss_fn_inputs={})
        for n in (30, 50, 40, 120, 10)
    ]
    cut = chunks(data, 100)
    assert [[d.model_input.length for d in chunk] for chunk in cut] == [[30, 50], [40], [120], [10]]
    assert chunks(data, 0) == [data]  # the default: a step's data in one request


def test_rl_examples_line_up_with_the_trainer_so_on_policy_ratios_are_one(
    system: RunningSystem,
) -> None:
    """A sampled answer, as ``Prompts.rl_datum`` makes it: the trainer's log-probabilities of its
    tokens are the sampler's (so importance ratios are 1 on the weights that sampled it), and the
    loss is minus the advantage per answer token, none from the prompt."""
    service = tinker.ServiceClient(base_url=system.url, api_key="tml-text-to-sql-ratios")
    training = service.create_lora_training_client(base_model="tinsmith/tiny", rank=4).result()
    prompts = Prompts(ChatFormat.for_tokenizer(training.get_tokenizer()))
    sampler = training.save_weights_and_get_sampling_client().result()
    prompt = prompts.prompt("How many employees work in the Sales department?")
    params = types.SamplingParams(max_tokens=10, temperature=1.0, seed=7, stop=prompts.stop)
    sampled = sampler.sample(types.ModelInput.from_ints(prompt), 2, params).result().sequences
    assert centred([1.0, 0.0, 0.0, 1.0]) == [0.5, -0.5, -0.5, 0.5]
    advantages = [1.0, -0.25]
    data = [prompts.rl_datum(prompt, seq, a) for seq, a in zip(sampled, advantages, strict=True)]

    for loss in ("importance_sampling", "ppo"):
        output = training.forward(data, loss).result()
        for datum, seq, record in zip(data, sampled, output.loss_fn_outputs, strict=True):
            trained = record["logprobs"].tolist()[len(prompt) - 1 :]
            assert trained == pytest.approx(list(seq.logprobs or []), abs=2e-3)
            assert datum.model_input.length == len(prompt) + len(seq.tokens) - 1
        answer_tokens = [len(seq.tokens) for seq in sampled]
        expected = -sum(a * n for a, n in zip(advantages, answer_tokens, strict=True))
        assert output.metrics["loss:sum"] == pytest.approx(expected, abs=0.05)
    service.close("success").result()
