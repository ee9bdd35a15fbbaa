"""``make demo``: start a private tinsmith, teach a model pig latin through it, stop it again.

Run from the repository root::

    python -m examples.demo [options of examples/sft_pig_latin.py, e.g. --steps 20]

It runs ``examples/sft_pig_latin.py``, with the same Python, against a private ``tinsmith up``
(``examples/private.py``: a fresh data directory, stopped whatever happened, its logs printed and
kept if something failed). The exit status is the training script's.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from examples.private import REPO, with_private_tinsmith
from tinsmith.embedded import die_with_parent


def main(argv: Sequence[str] | None = None) -> int:
    extra = list(sys.argv[1:] if argv is None else argv)
    # For both children: tinsmith up and the training script.
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TINKER_TELEMETRY", "0")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    os.environ.setdefault("TINKER_API_KEY", "tml-tinsmith-demo")  # tinsmith takes any tml- key
    # The trainer and the sampler each default to half the cores, for RL loops that run both at
    # once. The demo trains and samples in turn, so each may use them all: ~1.6x faster steps.
    os.environ.setdefault("TINSMITH_TORCH_THREADS", str(os.cpu_count() or 1))

    started = time.monotonic()

    def train(url: str, _: Path) -> int:
        training = subprocess.run(
            [sys.executable, "-m", "examples.sft_pig_latin", "--base-url", url, *extra],
            cwd=REPO,
            check=False,
            preexec_fn=die_with_parent,
        )
        if training.returncode != 0:
            print(
                f"\nthe training script failed (exit status {training.returncode})",
                file=sys.stderr,
            )
        return training.returncode

    status = with_private_tinsmith("demo", train, echo=True)
    print(f"demo finished in {time.monotonic() - started:.0f}s (exit status {status})")
    return status


if __name__ == "__main__":
    sys.exit(main())
