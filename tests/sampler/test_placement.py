"""Where and in what precision the torch sampler computes (services/device.py's Placement), on
tinsmith/tiny: base weights in the placement's dtype and adapters in float32, logprobs in float32;
and the sampler scores tokens as the trainer does, to 1e-5 on the CPU in float32, through an
adapter the trainer trained and exported. On a CUDA machine, the same engine on the GPU."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from services.device import Placement, total_memory
from services.sampler.engine import run_all
from services.sampler.memory import Rows
from services.sampler.torch_engine import TorchEngine
from services.trainer.engine import TrainerEngine
from tests.sampler.test_engine import BASE, _command, _decode, _prompt, _save_adapter
from tinsmith import models
from tinsmith._proto import bus_pb2 as bus
from tinsmith._proto import tinker_public_pb2 as tp
from tinsmith.tensors import unbatch

# The largest gap between the trainer's and the sampler's logprobs of the same tokens, on the
# CPU in float32 (they share the weights, PEFT's LoRA arithmetic and a float32 log-softmax;
# what differs is the batch layout: left padding with positions against right padding, and PEFT's
# mixed-adapter path against its active-adapter path).
AGREEMENT = 1e-5


def _placement(where: str, dtype: torch.dtype) -> Placement:
    device = torch.device(where)
    return Placement(device, dtype, total_memory(device))


def _commands(adapter: str) -> list[bus.Sample]:
    scored = _command(_prompt(71, 13), adapter, n=3, max_tokens=9, seed=7, prompt_logprobs=True)
    scored.topk_sample_logprobs = 2
    return [
        scored,
        _command(_prompt(72, 6), "", n=2, max_tokens=7, seed=8, temperature=0.0),
    ]


def test_base_weights_take_the_placements_dtype_and_adapters_stay_float32(
    tmp_path: Path,
) -> None:
    _save_adapter(tmp_path, 1, ["q_proj", "v_proj", "down_proj", "lm_head"])
    outcomes = {}
    for dtype in (torch.float32, torch.bfloat16):
        engine = TorchEngine(models.default_cache_dir(), placement=_placement("cpu", dtype))
        engine.load_adapter(BASE, "adapter/a", tmp_path)
        loaded = engine.bases[BASE]
        assert loaded.slots is not None
        lora = {
            tensor.dtype
            for module in loaded.slots.modules.values()
            for stack in module.stacks.values()
            for tensor in (stack.A, stack.B)
        }
        base = {p.dtype for p in loaded.model.parameters()}
        assert (lora, base) == ({torch.float32}, {dtype})
        engine.add(0, _commands("adapter/a")[0])
        engine.step()
        # The KV cache is in the model's dtype, and counted as such.
        batch = engine._batches[BASE]
        assert batch.cache.layers[0].keys.dtype == dtype  # type: ignore[union-attr]
        assert batch.logits.dtype == torch.float32
        rows, width = len(batch.rows), batch.mask.shape[1]
        costs = engine.bases[BASE].costs
        kv = Rows(costs, rows=rows, width=width).parts(64)["kv"]
        # and the columns its growing layers take to spare (services/sampler/decoder.py)
        left = sum(row.request.command.params.max_tokens - len(row.tokens) for row in batch.rows)
        spare = rows * (left // rows) * costs.layer_column * len(batch.cache.layers)
        assert engine.memory()["kv"] == kv + spare
        engine.cancel(0)
        engine.step()
        outcomes[dtype] = [_decode(o) for o in run_all(engine, _commands("adapter/a"))]
    # bfloat16 weights move the numbers, not much on this model; every logprob is float32.
    for exact, low in zip(outcomes[torch.float32], outcomes[torch.bfloat16], strict=True):
        assert len(exact.sequences) == len(low.sequences)
        for sequence in low.sequences:
            assert np.isfinite(np.frombuffer(sequence.logprobs, "<f4")).all()
        if exact.prompt_logprobs:
            gap = np.nanmax(
                np.abs(
                    np.frombuffer(exact.prompt_logprobs, "<f4")
                    - np.frombuffer(low.prompt_logprobs, "<f4")
                )
            )
            assert 0 < gap < 2e-2


def _forward_request(tokens: list[int], *, forward_only: bool = True) -> tp.ForwardBackwardRequest:
    """Cross-entropy on each token after the first."""
    request = tp.ForwardBackwardRequest(loss_fn="cross_entropy", forward_only=forward_only)
    datum = request.data.add()
    datum.model_input.add().encoded_text.tokens = np.asarray(tokens[:-1], "<i4").tobytes()
    targets = np.asarray(tokens[1:], "<i8")
    datum.loss_fn_inputs["target_tokens"].CopyFrom(
        tp.Tensor(dense=targets.tobytes(), dtype=tp.DTYPE_INT64, shape=[len(targets)])
    )
    return request


def _trainer_logprobs(trainer: TrainerEngine, model_id: str, tokens: list[int]) -> np.ndarray:
    """The trainer's forward: the logprob of each token after the first."""
    output = tp.ForwardBackwardOutput.FromString(
        trainer.forward_backward(model_id, _forward_request(tokens))
    )
    return unbatch(output.loss_fn_outputs[0].fields["logprobs"])[0]


