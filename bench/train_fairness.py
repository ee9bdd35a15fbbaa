"""A small training run beside a large one, with the trainer's slices and without: how long the
small run's steps take while the large run keeps the trainer busy, side by side in one run.

Two ``tinsmith up`` run at once (each on a free port, with its own temporary data directory and
the shared model cache): one as configured (a request runs in passes of at most
``TINSMITH_TRAINER_SLICE_TOKENS``, the device's default, with other runs' requests between them)
and one with ``TINSMITH_TRAINER_SLICE_TOKENS=0`` (a request in as few passes as fit the memory,
as before slices). On each, through the official SDK, two LoRA runs (rank 16, cross-entropy) on
the model: the large one steps (``forward_backward`` of ``--large`` datums x tokens, then
``optim_step``) without pause, from a thread of its own; meanwhile the small one (``--small``)
steps ``--steps`` times, each step timed from submitting its forward_backward to its optim_step's
result. The systems take turns, a block each, ``--blocks`` times, after a warm-up step of each run.

Prints, for each system: the small run's median and 90th-percentile step seconds, the large run's
median step seconds, and the ratios configured / without slices (the small run's: how much
sooner it is served; the large run's: what the slices cost it).

    .venv/bin/python -m bench.train_fairness [--model tinsmith/small] [--large 16x512]
        [--small 2x64] [--steps 8] [--blocks 3]
"""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TINKER_TELEMETRY", "0")

import argparse
import statistics
import sys
import tempfile
import threading
import warnings
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import tinker

from bench.train_overhead import SystemSide, start_system
from tinsmith import models
from tinsmith.child import UpProcess, sigterm_as_interrupt

RANK = 16
SLICE_VARIABLE = "TINSMITH_TRAINER_SLICE_TOKENS"


def _tokens(model: str, shape: str, seed: int) -> np.ndarray:
    """``datums`` rows of ``tokens + 1`` random ids (inputs and shifted targets)."""
    datums, _, tokens = shape.partition("x")
    vocab = models.get(model).vocab_size
    rng = np.random.default_rng(seed)
    return rng.integers(3, vocab, size=(int(datums), int(tokens) + 1), dtype=np.int64)


@dataclass
class System:
    name: str
    up: UpProcess
    large: SystemSide
    small: SystemSide
    small_steps: list[float] = field(default_factory=list)
    large_steps: list[float] = field(default_factory=list)

    def block(self, steps: int) -> None:
        """The large run stepping without pause while the small one takes ``steps`` steps."""
        done = threading.Event()

        def keep_busy() -> None:
            while not done.is_set():
                self.large_steps.append(self.large.step())

        busy = threading.Thread(target=keep_busy, name=f"large-{self.name}")
        busy.start()
        try:
            for _ in range(steps):
                self.small_steps.append(self.small.step())
        finally:
            done.set()
            busy.join()


def start(name: str, env: dict[str, str], work: Path, model: str, large: str, small: str) -> System:
    cache = Path(os.environ.get("TINSMITH_CACHE_DIR", str(models.default_cache_dir())))
    up = start_system(work / name, cache, env=env)
    try:
        service = tinker.ServiceClient(base_url=up.url, api_key=f"tml-{name}")
        system = System(
            name,
            up,
            SystemSide(service, model, RANK, _tokens(model, large, 1)),
            SystemSide(service, model, RANK, _tokens(model, small, 2)),
        )
        system.large.step()  # warm-up: the base model loaded, each path taken once
        system.small.step()
        return system
    except BaseException:
        up.stop()
        raise


def _p90(values: list[float]) -> float:
    return float(np.percentile(values, 90))


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=models.SMALL)
    parser.add_argument("--large", default="16x512", help="datums x tokens (default 16x512)")
    parser.add_argument("--small", default="2x64", help="datums x tokens (default 2x64)")
    parser.add_argument("--steps", type=int, default=8, help="small-run steps a block")
    parser.add_argument("--blocks", type=int, default=3, help="blocks each system")
    args = parser.parse_args(argv)
    warnings.filterwarnings("ignore", category=FutureWarning)
    sigterm_as_interrupt()
    print(
        f"{args.model}: a run of {args.large} tokens stepping without pause beside one of "
        f"{args.small}, rank {RANK}; {args.blocks} blocks of {args.steps} small steps on each "
        f"system, taking turns; {os.cpu_count()} CPUs",
        flush=True,
    )
    systems: list[System] = []
    with tempfile.TemporaryDirectory(prefix="tinsmith-train-fairness-") as tmp:
        work = Path(tmp)
        try:
            systems.append(start("slices", {}, work, args.model, args.large, args.small))
            systems.append(
                start("one pass", {SLICE_VARIABLE: "0"}, work, args.model, args.large, args.small)
            )
            for _ in range(args.blocks):
                for system in systems:
                    system.block(args.steps)
        finally:
            for system in systems:
                system.up.stop()
    sliced, whole = systems
    print(f"\n{'':34s}{'slices':>10s}{'one pass':>10s}{'ratio':>8s}")
    rows = (
        ("small run's step, median s", statistics.median, "small_steps"),
        ("small run's step, 90th pct s", _p90, "small_steps"),
        ("large run's step, median s", statistics.median, "large_steps"),
    )
    for label, measure, attribute in rows:
        mine, theirs = (measure(getattr(s, attribute)) for s in (sliced, whole))
        print(f"  {label:32s}{mine:10.3f}{theirs:10.3f}{mine / theirs:8.2f}")
    for system in systems:
        print(
            f"  {system.name}: small steps {' '.join(f'{s:.2f}' for s in system.small_steps)}; "
            f"{len(system.large_steps)} large steps"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
