"""The trainer engine in-process on tinsmith/tiny: optim_step is AdamW exactly, per run."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from services.trainer.engine import TrainerEngine
from tinsmith import models
from tinsmith._proto import bus_pb2 as bus
from tinsmith._proto import tinker_public_pb2 as tp


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory) -> TrainerEngine:
    return TrainerEngine(models.default_cache_dir())


def _create(engine: TrainerEngine, model_id: str, rank: int = 4) -> None:
    lora = bus.LoraConfig(rank=rank, seed=1, train_mlp=True, train_attn=True, train_unembed=True)
    engine.create_run(
        model_id, bus.CreateModel(session_id="S", base_model="tinsmith/tiny", lora=lora)
    )


def _request(seed: int) -> tp.ForwardBackwardRequest:
    rng = np.random.default_rng(seed)
    request = tp.ForwardBackwardRequest(loss_fn="cross_entropy")
    for length in (7, 11):
        ids = rng.integers(3, 512, size=length + 1)
        datum = request.data.add()
        datum.model_input.add().encoded_text.tokens = ids[:-1].astype("<i4").tobytes()
        datum.loss_fn_inputs["target_tokens"].CopyFrom(
            tp.Tensor(dense=ids[1:].astype("<i8").tobytes(), dtype=tp.DTYPE_INT64, shape=[length])
        )
    return request


@pytest.mark.parametrize("clip", [0.0, 0.05])
def test_optim_step_is_torch_adamw_on_the_same_gradients(
    engine: TrainerEngine, clip: float
) -> None:
    model_id = f"adamw-{clip}"
    _create(engine, model_id)
    run = engine.runs[model_id]
    adam = bus.AdamParams(
        learning_rate=3e-3, beta1=0.8, beta2=0.9, eps=1e-7, weight_decay=0.1, grad_clip_norm=clip
    )
    shadow = {name: p.detach().clone().requires_grad_(True) for name, p in run.params.items()}
    reference = torch.optim.AdamW(
        list(shadow.values()), lr=3e-3, betas=(0.8, 0.9), eps=1e-7, weight_decay=0.1
    )
    for step in range(3):
        engine.forward_backward(model_id, _request(step))
        grads = {name: p.grad.detach().clone() for name, p in run.params.items()}
        norm = torch.linalg.vector_norm(torch.stack([g.norm() for g in grads.values()]))
        scale = min(1.0, clip / (float(norm) + 1e-6)) if clip else 1.0
        for name, p in shadow.items():
            p.grad = grads[name] * scale
        metrics = engine.optim_step(model_id, adam)
        reference.step()
        assert metrics["grad_norm:mean"] == pytest.approx(float(norm), rel=1e-5)
        assert metrics["learning_rate:mean"] == 3e-3
        for name, p in run.params.items():
            torch.testing.assert_close(p.detach(), shadow[name].detach(), rtol=0, atol=1e-7)
            assert p.grad is None  # zeroed after the step


def test_runs_keep_their_own_gradients(engine: TrainerEngine) -> None:
    _create(engine, "mine", rank=4)
    _create(engine, "theirs", rank=8)
    engine.forward_backward("mine", _request(0))
    engine.forward_backward("theirs", _request(1))
    mine = {n: p.grad.clone() for n, p in engine.runs["mine"].params.items()}
    _create(engine, "alone", rank=4)
    engine.forward_backward("alone", _request(0))
    for (_, g), (_, alone) in zip(
        sorted(mine.items()), sorted(engine.runs["alone"].params.items()), strict=True
    ):
        torch.testing.assert_close(g, alone.grad)
