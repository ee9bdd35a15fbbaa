"""What cutting a large request into slices costs and buys, side by side in one run.

The trainer runs a forward_backward longer than a slice (``TrainerEngine.plan``: at most
``--slice`` padded tokens a pass, by default the device's ``engine.default_slice_tokens``) as
several passes, and serves other runs' requests between them. Two engines (services/trainer/
engine.py) on the same base model hold one run each (rank 16, adapters on the attention and MLP
projections and ``lm_head``): one cuts requests into slices, the other runs each in one pass
(``slice_tokens=0``), memory permitting. For each request shape (``--shapes``: datums x tokens,
cross-entropy), alternating step by step after one warm-up step each:

- the median seconds of the request's forward_backward and optim_step each way, and the ratio
  sliced / whole (the cost of the extra passes: the target is about 1.0);
- the passes, and the longest of them on the sliced engine, against the whole request on the
  other: how long another run's request can wait behind this one (the trainer's fuser serves it
  between two passes).

The engines compute where the trainer would (``TINSMITH_DEVICE``, ``TINSMITH_DTYPE``), with
the host allocator the trainer's process sets, each timed call ending with the device
synchronized.

    .venv/bin/python -m bench.slices [--model tinsmith/small] [--shapes 8x256 16x256 32x256
        8x1024] [--slice N] [--steps 5] [--threads N]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from bench.fused_training import ADAM, RANK, cross_entropy_request
from services.device import placement_from_env, synchronize
from services.trainer.engine import TrainerEngine, default_slice_tokens
from tinsmith import host_allocator, models, runtime
from tinsmith._proto import bus_pb2 as bus


def _engine(model: str, threads: int, slice_tokens: int) -> TrainerEngine:
    torch.set_num_threads(threads)
    engine = TrainerEngine(
        models.default_cache_dir(), threads, placement_from_env(), slice_tokens=slice_tokens
    )
    lora = bus.LoraConfig(rank=RANK, seed=1, train_attn=True, train_mlp=True, train_unembed=True)
    engine.create_run("run", bus.CreateModel(session_id="S", base_model=model, lora=lora))
    return engine


def _shape(text: str) -> tuple[int, int]:
    datums, _, tokens = text.partition("x")
    return int(datums), int(tokens)


def measure(
    model: str, datums: int, tokens: int, slice_tokens: int, steps: int, threads: int
) -> dict[str, float]:
    """Median step seconds each way, the sliced engine's passes and its longest pass."""
    vocab = models.get(model).vocab_size
    sliced, whole = _engine(model, threads, slice_tokens), _engine(model, threads, 0)
    device = sliced.placement.device
    times: dict[str, list[float]] = {"sliced": [], "whole": [], "longest": []}
    passes = 0
    for step in range(steps + 1):
        request = cross_entropy_request([tokens] * datums, step, vocab)
        # Sliced: pass by pass, as the trainer runs it, each pass timed.
        synchronize(device)
        started = time.perf_counter()
        begun, longest = sliced.begin("run", request), 0.0
        while True:
            mark = time.perf_counter()
            output = sliced.advance(begun)
            synchronize(device)
            longest = max(longest, time.perf_counter() - mark)
            if output is not None:
                break
        sliced.optim_step("run", ADAM)
        synchronize(device)
        elapsed = time.perf_counter() - started
        passes = len(begun.plan)
        if step:
            times["sliced"].append(elapsed)
            times["longest"].append(longest)
        started = time.perf_counter()
        whole.forward_backward("run", request)
        whole.optim_step("run", ADAM)
        synchronize(device)
        if step:
            times["whole"].append(time.perf_counter() - started)
    medians = {name: statistics.median(values) for name, values in times.items()}
    return {**medians, "passes": float(passes)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=models.SMALL)
    parser.add_argument("--shapes", nargs="+", default=["8x256", "16x256", "32x256", "8x1024"])
    parser.add_argument("--slice", type=int, default=None, help="default: the device's")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--threads", type=int, default=runtime.torch_threads())
    args = parser.parse_args(argv)
    host_allocator.tune()
    placement = placement_from_env()
    slice_tokens = default_slice_tokens(placement.device) if args.slice is None else args.slice
    print(
        f"{args.model}, rank {RANK}, on {placement.describe()}, {args.threads} torch threads; "
        f"slices of at most {slice_tokens} padded tokens; median of {args.steps} steps"
    )
    print(
        f"{'request':>9} {'tokens':>7} {'passes':>6} {'whole s':>8} {'sliced s':>9} {'ratio':>6}"
        f" {'longest pass s':>15}"
    )
    for text in args.shapes:
        datums, tokens = _shape(text)
        got = measure(args.model, datums, tokens, slice_tokens, args.steps, args.threads)
        print(
            f"{text:>9} {datums * tokens:>7} {int(got['passes']):>6} {got['whole']:>8.3f} "
            f"{got['sliced']:>9.3f} {got['sliced'] / got['whole']:>6.2f} {got['longest']:>15.3f}"
        )
    print(
        "ratio: sliced / whole step time (the cost of the extra passes); longest pass: the most "
        "another run's request waits behind this one, against the whole step in one pass"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
