"""Fused training against runs trained one after another, side by side in one run: what the
trainer's engine gains by running several runs' forward_backwards as one pass
(``TrainerEngine.forward_backward_together``), and where that stops paying.

Two engines (services/trainer/engine.py) on the same base model hold the same N runs (rank 16,
adapters on the attention and MLP projections and ``lm_head``, each its own seed). A step of
all N runs is, on one engine, each run's ``forward_backward`` then ``optim_step`` one after
another (what the trainer did before fusing), and on the other one ``forward_backward_together``
of the N requests then one ``optim_step_together`` of the N runs. Both engines run the same
requests (each run ``--datums`` datums of ``--tokens`` tokens, cross-entropy), alternating step
by step so that the machine's noise falls on both alike, after one unmeasured warm-up step each.

1. For 1, 4 and 16 runs (``--runs``): the median step time of each way, run-steps per second,
   trained tokens per second, and the ratio fused / one after another (the target on the CPU:
   at least 1.5 at 4 runs).
2. Where fusing stops paying: 4 runs with ``--sizes`` datums of ``--size-tokens`` tokens each,
   the same ratio per size, and the per-run batch size at which it first falls under 1.1 (the
   trainer fuses only requests smaller than that: ``TINSMITH_TRAINER_FUSE_REQUEST_TOKENS``).
3. The optim_steps alone: for each of ``--runs``, the median time of the N runs' ``optim_step``s
   one after another and of one ``optim_step_together``, after the same forward_backwards
   (unmeasured), and their ratio.

The engines compute where the trainer would (``TINSMITH_DEVICE``, ``auto``: a GPU where there
is one; base weights in ``TINSMITH_DTYPE``, services/device.py), with the host allocator the
trainer's process sets (``tinsmith.host_allocator.tune``), and each timed step ends with the
device synchronized, so a GPU's queued work is inside the step that queued it.

One run (1 or 16 runs alike) has nothing to fuse with: its ratio is the overhead of the fused
path, 1.0 within the noise.

    .venv/bin/python -m bench.fused_training [--model tinsmith/small] [--runs 1 4 16]
        [--datums 2] [--tokens 128] [--sizes 1 2 4 8 16 64] [--size-tokens 16] [--steps 5]
        [--threads N]
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
import torch
import transformers

from services.device import Placement, placement_from_env, synchronize
from services.trainer.engine import TrainerEngine
from tinsmith import host_allocator, models, runtime
from tinsmith._proto import bus_pb2 as bus
from tinsmith._proto import tinker_public_pb2 as tp

RANK = 16
ADAM = bus.AdamParams(learning_rate=1e-4, beta1=0.9, beta2=0.95, eps=1e-8, grad_clip_norm=1.0)


def _engine(model: str, runs: int, threads: int, placement: Placement) -> TrainerEngine:
    torch.set_num_threads(threads)
    engine = TrainerEngine(models.default_cache_dir(), threads, placement)
    lora = bus.LoraConfig(rank=RANK, train_attn=True, train_mlp=True, train_unembed=True)
    for n in range(runs):
        lora.seed = n
        engine.create_run(f"run-{n}", bus.CreateModel(session_id="S", base_model=model, lora=lora))
    return engine


def cross_entropy_request(lengths: list[int], seed: int, vocab: int) -> tp.ForwardBackwardRequest:
    """A cross-entropy forward_backward of random datums of ``lengths`` tokens (seeded)."""
    rng = np.random.default_rng(seed)
    request = tp.ForwardBackwardRequest(loss_fn="cross_entropy")
    for n in lengths:
        ids = rng.integers(3, vocab, size=n + 1)
        datum = request.data.add()
        datum.model_input.add().encoded_text.tokens = ids[:-1].astype("<i4").tobytes()
        datum.loss_fn_inputs["target_tokens"].CopyFrom(
            tp.Tensor(dense=ids[1:].astype("<i8").tobytes(), dtype=tp.DTYPE_INT64, shape=[n])
        )
    return request


def _one_after_another(
    engine: TrainerEngine, asks: list[tuple[str, tp.ForwardBackwardRequest]]
) -> None:
    for model_id, request in asks:
        engine.forward_backward(model_id, request)
        engine.optim_step(model_id, ADAM)


def _fused(engine: TrainerEngine, asks: list[tuple[str, tp.ForwardBackwardRequest]]) -> None:
    if len(asks) == 1:  # nothing to fuse with: the trainer runs it alone
        _one_after_another(engine, asks)
        return
    results = engine.forward_backward_together(asks)
    missing = [model_id for (model_id, _), out in zip(asks, results, strict=True) if out is None]
    if missing or not all(isinstance(out, bytes) for out in results):
        raise SystemExit(f"the engine did not fuse the pass: {results!r:.300}")
    _step_together(engine, [model_id for model_id, _ in asks])


def _steps_alone(engine: TrainerEngine, model_ids: list[str]) -> None:
    for model_id in model_ids:
        engine.optim_step(model_id, ADAM)


def _step_together(engine: TrainerEngine, model_ids: list[str]) -> None:
    if len(model_ids) == 1:
        _steps_alone(engine, model_ids)
        return
    results = engine.optim_step_together([(model_id, ADAM) for model_id in model_ids])
    if not all(isinstance(metrics, dict) for metrics in results):
        raise SystemExit(f"the engine did not step the runs together: {results!r:.300}")


def _compare_steps(
    model: str, runs: int, steps: int, threads: int, placement: Placement
) -> tuple[float, float]:
    """Median seconds of the runs' optim_steps, one after another and together."""
    vocab = models.get(model).vocab_size
    alone, together = (_engine(model, runs, threads, placement) for _ in range(2))
    times: dict[str, list[float]] = {"alone": [], "together": []}
    for step in range(steps + 1):
        asks = [
            (f"run-{n}", cross_entropy_request([16], 1000 * step + n, vocab)) for n in range(runs)
        ]
        ids = [model_id for model_id, _ in asks]
        for name, engine, way in (
            ("alone", alone, _steps_alone),
            ("together", together, _step_together),
        ):
            for model_id, request in asks:
                engine.forward_backward(model_id, request)
            synchronize(placement.device)
            started = time.perf_counter()
            way(engine, ids)
            synchronize(placement.device)
            if step:
                times[name].append(time.perf_counter() - started)
    return statistics.median(times["alone"]), statistics.median(times["together"])


