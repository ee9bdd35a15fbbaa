"""A burst of prompts beside a request that decodes, in the torch sampling engine, with the
engine's prefill bound (``TINSMITH_SAMPLER_PREFILL_TOKENS``) and without it.

The engine is driven directly, in-process, on this thread (as the sampler's compute thread does,
with its intra-op thread count), on the device the sampler would use (``TINSMITH_DEVICE``, auto:
a GPU where there is one; each step reads its sampled tokens back, so a step's time is its
device work's): no bus, no gateway. One story per setting, on a fresh engine:

1. a running request (default 4 samples x 128 tokens, ``stop=[]``) is added and stepped;
2. after 8 of its steps, a burst of ``--burst`` requests (default 32, 2 samples x 16 tokens each)
   with ``--prompt``-token prompts (default 256) is added at once;
3. everything is stepped to its end.

The settings: the bound (``--bound``, one or more, default the device's,
``default_prefill_tokens``: 2048 prompt tokens a step on the CPU) against none (0: the whole
burst prefilled in one step, as before the bound). For each it prints the running request's
longest step after the burst came (how long its decoding stalled), the burst's last result
(seconds from its arrival), and the running request's own total. With ``--rounds`` above 1 the
settings take turns, in the reverse order every other round, and the medians are printed, with
each bound's ratio to none. A prompt longer than the bound (``--burst 1 --prompt 6144``, say) is
prefilled in chunks, one a step.

    .venv/bin/python -m bench.prefill_burst [--model tinsmith/small] [--burst 32] [--prompt 256]
        [--bound N [N ...]] [--rounds 3] [--threads N]
"""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import argparse
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import transformers

from bench.sample_fairness import command
from services.device import placement_from_env
from services.sampler.torch_engine import TorchEngine, default_prefill_tokens
from tinsmith import models

RUNNING = 0
ARRIVE = 8  # steps of the running request before the burst comes


@dataclass(frozen=True)
class Story:
    longest_step: float  # the running request's, from the burst's arrival on
    burst_seconds: float  # from the burst's arrival to its last result
    running_seconds: float


def story(args: argparse.Namespace, bound: int, prompts: list[list[int]]) -> Story:
    engine = TorchEngine(
        models.default_cache_dir(), args.threads, placement=args.placement, prefill_tokens=bound
    )
    engine.init_compute_thread()
    engine.load_base(args.model)
    engine.add(99, command(args.model, prompts[0][:16], 8, 4, seed=0))  # warm-up
    while engine.has_work():
        engine.step()

    started = time.perf_counter()
    engine.add(RUNNING, command(args.model, prompts[0][:32], 4, 128, seed=1))
    for _ in range(ARRIVE):
        engine.step()
    arrived = time.perf_counter()
    for n in range(args.burst):
        engine.add(1 + n, command(args.model, prompts[1 + n], 2, 16, seed=2 + n))
    longest, done = 0.0, {}
    while engine.has_work():
        mark = time.perf_counter()
        outcomes = engine.step()
        now = time.perf_counter()
        if RUNNING not in done:
            longest = max(longest, now - mark)
        for ticket, outcome in outcomes:
            if isinstance(outcome, Exception):
                raise outcome
            done[ticket] = now
    burst_end = max(at for ticket, at in done.items() if ticket != RUNNING)
    return Story(longest, burst_end - arrived, done[RUNNING] - started)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=models.SMALL)
    parser.add_argument("--burst", type=int, default=32, help="requests in the burst")
    parser.add_argument("--prompt", type=int, default=256, help="tokens of each burst prompt")
    parser.add_argument(
        "--bound", type=int, nargs="+", default=None, help="one or more; default: the device's"
    )
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=max(1, (os.cpu_count() or 2) // 2))
    args = parser.parse_args(argv)
    transformers.utils.logging.disable_progress_bar()
    args.placement = placement_from_env()
    bounds = args.bound or [default_prefill_tokens(args.placement.device)]
    vocab = models.get(args.model).vocab_size
    rng = np.random.default_rng(0)
    prompts = rng.integers(vocab // 4, 3 * vocab // 4, (1 + args.burst, args.prompt)).tolist()
    print(
        f"{args.model}, {args.threads} thread(s): a request of 4 samples x 128 tokens decoding; "
        f"after {ARRIVE} of its steps, {args.burst} requests of {args.prompt}-token prompts "
        f"({args.burst * args.prompt} tokens), 2 samples x 16 tokens each"
    )
    settings = {**{f"bound {bound}": bound for bound in bounds}, "no bound": 0}
    stories: dict[str, list[Story]] = {name: [] for name in settings}
    for round_ in range(args.rounds):
        order = list(settings) if round_ % 2 == 0 else list(settings)[::-1]
        for name in order:
            s = story(args, settings[name], prompts)
            stories[name].append(s)
            print(
                f"  round {round_ + 1}, {name}: the running request's longest step "
                f"{s.longest_step:.3f} s, the burst done in {s.burst_seconds:.2f} s, the running "
                f"request in {s.running_seconds:.2f} s",
                flush=True,
            )
    rows = (
        ("the running request's longest step, s", "longest_step"),
        ("the burst's last result, s after it came", "burst_seconds"),
        ("the running request's total, s", "running_seconds"),
    )
    print(f"\nmedians over {args.rounds} rounds, and each bound's ratio to none")
    print(f"  {'':44s}" + "".join(f"{name:>12s}" for name in settings) + "   ratios")
    for label, attribute in rows:
        medians = [statistics.median(getattr(s, attribute) for s in stories[n]) for n in settings]
        ratios = " ".join(f"{m / medians[-1]:.2f}" for m in medians[:-1])
        print(f"  {label:44s}" + "".join(f"{m:12.3f}" for m in medians) + f"   {ratios}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
