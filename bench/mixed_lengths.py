"""A training step over datums of mixed lengths, as RL batches are: what the host allocator and
cutting the batch into passes of similar lengths each save, measured side by side in one run.

The step is one run's ``forward_backward`` (cross-entropy) through the trainer's engine
(services/trainer/engine.py) on its own thread, as the trainer's compute thread runs it, over
``--datums`` datums whose lengths are drawn evenly from ``--shortest`` to ``--longest`` tokens
(seeded), against the same number of datums all of the mean length (the same tokens, no padding:
the floor).

1. The host allocator (tinsmith/host_allocator.py): the step in a child process with
   ``TINSMITH_HOST_ALLOCATOR=tuned`` and one with ``system`` (glibc's malloc as it is), the two
   alternating process by process, twice each; in each, the batch cut by length and as one
   padded pass, alternating step by step; median seconds, the minor page faults and the
   kernel's (system) seconds of a step. Each child does what the trainer does at start:
   ``tune`` first.
2. Passes of similar lengths (services/trainer/grouping.py): in one process (allocator tuned),
   two engines, one cutting the batch by length (``pass_tokens`` of the device's default) and
   one running it as one padded pass, alternating step by step; median seconds, the padded
   tokens of each plan, and the ratio. The even batch is timed too.
3. What a pass costs: a forward_backward of one datum of 4 to 256 tokens, and the least-squares
   line through them: the fixed seconds of a pass, the seconds a token, and their ratio, the
   pass's cost in tokens (the engine's ``default_pass_tokens`` on the CPU).

    .venv/bin/python -m bench.mixed_lengths [--model tinsmith/small] [--datums 20]
        [--shortest 163] [--longest 955] [--steps 5] [--threads N]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from bench.fused_training import cross_entropy_request
from tinsmith import host_allocator, models, runtime

PASS_SIZES = (4, 16, 64, 128, 256)
NEVER = 1 << 40  # a pass that costs this many tokens is never worth cutting a batch for


def _lengths(args: argparse.Namespace) -> tuple[list[int], list[int]]:
    rng = np.random.default_rng(0)
    mixed = rng.integers(args.shortest, args.longest + 1, size=args.datums).tolist()
    even = [sum(mixed) // len(mixed)] * len(mixed)
    return mixed, even


class _Engine:
    """A trainer engine with one run, computing on a thread of its own."""

    def __init__(self, model: str, threads: int, pass_tokens: int | None) -> None:
        import torch

        from services.trainer.engine import TrainerEngine
        from tinsmith._proto import bus_pb2 as bus

        torch.set_num_threads(threads)
        self.thread = ThreadPoolExecutor(1)
        self.engine = self.thread.submit(
            TrainerEngine, models.default_cache_dir(), threads, pass_tokens=pass_tokens
        ).result()
        lora = bus.LoraConfig(rank=16, seed=1, train_attn=True, train_mlp=True, train_unembed=True)
        create = bus.CreateModel(session_id="S", base_model=model, lora=lora)
        self.thread.submit(self.engine.create_run, "run", create).result()
        self.vocab = models.get(model).vocab_size

    def step(self, lengths: list[int], seed: int) -> dict[str, float]:
        """One forward_backward: its seconds, minor page faults and kernel seconds."""
        request = cross_entropy_request(lengths, seed, self.vocab)
        before = resource.getrusage(resource.RUSAGE_SELF)
        started = time.perf_counter()
        self.thread.submit(self.engine.forward_backward, "run", request).result()
        seconds = time.perf_counter() - started
        after = resource.getrusage(resource.RUSAGE_SELF)
        return {
            "s": seconds,
            "faults": after.ru_minflt - before.ru_minflt,
            "kernel_s": after.ru_stime - before.ru_stime,
        }

    def padded(self, lengths: list[int]) -> int:
        plan = self.engine.plan("run", lengths, backward=True)
        return sum(len(p.datums) * max(lengths[i] for i in p.datums) for p in plan)


def _child(args: argparse.Namespace) -> None:
    """Part 1's side: tune (or not, as the environment says), then warm-up and timed steps of
    the batch cut by length and of it as one pass, alternating."""
    said = host_allocator.tune()
    engines = {
        "cut by length": _Engine(args.model, args.threads, None),
        "one pass": _Engine(args.model, args.threads, NEVER),
    }
    mixed, _ = _lengths(args)
    steps: dict[str, list[dict[str, float]]] = {name: [] for name in engines}
    for k in range(args.steps + 1):
        for name, engine in engines.items():
            step = engine.step(mixed, k)
            if k:  # the first warms up
                steps[name].append(step)
    print(json.dumps({"said": said, "steps": steps}))


def _allocators(args: argparse.Namespace) -> None:
    print("\n1. the host allocator: the mixed batch's step in a child process of each")
    results: dict[tuple[str, str], list[dict[str, float]]] = {}
    for _ in range(2):
        for choice in ("tuned", "system"):
            out = subprocess.run(
                [sys.executable, "-m", "bench.mixed_lengths", "--child", *_passed(args)],
                env={**os.environ, host_allocator.VARIABLE: choice},
                capture_output=True,
                text=True,
                check=True,
            )
            for plan, steps in json.loads(out.stdout.splitlines()[-1])["steps"].items():
                results.setdefault((choice, plan), []).extend(steps)
    print(f"{'allocator':>10} {'plan':>14} {'median s':>9} {'faults/step':>12} {'kernel s':>9}")
    medians = {}
    for (choice, plan), steps in results.items():
        medians[choice, plan] = statistics.median(s["s"] for s in steps)
        faults = statistics.median(s["faults"] for s in steps)
        kernel = statistics.median(s["kernel_s"] for s in steps)
        print(
            f"{choice:>10} {plan:>14} {medians[choice, plan]:>9.3f} {faults:>12.0f} {kernel:>9.3f}"
        )
    for plan in ("cut by length", "one pass"):
        ratio = medians["system", plan] / medians["tuned", plan]
        print(f"{plan}: system / tuned {ratio:.2f}x", flush=True)


def _passed(args: argparse.Namespace) -> list[str]:
    return [
        *("--model", args.model, "--datums", str(args.datums), "--steps", str(args.steps)),
        *("--shortest", str(args.shortest), "--longest", str(args.longest)),
        *("--threads", str(args.threads)),
    ]


def _grouping(args: argparse.Namespace) -> None:
    mixed, even = _lengths(args)
    cut, whole = _Engine(args.model, args.threads, None), _Engine(args.model, args.threads, NEVER)
    print(
        f"\n2. passes of similar lengths ({args.datums} datums, {sum(mixed)} tokens; "
        f"pass_tokens {cut.engine.pass_tokens})"
    )
    for engine in (cut, whole):
        engine.step(mixed, 0)
    times: dict[str, list[float]] = {"cut by length": [], "one pass": [], "even lengths": []}
    for k in range(args.steps):
        times["cut by length"].append(cut.step(mixed, 1 + k)["s"])
        times["one pass"].append(whole.step(mixed, 1 + k)["s"])
        times["even lengths"].append(cut.step(even, 1 + k)["s"])
    padded = {
        "cut by length": cut.padded(mixed),
        "one pass": whole.padded(mixed),
        "even lengths": cut.padded(even),
    }
    passes = len(cut.engine.plan("run", mixed, backward=True))
    print(f"{'':>14} {'median s':>9} {'padded tokens':>14}")
    for name, values in times.items():
        print(f"{name:>14} {statistics.median(values):>9.3f} {padded[name]:>14}")
    ratio = statistics.median(times["one pass"]) / statistics.median(times["cut by length"])
    print(f"one pass / cut by length ({passes} passes): {ratio:.2f}x", flush=True)


def _pass_cost(args: argparse.Namespace) -> None:
    print("\n3. what a pass costs: one datum of N tokens")
    engine = _Engine(args.model, args.threads, None)
    engine.step([PASS_SIZES[0]], 0)
    medians = []
    for n in PASS_SIZES:
        medians.append(statistics.median(engine.step([n], k)["s"] for k in range(args.steps)))
        print(f"{n:>5} tokens {medians[-1] * 1000:>8.1f} ms", flush=True)
    slope, fixed = np.polyfit(np.array(PASS_SIZES, dtype=float), np.array(medians), 1)
    print(
        f"a pass: {fixed * 1000:.1f} ms + {slope * 1000:.3f} ms a token, "
        f"about {fixed / slope:.0f} tokens' worth"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default=models.SMALL)
    parser.add_argument("--datums", type=int, default=20)
    parser.add_argument("--shortest", type=int, default=163)
    parser.add_argument("--longest", type=int, default=955)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--threads", type=int, default=runtime.torch_threads())
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        _child(args)
        return
    models.materialize(args.model)
    print(
        f"{args.model}, rank 16, float32 on the CPU, {args.threads} torch threads, "
        f"{os.cpu_count()} CPUs; median of {args.steps} steps",
        flush=True,
    )
    _allocators(args)
    host_allocator.tune()  # parts 2 and 3 run as the trainer does
    _grouping(args)
    _pass_cost(args)


if __name__ == "__main__":
    main()
