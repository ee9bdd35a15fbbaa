"""The trainer engine in-process on tinsmith/tiny: optim_step is AdamW exactly, per run, and a
request that fails (raising midway, or with a non-finite loss, gradients or update) leaves its run
exactly as it was."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
import torch

from services.trainer import engine as engine_module
from services.trainer.engine import TrainerEngine
from tinsmith import models
from tinsmith._proto import bus_pb2 as bus
from tinsmith._proto import tinker_public_pb2 as tp
from tinsmith.failures import InvalidRequest, Unprocessable


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
            ours, theirs = run.optimizer.state[p], reference.state[shadow[name]]
            assert set(ours) == set(theirs) == {"step", "exp_avg", "exp_avg_sq"}
            assert ours["step"].dtype == theirs["step"].dtype
            assert float(ours["step"]) == float(theirs["step"]) == step + 1
            for moment in ("exp_avg", "exp_avg_sq"):
                torch.testing.assert_close(ours[moment], theirs[moment], rtol=0, atol=1e-9)


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


# -- a request that fails leaves its run as it was ----------------------------------------------

ADAM = bus.AdamParams(
    learning_rate=1e-2, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.01, grad_clip_norm=1.0
)


def _rl_request(seed: int, loss_fn: str, sampling_logprob: float) -> tp.ForwardBackwardRequest:
    """An RL batch whose sampler logprobs are all ``sampling_logprob``, every advantage 1."""
    request = _request(seed)
    request.loss_fn = loss_fn
    for datum in request.data:
        n = datum.loss_fn_inputs["target_tokens"].shape[0]
        for key, value in (("logprobs", sampling_logprob), ("advantages", 1.0)):
            datum.loss_fn_inputs[key].CopyFrom(
                tp.Tensor(
                    dense=np.full(n, value, "<f4").tobytes(), dtype=tp.DTYPE_FLOAT32, shape=[n]
                )
            )
    return request


def _out_of_vocabulary(seed: int) -> tp.ForwardBackwardRequest:
    """A batch refused before its forward pass (a target id past the vocabulary)."""
    request = _request(seed)
    target = request.data[1].loss_fn_inputs["target_tokens"]
    target.dense = np.full(target.shape[0], 10**6, "<i8").tobytes()
    return request


def _crossed_thresholds(seed: int) -> tp.ForwardBackwardRequest:
    """A batch whose forward pass runs and whose loss then raises: a ppo token whose clip_low
    threshold is above its clip_high one."""
    request = _rl_request(seed, "ppo", -6.0)
    datum = request.data[1]
    n = datum.loss_fn_inputs["target_tokens"].shape[0]
    for key, value in (("clip_low_threshold", 0.8), ("clip_high_threshold", 1.2)):
        values = np.full(n, value, "<f4")
        values[3] = 2.0 if key == "clip_low_threshold" else 0.5
        datum.loss_fn_inputs[key].CopyFrom(
            tp.Tensor(dense=values.tobytes(), dtype=tp.DTYPE_FLOAT32, shape=[n])
        )
    return request


def _weights(engine: TrainerEngine, model_id: str) -> dict[str, torch.Tensor | None]:
    """The run's adapter tensors, by their PEFT names."""
    run = engine.runs[model_id]
    return {n: p.detach().clone() for n, p in run.params.items()}


def _grads(engine: TrainerEngine, model_id: str) -> dict[str, torch.Tensor | None]:
    run = engine.runs[model_id]
    return {n: None if p.grad is None else p.grad.clone() for n, p in run.params.items()}


def _same(a: dict[str, torch.Tensor | None], b: dict[str, torch.Tensor | None]) -> bool:
    """Bit for bit (NaNs nowhere: a NaN would make this false, as it should)."""
    assert a.keys() == b.keys()
    return all(
        (x is None and y is None) or (x is not None and y is not None and torch.equal(x, y))
        for x, y in ((a[k], b[k]) for k in a)
    )


@pytest.mark.parametrize(
    ("bad", "error", "detail"),
    [
        (_rl_request(7, "importance_sampling", -1e30), Unprocessable, "importance ratio"),
        (_rl_request(7, "ppo", -1e30), Unprocessable, "gradients of this batch are not finite"),
        (_out_of_vocabulary(7), InvalidRequest, "outside the model's vocabulary"),
        (_crossed_thresholds(7), InvalidRequest, "datum 1: at token 3 the clip_low_threshold"),
    ],
    ids=[
        "non-finite-loss",
        "non-finite-gradients",
        "refused-before-the-forward-pass",
        "raises-after-the-forward-pass",
    ],
)
def test_a_failed_forward_backward_leaves_the_accumulated_gradients_exactly(
    engine: TrainerEngine, bad: tp.ForwardBackwardRequest, error: type[Exception], detail: str
) -> None:
    hit, clean = f"hit-{detail}", f"clean-{detail}"
    for model_id in (hit, clean):
        _create(engine, model_id)
        engine.forward_backward(model_id, _request(0))
    before = _grads(engine, hit)

    with pytest.raises(error, match=detail):
        engine.forward_backward(hit, bad)

    assert _same(_grads(engine, hit), before)
    for model_id in (hit, clean):
        engine.forward_backward(model_id, _request(1))
        engine.optim_step(model_id, ADAM)
    assert _same(_weights(engine, hit), _weights(engine, clean))  # as if it never came