def test_the_sampler_scores_tokens_as_the_trainer_does(tmp_path: Path) -> None:
    trainer = TrainerEngine(models.default_cache_dir())
    lora = bus.LoraConfig(rank=8, seed=3, train_attn=True, train_mlp=True, train_unembed=True)
    trainer.create_run("run", bus.CreateModel(session_id="S", base_model=BASE, lora=lora))
    for step in range(3):  # LoRA's B starts at zero: train it away from the base model
        trainer.forward_backward(
            "run", _forward_request(_prompt(60 + step, 24), forward_only=False)
        )
        trainer.optim_step(
            "run", bus.AdamParams(learning_rate=0.05, beta1=0.9, beta2=0.95, eps=1e-8)
        )
    trainer.export("run", tmp_path, with_optimizer=False)
    sampler = TorchEngine(models.default_cache_dir())
    sampler.load_adapter(BASE, "adapter/run", tmp_path)

    prompt = _prompt(73, 16)
    command = _command(prompt, "adapter/run", n=4, max_tokens=12, seed=9, stop_tokens=[])
    command.prompt_logprobs = True
    beside = _command(_prompt(74, 9), "", n=4, max_tokens=12, seed=10)  # a batch of both kinds
    response = _decode(run_all(sampler, [command, beside])[0])
    base_gap = 0.0
    for sequence in response.sequences:
        tokens = prompt + np.frombuffer(sequence.tokens, "<i4").tolist()
        sampled = np.concatenate(
            [
                np.frombuffer(response.prompt_logprobs, "<f4")[1:],
                np.frombuffer(sequence.logprobs, "<f4"),
            ]
        )
        trained = _trainer_logprobs(trainer, "run", tokens)
        assert sampled.shape == trained.shape
        assert np.abs(sampled - trained).max() <= AGREEMENT
        base_gap = max(base_gap, float(np.abs(sampled - _base_logprobs(tokens)).max()))
    assert base_gap > 100 * AGREEMENT  # the adapter matters: this compares adapted forwards


def _base_logprobs(tokens: list[int]) -> np.ndarray:
    engine = TorchEngine(models.default_cache_dir())
    response = _decode(run_all(engine, [_command(tokens, max_tokens=0, prompt_logprobs=True)])[0])
    return np.frombuffer(response.prompt_logprobs, "<f4")[1:]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_on_a_cuda_device_the_engine_computes_there(tmp_path: Path) -> None:
    _save_adapter(tmp_path, 1, ["q_proj", "v_proj", "down_proj"])
    results = {}
    for where, dtype in (("cpu", torch.float32), ("cuda", torch.float32), ("cuda", torch.bfloat16)):
        engine = TorchEngine(models.default_cache_dir(), placement=_placement(where, dtype))
        engine.init_compute_thread()
        engine.load_adapter(BASE, "adapter/a", tmp_path)
        devices = {p.device.type for p in engine.bases[BASE].model.parameters()}
        assert devices == {where}
        results[(where, dtype)] = [_decode(o) for o in run_all(engine, _commands("adapter/a"))]
    cpu, gpu = results[("cpu", torch.float32)], results[("cuda", torch.float32)]
    for a, b in zip(cpu, gpu, strict=True):
        if a.prompt_logprobs:
            np.testing.assert_allclose(
                np.frombuffer(b.prompt_logprobs, "<f4"),
                np.frombuffer(a.prompt_logprobs, "<f4"),
                atol=1e-4,
            )
    # Greedy tokens agree across devices; sampled ones come from another generator.
    assert [s.tokens for s in cpu[1].sequences] == [s.tokens for s in gpu[1].sequences]
    # bfloat16 weights on the GPU: float32 logprobs, near the float32 ones.
    low = results[("cuda", torch.bfloat16)]
    gap = np.nanmax(
        np.abs(
            np.frombuffer(low[0].prompt_logprobs, "<f4")
            - np.frombuffer(cpu[0].prompt_logprobs, "<f4")
        )
    )
    assert gap < 5e-2
