"""``python -m examples.text_to_sql``: the command line, and the private tinsmith it starts when
no ``--url`` is given.

Owns: the options (the CPU defaults, and ``--gpu`` for the larger configuration), building the
database and the questions, the choice between a given server and a private one
(``examples/private.py``, as for ``make demo``), and printing as the run goes. Does not own: the
training (``loop``) or the tables (``report``).
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import sys
import time
from collections.abc import Sequence
from dataclasses import fields, replace
from typing import Any

from tqdm import tqdm

from examples.private import with_private_tinsmith
from examples.sft_pig_latin import DEFAULT_MODEL, HideLongPollRetries
from examples.text_to_sql import loop, questions, report
from examples.text_to_sql.database import Database

DEFAULT_KEY = "tml-text-to-sql"  # tinsmith's open mode (loopback) takes any tml- key
# The larger configuration, for a GPU (not measured on one here): a warm start of about three
# passes over the training questions, RL on 32 questions x 16 answers a step, and every held-out
# question evaluated; the same learning rates.
GPU = {
    "sft_steps": 24,
    "sft_batch": 32,
    "rl_steps": 40,
    "rl_batch": 32,
    "group": 16,
    "eval_size": 200,
}


def parser() -> argparse.ArgumentParser:
    doc = sys.modules["examples.text_to_sql"].__doc__ or ""
    out = argparse.ArgumentParser(
        prog="python -m examples.text_to_sql", description=doc.split("\n")[0]
    )
    option = out.add_argument
    option(
        "--url",
        default=os.environ.get("TINKER_BASE_URL"),
        help="the tinsmith or Tinker URL (default: $TINKER_BASE_URL; if neither is given, a"
        " private tinsmith up is started and stopped)",
    )
    option("--base-model", default=DEFAULT_MODEL, help="the model (default: %(default)s)")
    option(
        "--gpu",
        action="store_true",
        help="the larger configuration: "
        + ", ".join(f"--{name.replace('_', '-')} {value}" for name, value in GPU.items())
        + " (flags given beside it win)",
    )
    defaults = {f.name: f.default for f in fields(loop.Options)}
    for name, kind, text in (
        ("sft_steps", int, "warm-start (SFT) steps; 0 for none"),
        ("sft_batch", int, "examples per warm-start step"),
        ("sft_lr", float, "warm-start peak learning rate (decays linearly to a tenth)"),
        ("rl_steps", int, "RL steps"),
        ("rl_batch", int, "questions per RL step"),
        ("group", int, "answers sampled per question"),
        ("rl_lr", float, "RL learning rate"),
        ("temperature", float, "sampling temperature of the RL answers"),
        ("max_tokens", int, "tokens per answer"),
        ("eval_size", int, "held-out questions evaluated"),
        ("tokens_per_call", int, "model-input tokens per forward_backward request; 0: one"),
        ("rank", int, "LoRA rank"),
        ("seed", int, "the database, the questions, their split and order, the LoRA init"),
    ):
        option(f"--{name.replace('_', '-')}", type=kind, help=f"{text} (default: {defaults[name]})")
    option(
        "--loss",
        choices=["importance_sampling", "ppo"],
        help=f"the RL loss (default: {defaults['loss']})",
    )
    option("--show", type=int, default=8, help="held-out questions printed (default: %(default)s)")
    return out


def options(args: argparse.Namespace, url: str, api_key: str) -> loop.Options:
    """The defaults of ``loop.Options``, then ``--gpu``'s, then the flags given."""
    chosen: dict[str, Any] = dict(GPU) if args.gpu else {}
    for f in fields(loop.Options):
        value = getattr(args, f.name, None)
        if value is not None and f.name not in ("url", "api_key", "base_model"):
            chosen[f.name] = value
    return replace(loop.Options(url, api_key, args.base_model), **chosen)


def main(argv: Sequence[str] | None = None) -> int:
    command = parser()
    args = command.parse_args(argv)
    for name in ("sft_batch", "rl_batch", "group", "max_tokens", "eval_size"):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            command.error(f"--{name.replace('_', '-')} must be at least 1")
    if args.tokens_per_call is not None and args.tokens_per_call < 0:
        command.error("--tokens-per-call must be 0 (a step in one request) or more")
    if args.group is not None and args.group < 2:
        command.error("--group must be at least 2: advantages are relative to the group")
    os.environ.setdefault("TINKER_TELEMETRY", "0")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    logging.getLogger("tinker.lib.api_future_impl").addFilter(HideLongPollRetries())
    if args.url:
        return run(args, args.url)
    os.environ.setdefault("TINKER_API_KEY", DEFAULT_KEY)
    # The RL loop samples and trains in turn, never both at once: each may use every core
    # (they default to half each, for loops that overlap them), as in make demo.
    os.environ.setdefault("TINSMITH_TORCH_THREADS", str(os.cpu_count() or 1))
    return with_private_tinsmith("text-to-sql", lambda url, _: run(args, url))


def run(args: argparse.Namespace, url: str) -> int:
    """Build the data, train against ``url`` and print as it goes; the exit status."""
    api_key = os.environ.get("TINKER_API_KEY")
    if not api_key:
        print("set TINKER_API_KEY (tinsmith takes any tml-... key)", file=sys.stderr)
        return 2
    config = options(args, url, api_key)
    started = time.monotonic()
    database = Database(config.seed)
    split = questions.split(questions.pairs(database, config.seed), seed=config.seed)
    held_out_templates = len(questions.HELD_OUT_TEMPLATES)
    print(
        f"database: {', '.join(f'{n} {t}' for t, n in database.counts().items())};"
        f" {len(split.train) + len(split.held_out)} questions from"
        f" {len(questions.TEMPLATES)} templates: {len(split.train)} to train on,"
        f" {len(split.held_out)} held out ({held_out_templates} templates whole)"
    )
    print(
        f"{config.base_model} against {url}: warm start {config.sft_steps} steps x"
        f" {config.sft_batch}, RL {config.rl_steps} steps x {config.rl_batch} questions x"
        f" {config.group} answers ({config.loss}), LoRA rank {config.rank}"
    )

    def show(evaluation: loop.Evaluation, result: loop.Result) -> None:
        with tqdm.external_write_mode():
            print(
                report.evaluation_table(evaluation, result.questions, result.split, args.show),
                flush=True,
            )

    result = asyncio.run(loop.run(config, database, split, show))
    print(report.summary(result, args.show, url))
    print(f"done in {time.monotonic() - started:.0f}s")
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except KeyboardInterrupt:  # with --url; a private tinsmith's run has stopped it already
        print("\ninterrupted", file=sys.stderr)
        sys.exit(130)
