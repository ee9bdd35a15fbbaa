"""What the standby interpreter's imports take from busy services, side by side in one run.

The standby (tinsmith/standby.py) imports the engines' libraries for seconds, right when
``tinsmith up`` is ready or 15 s after a restart: when the services may be busy. It imports at
the lowest CPU priority. This runs as many CPU-bound workers as the machine has cores (the busy
services), each counting loop turns for ``--seconds``, three ways:

- alone (the baseline),
- beside a plain ``python -c "import ..."`` of the same modules at the workers' priority (what
  the standby did before),
- beside ``python -m tinsmith.standby`` of them, told to exit once ready.

and prints the workers' turns against alone, and how long each import took.

    .venv/bin/python -m bench.standby_priority [--seconds 8]
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import subprocess
import sys
import time
from multiprocessing.queues import Queue

from tinsmith.embedded import STANDBY_MODULES


def _work(out: Queue[int], seconds: float) -> None:
    turns, end = 0, time.monotonic() + seconds
    while time.monotonic() < end:
        turns += 1
    out.put(turns)


def _imports(how: str) -> subprocess.Popen[str] | None:
    if how == "alone":
        return None
    if how == "plain import":
        code = f"import time; t = time.monotonic(); import {', '.join(STANDBY_MODULES)}; " + (
            "print(f'imported in {time.monotonic() - t:.1f} s', flush=True)"
        )
        argv = [sys.executable, "-c", code]
    else:
        argv = [sys.executable, "-m", "tinsmith.standby", *STANDBY_MODULES]
    return subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)


def _round(how: str, seconds: float) -> tuple[int, str]:
    """The workers' turns in ``seconds``, beside ``how``; and what the importer said."""
    out: Queue[int] = multiprocessing.Queue()
    workers = [
        multiprocessing.Process(target=_work, args=(out, seconds))
        for _ in range(os.cpu_count() or 1)
    ]
    for worker in workers:
        worker.start()
    importer = _imports(how)
    turns = sum(out.get() for _ in workers)
    for worker in workers:
        worker.join()
    said = ""
    if importer is not None:
        assert importer.stdout is not None and importer.stdin is not None
        said = importer.stdout.readline().strip()
        importer.stdin.close()  # a standby with nothing to become exits
        importer.wait()
    return turns, said


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seconds", type=float, default=8.0)
    args = parser.parse_args()
    print(f"{os.cpu_count()} busy workers for {args.seconds:.0f} s; imports of {STANDBY_MODULES}")
    alone, _ = _round("alone", args.seconds)
    for how in ("plain import", "standby"):
        turns, said = _round(how, args.seconds)
        share = turns / alone
        print(f"  beside a {how:<13} the workers did {share:.3f} of their work alone ({said})")


if __name__ == "__main__":
    main()
