"""How long a short sample request waits behind a long one in the torch sampling engine, with the
engine's share of rows per request (``TINSMITH_SAMPLER_ROWS_PER_REQUEST``) and without it.

The engine is driven directly, in-process, on this thread (as the sampler's compute thread does,
with its intra-op thread count): no bus, no gateway. One story per setting, on a fresh engine:

1. a long request (default 256 samples x 256 tokens, ``stop=[]`` so every sequence runs to its
   last token) is added and stepped;
2. after ``--arrive`` steps, a short request (default 4 samples x 16 tokens) is added;
3. both are stepped to their ends.

The settings: the share (``--cap``, default the engine's default, 64 of 256 rows) against no share
(a request may take every row of the batch: cap = max_rows, as before the share existed). For
each it prints the short request's latency, from its ``add`` to its result, in steps and seconds,
and the long request's own total, in steps and seconds; then the ratios: the short request's
latency without the share over with it (how much sooner it is served), and the long request's
time with the share over without it (what the share costs the long request, alone here but for
the short one). With ``--rounds`` above 1 the settings alternate, so machine noise hits both, and
the medians are printed.

    .venv/bin/python -m bench.sample_fairness [--model tinsmith/small] [--samples 256]
        [--tokens 256] [--prompt 32] [--short-samples 4] [--short-tokens 16] [--arrive 16]
        [--cap 64] [--rounds 1] [--threads N]

About a minute and a half on 2 cores with the defaults (tinsmith/small is built on first use, a
few seconds).
"""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import argparse
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import transformers

from services.sampler.engine import DEFAULT_ROWS_PER_REQUEST
from services.sampler.torch_engine import DEFAULT_MAX_ROWS, TorchEngine
from tinsmith import models
from tinsmith._proto import bus_pb2 as bus
from tinsmith._proto import tinker_public_pb2 as tp

LONG, SHORT = 0, 1


@dataclass(frozen=True)
class Story:
    cap: int
    short_steps: int
    short_seconds: float
    long_steps: int
    long_seconds: float


def command(model: str, prompt: list[int], samples: int, tokens: int, seed: int) -> bus.Sample:
    params = tp.SamplingParams(max_tokens=tokens, temperature=1.0, top_k=-1, top_p=1.0, seed=seed)
    params.stop_tokens.SetInParent()  # stop=[]: every sequence has exactly ``tokens`` tokens
    return bus.Sample(base_model=model, prompt=prompt, params=params, num_samples=samples)


def story(args: argparse.Namespace, cap: int, long: bus.Sample, short: bus.Sample) -> Story:
    engine = TorchEngine(models.default_cache_dir(), args.threads, rows_per_request=cap)
    engine.init_compute_thread()
    engine.load_base(args.model)
    warm = command(args.model, list(long.prompt), 8, 4, seed=0)
    engine.add(99, warm)
    while engine.has_work():
        engine.step()

    started = time.perf_counter()
    engine.add(LONG, long)
    steps = 0
    arrived_at, arrived_step = 0.0, 0
    done: dict[int, tuple[int, float]] = {}
    while engine.has_work():
        if steps == args.arrive:
            engine.add(SHORT, short)
            arrived_at, arrived_step = time.perf_counter(), steps
        outcomes = engine.step()
        steps += 1
        for ticket, outcome in outcomes:
            if isinstance(outcome, Exception):
                raise outcome
            done[ticket] = (steps, time.perf_counter())
    short_step, short_end = done[SHORT]
    long_step, long_end = done[LONG]
    return Story(
        cap, short_step - arrived_step, short_end - arrived_at, long_step, long_end - started
    )


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default=models.SMALL)
    parser.add_argument("--samples", type=int, default=256, help="the long request's samples")
    parser.add_argument("--tokens", type=int, default=256, help="the long request's tokens")
    parser.add_argument("--prompt", type=int, default=32, help="tokens of each prompt")
    parser.add_argument("--short-samples", type=int, default=4)
    parser.add_argument("--short-tokens", type=int, default=16)
    parser.add_argument("--arrive", type=int, default=16, help="steps of the long one before")
    parser.add_argument("--cap", type=int, default=DEFAULT_ROWS_PER_REQUEST)
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--threads", type=int, default=max(1, (os.cpu_count() or 2) // 2))
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    transformers.utils.logging.disable_progress_bar()
    vocab = models.get(args.model).vocab_size
    rng = np.random.default_rng(0)
    prompts = rng.integers(vocab // 4, 3 * vocab // 4, (2, args.prompt)).tolist()
    long = command(args.model, prompts[0], args.samples, args.tokens, seed=1)
    short = command(args.model, prompts[1], args.short_samples, args.short_tokens, seed=2)
    print(
        f"{args.model}, {args.threads} thread(s), max_rows {DEFAULT_MAX_ROWS}: a long request of "
        f"{args.samples} samples x {args.tokens} tokens; after {args.arrive} of its steps, a short "
        f"one of {args.short_samples} x {args.short_tokens} (prompts of {args.prompt} tokens)"
    )
    caps = {"share": args.cap, "no share": DEFAULT_MAX_ROWS}
    stories: dict[str, list[Story]] = {name: [] for name in caps}
    for round_ in range(args.rounds):
        order = list(caps) if round_ % 2 == 0 else list(caps)[::-1]
        for name in order:
            stories[name].append(story(args, caps[name], long, short))
            s = stories[name][-1]
            print(
                f"  round {round_ + 1}, {name} (cap {s.cap}): short {s.short_steps} steps "
                f"{s.short_seconds:.2f} s, long {s.long_steps} steps {s.long_seconds:.2f} s",
                flush=True,
            )

    def median(name: str, field: str) -> float:
        return statistics.median(getattr(s, field) for s in stories[name])

    print()
    print(f"{'':<26}{'short steps':>12}{'short s':>10}{'long steps':>12}{'long s':>10}")
    for name, cap in caps.items():
        label = f"{name} (cap {cap})"
        print(
            f"{label:<26}{median(name, 'short_steps'):>12.0f}"
            f"{median(name, 'short_seconds'):>10.2f}{median(name, 'long_steps'):>12.0f}"
            f"{median(name, 'long_seconds'):>10.2f}"
        )
    print()
    print(
        "short request's latency, no share / share: "
        f"{median('no share', 'short_steps') / median('share', 'short_steps'):.1f}x in steps, "
        f"{median('no share', 'short_seconds') / median('share', 'short_seconds'):.1f}x in seconds"
    )
    print(
        "long request's own time, share / no share: "
        f"{median('share', 'long_steps') / median('no share', 'long_steps'):.2f}x in steps, "
        f"{median('share', 'long_seconds') / median('no share', 'long_seconds'):.2f}x in seconds"
    )
    print(f"load average at the end {os.getloadavg()[0]:.1f} (other processes slow both sides)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