def _compare(
    model: str, runs: int, datums: int, tokens: int, steps: int, threads: int, placement: Placement
) -> tuple[float, float]:
    """Median seconds of a step of all runs, one after another and fused."""
    vocab = models.get(model).vocab_size
    alone, fused = (_engine(model, runs, threads, placement) for _ in range(2))
    times: dict[str, list[float]] = {"alone": [], "fused": []}
    for step in range(steps + 1):
        asks = [
            (f"run-{n}", cross_entropy_request([tokens] * datums, 1000 * step + n, vocab))
            for n in range(runs)
        ]
        for name, engine, way in (("alone", alone, _one_after_another), ("fused", fused, _fused)):
            synchronize(placement.device)
            started = time.perf_counter()
            way(engine, asks)
            synchronize(placement.device)
            if step:  # the first step of each warms up
                times[name].append(time.perf_counter() - started)
    return statistics.median(times["alone"]), statistics.median(times["fused"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default=models.SMALL)
    parser.add_argument("--runs", type=int, nargs="+", default=[1, 4, 16])
    parser.add_argument("--datums", type=int, default=2)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--sizes", type=int, nargs="+", default=[1, 2, 4, 8, 16, 64])
    parser.add_argument("--size-tokens", type=int, default=16)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--threads", type=int, default=runtime.torch_threads())
    args = parser.parse_args()
    allocator = host_allocator.tune()  # as the trainer's process sets it (tinsmith/runtime.py)
    transformers.logging.disable_progress_bar()  # type: ignore[no-untyped-call]
    models.materialize(args.model)
    placement = placement_from_env()
    print(
        f"{args.model}, rank {RANK}, on {placement.describe()}, {args.threads} torch threads; "
        f"median of {args.steps} steps; host memory through {allocator}",
        flush=True,
    )
    print(f"\n1. runs of {args.datums} x {args.tokens} tokens each")
    print(
        f"{'runs':>5} {'alone s':>8} {'fused s':>8} {'alone run-steps/s':>18} "
        f"{'fused run-steps/s':>18} {'fused tok/s':>12} {'ratio':>6}"
    )
    for runs in args.runs:
        alone, fused = _compare(
            args.model, runs, args.datums, args.tokens, args.steps, args.threads, placement
        )
        tokens = runs * args.datums * args.tokens
        print(
            f"{runs:>5} {alone:>8.3f} {fused:>8.3f} {runs / alone:>18.2f} {runs / fused:>18.2f} "
            f"{tokens / fused:>12.0f} {alone / fused:>6.2f}",
            flush=True,
        )
    print(f"\n2. where fusing stops paying: 4 runs of N x {args.size_tokens} tokens each")
    print(f"{'N':>5} {'tokens/run':>10} {'alone s':>8} {'fused s':>8} {'ratio':>6}")
    stops = None
    for size in args.sizes:
        alone, fused = _compare(
            args.model, 4, size, args.size_tokens, args.steps, args.threads, placement
        )
        ratio = alone / fused
        print(
            f"{size:>5} {size * args.size_tokens:>10} {alone:>8.3f} {fused:>8.3f} {ratio:>6.2f}",
            flush=True,
        )
        if ratio < 1.1 and stops is None:
            stops = size * args.size_tokens
    if stops is None:
        print("fusing paid (>= 1.1x) at every size measured")
    else:
        print(f"fusing stops paying (< 1.1x) at {stops} tokens per run")
    print("\n3. optim_steps: the runs' steps one after another and as one AdamW step")
    print(f"{'runs':>5} {'alone ms':>9} {'together ms':>12} {'ratio':>6}")
    for runs in args.runs:
        alone, together = _compare_steps(args.model, runs, args.steps, args.threads, placement)
        print(
            f"{runs:>5} {alone * 1e3:>9.1f} {together * 1e3:>12.1f} {alone / together:>6.2f}",
            flush=True,
        )


if __name__ == "__main__":
    main()
