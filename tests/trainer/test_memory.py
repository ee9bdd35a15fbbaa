"""The trainer engine's device, precision and memory budget, on the CPU with tinsmith/tiny: a
bfloat16 base trains float32 adapters; a batch that does not fit what is free of the budget runs
in micro-batches, a datum that does not fit alone with activation checkpointing, and one that
does not fit even so is refused, each with the one pass's results; the LM head's chunked loss is
the plain one for every loss; an out-of-memory error fails its request alone."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from services.device import Placement
from services.trainer import losses
from services.trainer.engine import (
    ACTIVATION_SCALE,
    OutOfBudget,
    Pass,
    TrainerEngine,
)
from tinsmith import artifacts, models
from tinsmith._proto import bus_pb2 as bus
from tinsmith._proto import tinker_public_pb2 as tp
from tinsmith.failures import Unavailable, Unprocessable
from tinsmith.losses import LOSSES, config_of
from tinsmith.tensors import batched, decode_tensor, unbatch

TINY = models.TINY
VOCAB = 512
ADAM = bus.AdamParams(
    learning_rate=1e-2, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.01, grad_clip_norm=1.0
)
HUGE = 1 << 40


def _engine(
    dtype: torch.dtype = torch.float32, pass_tokens: int = HUGE, **kwargs: int
) -> TrainerEngine:
    """An engine on the CPU with a budget to spare. Passes cost ``pass_tokens``: by default so
    much that a batch is never cut by length, so that only the memory plan cuts it here."""
    placement = Placement(torch.device("cpu"), dtype, HUGE)
    return TrainerEngine(
        models.default_cache_dir(), placement=placement, pass_tokens=pass_tokens, **kwargs
    )


def _create(engine: TrainerEngine, model_id: str, rank: int = 4, seed: int = 1) -> None:
    lora = bus.LoraConfig(rank=rank, seed=seed, train_mlp=True, train_attn=True, train_unembed=True)
    engine.create_run(model_id, bus.CreateModel(session_id="S", base_model=TINY, lora=lora))


def _tensor(values: np.ndarray) -> tp.Tensor:
    wire = tp.DTYPE_INT64 if values.dtype.kind == "i" else tp.DTYPE_FLOAT32
    dtype = "<i8" if values.dtype.kind == "i" else "<f4"
    return tp.Tensor(dense=values.astype(dtype).tobytes(), dtype=wire, shape=list(values.shape))


def _request(
    seed: int, lengths: tuple[int, ...], loss_fn: str = "cross_entropy", k: int = 0
) -> tp.ForwardBackwardRequest:
    """A batch with datums of ``lengths`` tokens and the inputs ``loss_fn`` reads (``k``: (N, K)
    cross-entropy targets, with weights)."""
    rng = np.random.default_rng(seed)
    request = tp.ForwardBackwardRequest(loss_fn=loss_fn)
    for n in lengths:
        ids = rng.integers(3, VOCAB, size=n + 1)
        datum = request.data.add()
        datum.model_input.add().encoded_text.tokens = ids[:-1].astype("<i4").tobytes()
        inputs = datum.loss_fn_inputs
        if k:
            inputs["target_tokens"].CopyFrom(_tensor(rng.integers(0, VOCAB, size=(n, k))))
            inputs["weights"].CopyFrom(_tensor(rng.random((n, k))))
        else:
            inputs["target_tokens"].CopyFrom(_tensor(ids[1:]))
        if loss_fn != "cross_entropy":
            # Sampler logprobs near the model's (about -log 512), so that some ratios clip.
            inputs["logprobs"].CopyFrom(_tensor(-6.2 + 0.3 * rng.standard_normal(n)))
            inputs["advantages"].CopyFrom(_tensor(rng.standard_normal(n)))
        if loss_fn == "gspo":
            inputs["sequence_ratio_mask"].CopyFrom(_tensor((rng.random(n) < 0.7).astype("f4")))
    return request


def _outputs(output: bytes) -> tuple[list[np.ndarray], list[np.ndarray], dict[str, float]]:
    out = tp.ForwardBackwardOutput.FromString(output)
    record = out.loss_fn_outputs[0].fields
    return unbatch(record["logprobs"]), unbatch(record["elementwise_loss"]), dict(out.metrics)


def _grads(engine: TrainerEngine, model_id: str) -> dict[str, torch.Tensor | None]:
    run = engine.runs[model_id]
    return {n: None if p.grad is None else p.grad.clone() for n, p in run.params.items()}


def _weights(engine: TrainerEngine, model_id: str) -> dict[str, torch.Tensor]:
    run = engine.runs[model_id]
    return {n: p.detach().clone() for n, p in run.params.items()}


def _assert_close_outputs(a: bytes, b: bytes, rtol: float = 1e-5, atol: float = 1e-6) -> None:
    (lp_a, el_a, m_a), (lp_b, el_b, m_b) = _outputs(a), _outputs(b)
    for x, y in zip([*lp_a, *el_a], [*lp_b, *el_b], strict=True):
        assert x.dtype == y.dtype == np.float32
        np.testing.assert_allclose(x, y, rtol=rtol, atol=atol)
    assert m_a.keys() == m_b.keys()
    for key, value in m_a.items():
        assert value == pytest.approx(m_b[key], rel=rtol, abs=atol), key


def _assert_close_grads(
    a: dict[str, torch.Tensor | None], b: dict[str, torch.Tensor | None]
) -> None:
    """Equal to float32 rounding: each element within 1e-5 of its tensor's largest (sums of
    many terms in another order cancel differently in the small elements)."""
    assert a.keys() == b.keys()
    for name, x in a.items():
        y = b[name]
        assert x is not None and y is not None, name
        scale = float(y.abs().max())
        torch.testing.assert_close(
            x, y, rtol=1e-4, atol=1e-5 * scale, msg=lambda m, name=name: f"{name}: {m}"
        )


def _tighten(engine: TrainerEngine, free: int) -> None:
    """Leave ``free`` bytes of the budget free for a step's activations, beyond what the engine
    holds and what a forward_backward of its runs sets aside for gradients."""
    gradients = max(run.state_bytes for run in engine.runs.values()) * 3 // 4
    budget = engine.held_bytes() + gradients + free
    engine.placement = dataclasses.replace(engine.placement, memory_bytes=budget)


# -- precision ----------------------------------------------------------------------------------


def test_a_bfloat16_base_trains_float32_adapters_and_checkpoints_float32(tmp_path: Path) -> None:
    half, full = _engine(torch.bfloat16), _engine()
    for engine in (half, full):
        _create(engine, "run", seed=7)
    base = half.bases[TINY].model
    frozen = list(base.parameters())
    assert frozen and all(p.dtype == torch.bfloat16 and not p.requires_grad for p in frozen)
    run = half.runs["run"]
    assert all(p.dtype == torch.float32 and p.requires_grad for p in run.params.values())
    # The seed gives the same float32 adapter whatever the base's dtype.
    assert all(torch.equal(a, b) for a, b in zip(*map(_weights_list, (half, full)), strict=True))

    request = _request(0, (7, 11), "ppo")
    out_half, out_full = (e.forward_backward("run", request) for e in (half, full))
    (lp_half, el_half, metrics), (lp_full, _, _) = _outputs(out_half), _outputs(out_full)
    assert all(x.dtype == np.float32 for x in [*lp_half, *el_half])
    assert np.isfinite(metrics["loss:sum"])
    for x, y in zip(lp_half, lp_full, strict=True):  # bfloat16 weights: close, not equal
        np.testing.assert_allclose(x, y, atol=0.05)
    assert all(p.grad is not None and p.grad.dtype == torch.float32 for p in run.params.values())
    half.optim_step("run", ADAM)
    moments = [v for s in run.optimizer.state.values() for k, v in s.items() if k != "step"]
    assert moments and all(v.dtype == torch.float32 for v in moments)

    half.forward_backward("run", request)  # pending gradients go into a snapshot too
    half.export("run", tmp_path, with_optimizer=True, with_gradients=True)
    for file in (artifacts.ADAPTER_WEIGHTS, artifacts.OPTIMIZER_STATE, artifacts.GRADIENTS):
        saved = load_file(str(tmp_path / file))
        assert saved and all(t.dtype == torch.float32 for t in saved.values()), file
    # ... and a float32 engine takes it as it is: a checkpoint moves between devices and dtypes.
    full.load("run", tmp_path, with_optimizer=True)
    assert all(torch.equal(a, b) for a, b in zip(*map(_weights_list, (half, full)), strict=True))
    assert _same_grads(_grads(half, "run"), _grads(full, "run"))


def _weights_list(engine: TrainerEngine) -> list[torch.Tensor]:
    return list(_weights(engine, "run").values())


def _same_grads(a: dict[str, torch.Tensor | None], b: dict[str, torch.Tensor | None]) -> bool:
    return a.keys() == b.keys() and all(
        (x is None and y is None) or (x is not None and y is not None and torch.equal(x, y))
        for x, y in ((a[k], b[k]) for k in a)
    )


def test_the_activation_estimate_covers_a_bfloat16_base() -> None:
    """What the layers keep for the backward pass (saved-tensor hooks), with every module a LoRA
    target, stays under the estimate in both dtypes, and the bfloat16 base's is no more than
    ACTIVATION_SCALE of the float32 one's."""
    kept = {}
    for dtype in (torch.float32, torch.bfloat16):
        engine = _engine(dtype)
        _create(engine, "run")
        base = engine.bases[TINY]
        model = causal = base.model
        ids = torch.randint(3, VOCAB, (4, 96))
        storages: dict[int, int] = {}

        def pack(t: torch.Tensor, storages: dict[int, int] = storages) -> torch.Tensor:
            storage = t.untyped_storage()
            storages[storage.data_ptr()] = storage.nbytes()
            return t

        params = {p.untyped_storage().data_ptr() for p in model.parameters()}
        with (
            torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t),
            base.slots.routed([engine.runs["run"].slot] * 4),
        ):
            causal.get_decoder()(input_ids=ids, attention_mask=torch.ones_like(ids))
        kept[dtype] = sum(n for ptr, n in storages.items() if ptr not in params)
        assert kept[dtype] < engine.activation_bytes(TINY, [96] * 4, backward=True)
    assert kept[torch.bfloat16] / kept[torch.float32] <= ACTIVATION_SCALE[torch.bfloat16]