@pytest.mark.parametrize("learning_rate", [math.inf, 1e39, 1e38])
def test_an_optim_step_that_would_make_the_weights_non_finite_is_refused(
    engine: TrainerEngine, learning_rate: float
) -> None:
    hit, clean = f"step-hit-{learning_rate}", f"step-clean-{learning_rate}"
    for model_id in (hit, clean):
        _create(engine, model_id)
        engine.forward_backward(model_id, _request(0))
        engine.optim_step(model_id, ADAM)  # so that AdamW has state to keep
        engine.forward_backward(model_id, _request(1))
    optimizer = engine.runs[hit].optimizer
    state = {p: {k: v.clone() for k, v in s.items()} for p, s in optimizer.state.items()}
    weights, grads = _weights(engine, hit), _grads(engine, hit)
    huge = bus.AdamParams()
    huge.CopyFrom(ADAM)
    huge.learning_rate = learning_rate

    with pytest.raises(Unprocessable, match="non-finite: the learning rate"):
        engine.optim_step(hit, huge)

    assert _same(_weights(engine, hit), weights)
    assert _same(_grads(engine, hit), grads)  # not even clipped
    assert optimizer.state.keys() == state.keys()
    for param, saved in state.items():
        assert all(torch.equal(optimizer.state[param][k], v) for k, v in saved.items())
    for model_id in (hit, clean):
        engine.optim_step(model_id, ADAM)
        engine.forward_backward(model_id, _request(2))
        engine.optim_step(model_id, ADAM)
    assert _same(_weights(engine, hit), _weights(engine, clean))


def test_a_checkpoint_that_does_not_fit_leaves_the_run_as_it_was(
    engine: TrainerEngine, tmp_path: Path
) -> None:
    """A checkpoint of attention-only LoRA loaded into a run that also trains the MLP: PEFT
    loads the tensors it has before the missing ones are noticed; they are put back."""
    lora = bus.LoraConfig(rank=4, seed=2, train_attn=True)
    engine.create_run("attn-only", bus.CreateModel(base_model="tinsmith/tiny", lora=lora))
    engine.export("attn-only", tmp_path, with_optimizer=True)
    _create(engine, "everywhere")
    engine.forward_backward("everywhere", _request(0))
    engine.optim_step("everywhere", ADAM)
    weights = _weights(engine, "everywhere")

    with pytest.raises(InvalidRequest, match="does not fit this run"):
        engine.load("everywhere", tmp_path, with_optimizer=True)
    assert _same(_weights(engine, "everywhere"), weights)

    create = bus.CreateModel(base_model="tinsmith/tiny", lora=lora, load_optimizer=True)
    create.lora.train_mlp = True
    with pytest.raises(InvalidRequest, match="does not fit this run"):
        engine.create_run("from-it", create, tmp_path)
    assert "from-it" not in engine.runs  # a run whose checkpoint does not load is not created


def test_the_finiteness_check_names_exactly_the_tensors_with_a_nan_or_an_infinity() -> None:
    tensors = {
        "fine": torch.ones(3),
        "huge": torch.full((4,), 3e38),  # finite, but its squares overflow
        "nan": torch.tensor([1.0, math.nan]),
        "none": None,
        "inf": torch.tensor([[-math.inf, 0.0]]),
        "huge and nan": torch.tensor([3e38, math.nan]),
    }
    assert engine_module._not_finite(tensors) == ["nan", "inf", "huge and nan"]
    assert engine_module._not_finite({"fine": torch.ones(2), "huge": torch.full((2,), 1e30)}) == []
    assert engine_module._not_finite({}) == []


def test_a_capture_keeps_the_state_it_was_taken_at_while_the_run_trains_on(
    engine: TrainerEngine, tmp_path: Path
) -> None:
    """A save's capture (on the compute thread) is written later, on another thread, while the
    run may step: what it writes is the run as it was when captured, weights, AdamW state and
    gradients, not as it is when written."""
    _create(engine, "captured")
    engine.forward_backward("captured", _request(0))
    engine.optim_step("captured", ADAM)
    engine.forward_backward("captured", _request(1))
    weights, grads = _weights(engine, "captured"), _grads(engine, "captured")
    captured = engine.capture("captured", with_optimizer=True, with_gradients=True)
    engine.optim_step("captured", ADAM)  # the run moves on before the capture is written
    engine.forward_backward("captured", _request(2))
    captured.write(tmp_path)

    lora = bus.LoraConfig(rank=4, seed=1, train_mlp=True, train_attn=True, train_unembed=True)
    create = bus.CreateModel(base_model="tinsmith/tiny", lora=lora, load_optimizer=True)
    engine.create_run("restored", create, tmp_path)
    assert _same(_weights(engine, "restored"), weights)
    assert _same(_grads(engine, "restored"), grads)
