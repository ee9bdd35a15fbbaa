"""What other work on the machine does to a training step, with OpenMP threads that spin while
they wait (OpenMP's default) and with threads that sleep (``OMP_WAIT_POLICY=PASSIVE``, which
``services/__init__.py`` sets for every service process).

Each setting runs in a fresh process (OpenMP reads its policy when torch loads): a forward and
backward pass of tinsmith/small on a batch of 8 x 128 tokens, repeated for ``--seconds``, with
``--threads`` torch threads, while ``--hogs`` other processes keep CPUs busy. The settings
alternate over ``--rounds``, so that machine noise hits both. It prints each setting's median
and worst step, and the ratio of the medians.

    .venv/bin/python -m bench.cpu_contention [--threads 2] [--hogs 1] [--seconds 8] [--rounds 2]

About a minute on 2 cores with the defaults.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

_STEPS = """
import json, subprocess, sys, time
import torch
from transformers import AutoModelForCausalLM
from tinsmith import models
torch.set_num_threads({threads})
small = models.materialize("tinsmith/small")
model = AutoModelForCausalLM.from_pretrained(small, dtype=torch.float32)
ids = torch.randint(0, 500, (8, 128))
busy = [sys.executable, "-c", "while True: pass"]
hogs = [subprocess.Popen(busy) for _ in range({hogs})]
try:
    for _ in range(2):
        model(input_ids=ids).logits.sum().backward()
    times, began = [], time.monotonic()
    while time.monotonic() - began < {seconds}:
        start = time.monotonic()
        model(input_ids=ids).logits.sum().backward()
        times.append(time.monotonic() - start)
    print(json.dumps(times))
finally:
    for hog in hogs:
        hog.kill()
"""


def _steps(policy: str, threads: int, hogs: int, seconds: float) -> list[float]:
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    env.pop("OMP_WAIT_POLICY", None)
    if policy:
        env["OMP_WAIT_POLICY"] = policy
    code = _STEPS.format(threads=threads, hogs=hogs, seconds=seconds)
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True
    )
    times: list[float] = json.loads(out.stdout.strip().splitlines()[-1])
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--hogs", type=int, default=1)
    parser.add_argument("--seconds", type=float, default=8.0)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    settings = {"spinning (OpenMP's default)": "", "sleeping (PASSIVE, tinsmith's)": "PASSIVE"}
    times: dict[str, list[float]] = {label: [] for label in settings}
    for _ in range(args.rounds):
        for label, policy in settings.items():
            times[label] += _steps(policy, args.threads, args.hogs, args.seconds)
    print(f"{args.threads} torch threads, {args.hogs} busy processes beside them")
    print(f"{'waiting threads':32}{'steps':>8}{'median ms':>12}{'worst ms':>12}")
    for label, steps in times.items():
        median = statistics.median(steps) * 1e3
        print(f"{label:32}{len(steps):>8}{median:>12.0f}{max(steps) * 1e3:>12.0f}")
    spinning, sleeping = (statistics.median(t) for t in times.values())
    print(f"median step, spinning / sleeping: {spinning / sleeping:.2f}x")


if __name__ == "__main__":
    main()