# -- the LM head, a chunk of positions at a time --------------------------------------------------

_EVERY_LOSS = [(name, 0) for name in LOSSES] + [("cross_entropy", 3)]


@pytest.mark.parametrize(("loss_fn", "k"), _EVERY_LOSS, ids=[f"{n}-{k}" for n, k in _EVERY_LOSS])
def test_the_chunked_head_gives_the_plain_losses_and_gradients(loss_fn: str, k: int) -> None:
    """Five positions of logits at a time (so every datum spans several chunks, and chunks span
    datums), with a LoRA on lm_head, against the whole batch's logits from the PEFT model's own
    forward and the loss on them."""
    engine = _engine(head_chunk_bytes=4 * VOCAB * 5)
    _create(engine, "run")
    request = _request(3, (9, 23, 1, 14), loss_fn, k)
    chunked = engine.forward_backward("run", request)
    assert engine.last_plan == [Pass((0, 1, 2, 3))]
    grads = _grads(engine, "run")
    for param in engine.runs["run"].params.values():
        param.grad = None

    plain = _plain_forward_backward(engine, "run", request)

    _assert_close_outputs(chunked, plain)
    _assert_close_grads(grads, _grads(engine, "run"))
    head = [g for name, g in grads.items() if "lm_head.lora_B" in name]  # A's are 0 at first
    assert head and all(g is not None and bool(g.abs().sum() > 0) for g in head)


