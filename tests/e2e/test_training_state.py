"""Training state through the SDK: save, load with and without the optimizer, the deprecated
load_state forms, LoRA initialisation, and runs that share one base model without touching."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import tinker
from safetensors.numpy import load_file
from tinker import types

from tests.conftest import RunningSystem

ADAM = types.AdamParams(learning_rate=1e-2, weight_decay=0.01, grad_clip_norm=5.0)


def _batch(seed: int) -> list[types.Datum]:
    rng = np.random.default_rng(seed)
    data = []
    for length in (12, 7, 9):
        ids = rng.integers(3, 512, size=length + 1).tolist()
        data.append(
            types.Datum(
                model_input=types.ModelInput.from_ints(ids[:-1]),
                loss_fn_inputs={
                    "target_tokens": ids[1:],
                    "weights": rng.uniform(0.5, 1.5, size=length).tolist(),
                },
            )
        )
    return data


def _steps(training: tinker.TrainingClient, seeds: range) -> None:
    for seed in seeds:
        fb = training.forward_backward(_batch(seed), "cross_entropy")
        training.optim_step(ADAM).result()
        fb.result()


class Checkpoints:
    def __init__(self, system: RunningSystem) -> None:
        self.blobs = system.data_dir / "blobs"

    def directory(self, tinker_path: str) -> Path:
        run, segment, name = tinker_path.removeprefix("tinker://").split("/")
        return self.blobs / "runs" / run / segment / name

    def adapter(self, tinker_path: str) -> dict[str, np.ndarray]:
        return load_file(str(self.directory(tinker_path) / "adapter_model.safetensors"))

    def config(self, tinker_path: str) -> dict[str, object]:
        return json.loads((self.directory(tinker_path) / "adapter_config.json").read_text())


def _max_diff(a: dict[str, np.ndarray], b: dict[str, np.ndarray]) -> float:
    assert a.keys() == b.keys()
    return max(float(np.max(np.abs(a[k] - b[k]))) for k in a)


@pytest.fixture(scope="module")
def service(system: RunningSystem) -> Iterator[tinker.ServiceClient]:
    client = tinker.ServiceClient(base_url=system.url, api_key="tml-e2e")
    yield client
    client.close("success").result(timeout=30)


@pytest.fixture(scope="module")
def checkpoints(system: RunningSystem) -> Checkpoints:
    return Checkpoints(system)


def _new_run(service: tinker.ServiceClient, **kwargs: object) -> tinker.TrainingClient:
    return service.create_lora_training_client(base_model="tinsmith/tiny", **kwargs).result()


def test_save_then_load_with_optimizer_continues_exactly(
    service: tinker.ServiceClient, checkpoints: Checkpoints
) -> None:
    straight = _new_run(service, rank=8, seed=5)
    _steps(straight, range(5))
    expected = checkpoints.adapter(straight.save_state("five").result().path)

    first = _new_run(service, rank=8, seed=5)
    _steps(first, range(3))
    middle = first.save_state("three").result().path
    resumed = service.create_training_client_from_state_with_optimizer(middle).result()
    assert resumed.model_id != first.model_id
    _steps(resumed, range(3, 5))
    got = checkpoints.adapter(resumed.save_state("five").result().path)
    assert _max_diff(got, expected) <= 1e-6


def test_a_weights_only_load_starts_a_fresh_optimizer(
    service: tinker.ServiceClient, checkpoints: Checkpoints
) -> None:
    run = _new_run(service, rank=8, seed=6)
    _steps(run, range(3))
    middle = run.save_state("three").result().path
    before = checkpoints.adapter(middle)

    fresh = service.create_training_client_from_state(middle).result()
    fresh.forward_backward(_batch(3), "cross_entropy")
    fresh.optim_step(types.AdamParams(learning_rate=1e-3)).result()
    after = checkpoints.adapter(fresh.save_state("fresh-step").result().path)

    # A fresh AdamW's first step moves each parameter by lr * g/|g| = ±lr (bias-corrected).
    steps = np.concatenate([np.abs(after[k] - before[k]).ravel() for k in before])
    moved = steps[steps > 0]
    assert moved.size > 0.9 * steps.size
    np.testing.assert_allclose(moved, 1e-3, rtol=1e-3)


@pytest.mark.filterwarnings("ignore:DEPRECATED")
def test_the_deprecated_load_state_forms(
    service: tinker.ServiceClient, checkpoints: Checkpoints
) -> None:
    source = _new_run(service, rank=8, seed=7)
    _steps(source, range(3))
    path = source.save_state("three").result().path
    via_create = service.create_training_client_from_state_with_optimizer(path).result()
    _steps(via_create, range(3, 4))
    expected = checkpoints.adapter(via_create.save_state("four").result().path)

    legacy = _new_run(service, rank=8, seed=99)
    legacy.load_state_with_optimizer(path).result()
    _steps(legacy, range(3, 4))
    assert _max_diff(checkpoints.adapter(legacy.save_state("four").result().path), expected) <= 1e-6

    weights_only = _new_run(service, rank=8, seed=99)
    weights_only.load_state(path).result()
    loaded = checkpoints.adapter(weights_only.save_state("loaded").result().path)
    assert _max_diff(loaded, checkpoints.adapter(path)) == 0.0


@pytest.mark.filterwarnings("ignore:DEPRECATED")
def test_loading_a_checkpoint_of_another_rank_is_refused(service: tinker.ServiceClient) -> None:
    source = _new_run(service, rank=8)
    path = source.save_state("rank8").result().path
    other = _new_run(service, rank=4)
    with pytest.raises(tinker.BadRequestError, match="rank 8"):
        other.load_state(path).result()


def test_lora_rank_seed_and_targets(
    service: tinker.ServiceClient, checkpoints: Checkpoints
) -> None:
    def init(**kwargs: object) -> str:
        return _new_run(service, **kwargs).save_state("init").result().path

    a, b, c = init(rank=4, seed=11), init(rank=4, seed=11), init(rank=4, seed=12)
    assert _max_diff(checkpoints.adapter(a), checkpoints.adapter(b)) == 0.0
    assert _max_diff(checkpoints.adapter(a), checkpoints.adapter(c)) > 0.0
    assert checkpoints.config(a)["r"] == 4
    shapes = {k: v.shape for k, v in checkpoints.adapter(a).items()}
    assert all(4 in shape for shape in shapes.values())

    attn_only = init(rank=2, train_mlp=False, train_unembed=False)
    assert set(checkpoints.config(attn_only)["target_modules"]) == {  # type: ignore[arg-type]
        "q_proj",
        "k_proj",
        "v_proj",
        "o_proj",
    }
    mlp_unembed = init(rank=2, train_attn=False)
    assert set(checkpoints.config(mlp_unembed)["target_modules"]) == {  # type: ignore[arg-type]
        "gate_proj",
        "up_proj",
        "down_proj",
        "lm_head",
    }
    assert checkpoints.config(a)["lora_dropout"] == 0.0


def test_interleaved_runs_get_exactly_the_weights_they_would_get_alone(
    service: tinker.ServiceClient, checkpoints: Checkpoints
) -> None:
    alone = _new_run(service, rank=4, seed=21)
    _steps(alone, range(4))
    expected = checkpoints.adapter(alone.save_state("alone").result().path)

    mine = _new_run(service, rank=4, seed=21)
    theirs = _new_run(service, rank=16, seed=22)
    for seed in range(4):  # submit both runs' work before waiting on either
        futures = [
            mine.forward_backward(_batch(seed), "cross_entropy"),
            theirs.forward_backward(_batch(100 + seed), "cross_entropy"),
            mine.optim_step(ADAM),
            theirs.optim_step(types.AdamParams(learning_rate=5e-2)),
        ]
        for future in futures:
            future.result()
    got = checkpoints.adapter(mine.save_state("interleaved").result().path)
    assert _max_diff(got, expected) == 0.0
