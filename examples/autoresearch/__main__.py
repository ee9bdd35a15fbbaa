"""``python -m examples.autoresearch``: the command line, and the private tinsmith it starts
when no ``--url`` is given.

Owns: the options, the choice between a given server and a private one
(``examples/private.py``, as for ``make demo``), and the admin key issued on a private one for
the busy share. Does not own: the sweep (``sweep``) or its report (``report``).
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import sys
import time
import uuid
from collections.abc import Sequence
from pathlib import Path

from examples.autoresearch import report
from examples.autoresearch.sweep import LOSS_FNS, Options, grid, run_sweep
from examples.private import with_private_tinsmith
from examples.sft_pig_latin import DEFAULT_MODEL, HideLongPollRetries
from tinsmith import keyadmin
from tinsmith._proto import bus_pb2 as bus

DEFAULT_KEY = "tml-autoresearch"  # tinsmith's open mode (loopback) takes any tml- key


def parser() -> argparse.ArgumentParser:
    doc = sys.modules["examples.autoresearch"].__doc__ or ""
    out = argparse.ArgumentParser(
        prog="python -m examples.autoresearch", description=doc.split("\n")[0]
    )
    option = out.add_argument
    option(
        "--url",
        default=os.environ.get("TINKER_BASE_URL"),
        help="the tinsmith or Tinker URL (default: $TINKER_BASE_URL; if neither is given, a"
        " private tinsmith up is started and stopped)",
    )
    option("--runs", type=int, default=4, help="runs in the first rung (default: %(default)s)")
    option(
        "--rung-steps",
        type=int,
        default=8,
        help="steps of the first rung; each rung after it doubles them (default: %(default)s)",
    )
    option("--batch", type=int, default=8, help="examples per step (default: %(default)s)")
    option("--base-model", default=DEFAULT_MODEL, help="the model (default: %(default)s)")
    option("--sweep", help="the sweep's id (default: autoresearch-<random>)")
    option(
        "--plot", type=Path, default=".tinsmith/autoresearch.png", help="PNG (default: %(default)s)"
    )
    # String defaults go through `type` like the flags do, and show as typed in --help.
    option("--lrs", type=_floats, default="1e-3,5e-3", help="learning rates (default: %(default)s)")
    option("--ranks", type=_ints, default="8,32", help="LoRA ranks (default: %(default)s)")
    option(
        "--losses",
        type=_losses,
        default=",".join(LOSS_FNS),
        help="loss variants (default: %(default)s)",
    )
    option("--seed", type=int, default=0, help="LoRA init and data order (default: %(default)s)")
    option(
        "--admin-key",
        default=os.environ.get("TINSMITH_ADMIN_KEY"),
        help="an admin key, for the engines' busy share (default: $TINSMITH_ADMIN_KEY, else the"
        " API key; a private tinsmith issues one)",
    )
    return out


def main(argv: Sequence[str] | None = None) -> int:
    command = parser()
    args = command.parse_args(argv)
    try:
        grid(args.lrs, args.ranks, args.losses, args.runs)
    except ValueError as exc:  # before any server is started or called
        command.error(str(exc))
    os.environ.setdefault("TINKER_TELEMETRY", "0")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    logging.getLogger("tinker.lib.api_future_impl").addFilter(HideLongPollRetries())
    if args.url:
        return run(args, args.url, args.admin_key)
    os.environ.setdefault("TINKER_API_KEY", DEFAULT_KEY)
    return privately(args)


def run(args: argparse.Namespace, url: str, admin_key: str | None) -> int:
    """Run the sweep against ``url`` and print its report; the exit status."""
    api_key = os.environ.get("TINKER_API_KEY")
    if not api_key:
        print("set TINKER_API_KEY (tinsmith takes any tml-... key)", file=sys.stderr)
        return 2
    options = Options(
        url=url,
        api_key=api_key,
        sweep_id=args.sweep or f"autoresearch-{uuid.uuid4().hex[:8]}",
        base_model=args.base_model,
        runs=args.runs,
        rung_steps=args.rung_steps,
        batch=args.batch,
        learning_rates=args.lrs,
        ranks=args.ranks,
        losses=args.losses,
        seed=args.seed,
        admin_key=admin_key,
    )
    started = time.monotonic()
    print(f"sweep {options.sweep_id} against {url}: {options.runs} runs of {options.base_model}")
    result = asyncio.run(run_sweep(options))
    report.print_report(result, url)
    written = report.plot(result, args.plot)
    if written is not None:
        print(f"plot: {written}")
    print(f"done in {time.monotonic() - started:.0f}s")
    return 0


def privately(args: argparse.Namespace) -> int:
    """Run the sweep against a private tinsmith, with an admin key issued there for the busy
    share: the sweep's exit status."""
    # The trainer and the sampler keep their default of half the cores each: unlike the demo's,
    # the sweep's trainer and sampler work at the same time.
    return with_private_tinsmith(
        "autoresearch",
        lambda url, data_dir: run(args, url, args.admin_key or issue_admin_key(data_dir)),
    )


def issue_admin_key(data_dir: Path) -> str:
    """An admin key on the ``tinsmith up`` of ``data_dir``, as ``tinsmith keys create --tenant
    autoresearch-ops --admin --data-dir DIR`` issues it (the engines view is the operators')."""

    async def issue() -> str:
        source = keyadmin.locate(None, data_dir)
        async with keyadmin.KeyAdmin.connect(source) as keys:
            key, _ = await keys.issue(
                "autoresearch-ops", admin=True, overrides=bus.Quotas(), label="busy share"
            )
        return key

    return asyncio.run(issue())


def _floats(text: str) -> tuple[float, ...]:
    return tuple(float(item) for item in text.split(","))


def _ints(text: str) -> tuple[int, ...]:
    return tuple(int(item) for item in text.split(","))


def _losses(text: str) -> tuple[str, ...]:
    losses = tuple(text.split(","))
    unknown = [loss for loss in losses if loss not in LOSS_FNS]
    if unknown:
        raise argparse.ArgumentTypeError(f"unknown loss {unknown[0]!r}: use {', '.join(LOSS_FNS)}")
    return losses


if __name__ == "__main__":
    try:
        sys.exit(main())
    except KeyboardInterrupt:  # with --url; a private tinsmith's run has stopped it already
        print("\ninterrupted", file=sys.stderr)
        sys.exit(130)