def _plain_forward_backward(
    engine: TrainerEngine, model_id: str, request: tp.ForwardBackwardRequest
) -> bytes:
    """The reference: every position's float32 logits from the model's own forward at once,
    then the loss on them (losses.compute), backward, output."""
    run = engine.runs[model_id]
    base = engine.bases[run.base_model]
    tokens = [np.frombuffer(d.model_input[0].encoded_text.tokens, "<i4") for d in request.data]
    lengths = [len(t) for t in tokens]
    ids = torch.zeros((len(tokens), max(lengths)), dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, row in enumerate(tokens):
        ids[i, : len(row)] = torch.from_numpy(row.astype(np.int64))
        mask[i, : len(row)] = 1
    inputs = [
        {name: torch.from_numpy(np.array(decode_tensor(t, name))) for name, t in d.items()}
        for d in (datum.loss_fn_inputs for datum in request.data)
    ]
    with base.slots.routed([run.slot] * len(tokens)):
        logits = base.model(input_ids=ids, attention_mask=mask).logits.float()
    result = losses.compute(
        request.loss_fn,
        [logits[i, :n] for i, n in enumerate(lengths)],
        inputs,
        config_of(request),
    )
    result.total.backward()
    out = tp.ForwardBackwardOutput(loss_fn_output_type="ArrayRecord")
    record = out.loss_fn_outputs.add(type_tag="ArrayRecord", num_datums=len(tokens))
    record.fields["logprobs"].CopyFrom(batched([lp.numpy() for lp in result.logprobs]))
    record.fields["elementwise_loss"].CopyFrom(batched([e.numpy() for e in result.elementwise]))
    for key, value in result.metrics.items():
        out.metrics[key] = value
    return out.SerializeToString()


# -- memory: micro-batches, checkpointing, refusal ------------------------------------------------


@pytest.fixture
def pair() -> Iterator[tuple[TrainerEngine, TrainerEngine]]:
    """An engine with room to spare and one whose budget the test tightens, each with a run
    "run" of the same seed."""
    roomy, tight = _engine(), _engine()
    for engine in (roomy, tight):
        _create(engine, "run")
    yield roomy, tight


@pytest.mark.parametrize("loss_fn", ["cross_entropy", "ppo", "gspo"])
def test_a_batch_that_does_not_fit_runs_in_micro_batches_with_the_one_pass_results(
    pair: tuple[TrainerEngine, TrainerEngine], loss_fn: str
) -> None:
    roomy, tight = pair
    lengths = (9, 30, 5, 17, 12, 3)
    largest = max(tight.activation_bytes(TINY, [n], backward=True) for n in lengths)
    _tighten(tight, free=largest * 2)
    assert tight.activation_bytes(TINY, lengths, backward=True) > largest * 2

    for seed in (0, 1):  # the second accumulates onto the first's gradients
        request = _request(seed, lengths, loss_fn)
        whole, split = (e.forward_backward("run", request) for e in (roomy, tight))
        assert roomy.last_plan == [Pass((0, 1, 2, 3, 4, 5))]
        assert len(tight.last_plan) > 1 and not any(p.checkpointed for p in tight.last_plan)
        assert [i for p in tight.last_plan for i in p.datums] == list(range(len(lengths)))
        _assert_close_outputs(split, whole)
        _assert_close_grads(_grads(tight, "run"), _grads(roomy, "run"))

    forward = _request(2, lengths, loss_fn)
    forward.forward_only = True
    largest = max(tight.activation_bytes(TINY, [n], backward=False) for n in lengths)
    _tighten(tight, free=largest * 2)
    assert tight.activation_bytes(TINY, lengths, backward=False) > largest * 2
    _assert_close_outputs(
        tight.forward_backward("run", forward), roomy.forward_backward("run", forward)
    )
    assert len(tight.last_plan) > 1
    for engine in (roomy, tight):
        engine.optim_step("run", ADAM)
    for name, weight in _weights(tight, "run").items():
        # AdamW divides by each gradient's own size: a small one's rounding shows, up to 1e-3 lr.
        torch.testing.assert_close(weight, _weights(roomy, "run")[name], rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("loss_fn", ["cross_entropy", "importance_sampling"])
def test_a_batch_of_mixed_lengths_runs_in_passes_of_similar_lengths_with_the_one_pass_results(
    loss_fn: str,
) -> None:
    """Short and long datums interleaved: the short ones go in a pass of their own (sparing
    the padding to the long ones), with the one pass's outputs, gradients and weights."""
    whole, grouped = _engine(), _engine(pass_tokens=16)
    for engine in (whole, grouped):
        _create(engine, "run")
    lengths = (40, 3, 38, 5, 4, 41, 6)
    for seed in (0, 1):  # the second accumulates onto the first's gradients
        request = _request(seed, lengths, loss_fn)
        one, cut = (e.forward_backward("run", request) for e in (whole, grouped))
        assert whole.last_plan == [Pass((0, 1, 2, 3, 4, 5, 6))]
        assert grouped.last_plan == [Pass((1, 3, 4, 6)), Pass((0, 2, 5))]
        _assert_close_outputs(cut, one)
        _assert_close_grads(_grads(grouped, "run"), _grads(whole, "run"))
    # AdamW's first step moves a weight by lr x g / (|g| + eps): a near-zero gradient's float32
    # rounding shows in it at lr 1e-2, so the weights are compared at 1e-3.
    adam = bus.AdamParams()
    adam.CopyFrom(ADAM)
    adam.learning_rate = 1e-3
    for engine in (whole, grouped):
        engine.optim_step("run", adam)
    for name, weight in _weights(grouped, "run").items():
        torch.testing.assert_close(weight, _weights(whole, "run")[name], rtol=1e-4, atol=1e-5)


def test_a_split_batch_that_fails_in_a_later_pass_leaves_the_gradients_as_they_were(
    pair: tuple[TrainerEngine, TrainerEngine],
) -> None:
    """The first micro-batch's gradients are in by the time the last one's loss overflows."""
    _, tight = pair
    tight.forward_backward("run", _request(0, (7, 11)))
    before = _grads(tight, "run")
    lengths = (9, 30, 5, 17)
    _tighten(tight, free=max(tight.activation_bytes(TINY, [n], backward=True) for n in lengths))
    bad = _request(1, lengths, "importance_sampling")
    last = bad.data[3].loss_fn_inputs["logprobs"]
    last.dense = np.full(17, -1e30, "<f4").tobytes()

    with pytest.raises(Unprocessable, match="datum 3: the importance_sampling loss"):
        tight.forward_backward("run", bad)

    assert len(tight.last_plan) > 1 and 3 not in tight.last_plan[0].datums
    assert _same_grads(_grads(tight, "run"), before)


def test_a_datum_that_does_not_fit_alone_runs_with_activation_checkpointing(
    pair: tuple[TrainerEngine, TrainerEngine],
) -> None:
    roomy, tight = pair
    plain = tight.activation_bytes(TINY, [200], backward=True)
    checkpointed = tight.activation_bytes(TINY, [200], backward=True, checkpointed=True)
    assert checkpointed < plain
    _tighten(tight, free=(checkpointed + plain) // 2)
    recomputed = _count_mlp_calls(tight)
    causal = tight.bases[TINY].model
    modes = [m.training for m in causal.modules()]

    request = _request(5, (200,), "importance_sampling")
    whole = roomy.forward_backward("run", request)
    calls = recomputed()
    split = tight.forward_backward("run", request)

    assert tight.last_plan == [Pass((0,), checkpointed=True)]
    assert recomputed() - calls == 2 * 2  # each of the 2 layers' MLPs runs again in the backward
    _assert_close_outputs(split, whole)
    _assert_close_grads(_grads(tight, "run"), _grads(roomy, "run"))
    # Checkpointing was for that pass only.
    assert not causal.is_activation_checkpointing
    assert [m.training for m in causal.modules()] == modes


def _count_mlp_calls(engine: TrainerEngine) -> Callable[[], int]:
    """A counter of the decoder layers' MLP forwards from now on (wrapping ``forward`` itself:
    the recomputation in the backward pass calls it without the module's hooks)."""
    calls = [0]
    for layer in engine.bases[TINY].model.get_decoder().layers:
        forward = layer.mlp.forward

        def counted(*args: object, forward: Callable[..., object] = forward) -> object:
            calls[0] += 1
            return forward(*args)

        layer.mlp.forward = counted
    return lambda: calls[0]


def test_a_datum_that_does_not_fit_even_with_checkpointing_is_refused(
    pair: tuple[TrainerEngine, TrainerEngine],
) -> None:
    _, tight = pair
    tight.forward_backward("run", _request(0, (7, 11)))
    before = _grads(tight, "run")
    need = tight.activation_bytes(TINY, [300], backward=True, checkpointed=True)
    _tighten(tight, free=need - 1)

    with pytest.raises(OutOfBudget, match="TINSMITH_DEVICE_MEMORY_MB") as refused:
        tight.forward_backward("run", _request(1, (5, 300)))

    assert refused.value.kind == "unprocessable"
    assert "datum 1 (300 tokens" in refused.value.detail
    assert "even with activation checkpointing" in refused.value.detail
    assert _same_grads(_grads(tight, "run"), before)


def test_a_run_that_does_not_fit_is_refused_with_what_it_needs() -> None:
    engine = _engine()
    _create(engine, "first", rank=8)
    engine.placement = dataclasses.replace(
        engine.placement, memory_bytes=engine.held_bytes() + 1000
    )
    with pytest.raises(OutOfBudget, match=r"training run second .*TINSMITH_DEVICE_MEMORY_MB") as e:
        _create(engine, "second", rank=8)
    # Its gradients and AdamW state, and the place its rank class's stacks grow by (one: they
    # held the first run's adapter alone).
    place = engine.bases[TINY].slots.nbytes()
    assert e.value.short == engine.runs["first"].state_bytes * 3 // 4 + place - 1000
    assert "second" not in engine.runs and len(engine.bases[TINY].slots.ranks) == 1


# -- out of memory --------------------------------------------------------------------------------


def test_running_out_of_device_memory_fails_the_request_alone(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    hit, clean = _engine(), _engine()
    for engine in (hit, clean):
        _create(engine, "run")
        engine.forward_backward("run", _request(0, (7, 11)))
    before = _grads(hit, "run")

    def exhausted(*_: object) -> None:
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

    layer = hit.bases[TINY].model.get_decoder().layers[1]
    handle = layer.mlp.register_forward_hook(exhausted)
    with pytest.raises(Unavailable, match="ran out of memory during this forward_backward"):
        hit.forward_backward("run", _request(1, (7, 11)))
    handle.remove()
    assert _same_grads(_grads(hit, "run"), before)

    # Half way through the step: its new moments are computed, its new weights are not.
    with monkeypatch.context() as patch:
        patch.setattr(torch, "_foreach_sqrt", exhausted)
        with pytest.raises(Unavailable, match="during this optim_step"):
            hit.optim_step("run", ADAM)
    assert _same_grads(_grads(hit, "run"), before)

    for engine in (hit, clean):  # it goes on as if the failed requests never came
        engine.forward_backward("run", _request(2, (7, 11)))
        engine.optim_step("run", ADAM)
    assert all(torch.equal(a, b) for a, b in zip(*map(_weights_list, (hit, clean)), strict=True))


# -- on a GPU (skipped without one; not run by this work, which had none) -------------------------


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_on_a_cuda_device_the_engine_trains_there(tmp_path: Path) -> None:
    """The same run on the CPU in float32, on CUDA in float32 and on CUDA in bfloat16: the
    weights where the placement says, float32 outputs close to the CPU's, float32 gradients, and
    a checkpoint that loads back on the CPU."""
    engines = {}
    for where, dtype in (("cpu", torch.float32), ("cuda", torch.float32), ("cuda", torch.bfloat16)):
        placement = Placement(torch.device(where), dtype, HUGE)
        engine = TrainerEngine(models.default_cache_dir(), placement=placement)
        engine.init_compute_thread()
        _create(engine, "run", seed=5)
        assert {p.device.type for p in engine.bases[TINY].model.parameters()} == {where}
        assert {p.device.type for p in engine.runs["run"].params.values()} == {where}
        engines[(where, dtype)] = engine
    request = _request(4, (9, 30, 5), "ppo")
    outputs = {key: _outputs(e.forward_backward("run", request)) for key, e in engines.items()}
    cpu = outputs[("cpu", torch.float32)]
    for key, tolerance in ((("cuda", torch.float32), 1e-4), (("cuda", torch.bfloat16), 0.1)):
        for got, want in zip(outputs[key][0], cpu[0], strict=True):
            assert got.dtype == np.float32
            np.testing.assert_allclose(got, want, atol=tolerance)
        run = engines[key].runs["run"]
        assert all(
            p.grad is not None and p.grad.dtype == torch.float32 for p in run.params.values()
        )
        assert engines[key].held_bytes() >= torch.cuda.memory_allocated()
    gpu = engines[("cuda", torch.bfloat16)]
    gpu.optim_step("run", ADAM)
    gpu.export("run", tmp_path, with_optimizer=True)
    engines[("cpu", torch.float32)].load("run", tmp_path, with_optimizer=True)
    for a, b in zip(
        _weights_list(gpu), _weights_list(engines[("cpu", torch.float32)]), strict=True
    ):
        assert torch.equal(a.cpu(), b)
