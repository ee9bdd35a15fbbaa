"""``make demo``: start a private tinsmith, teach a model pig latin through it, stop it again.

Run from the repository root::

    python -m examples.demo [options of examples/sft_pig_latin.py, e.g. --steps 20]

It runs ``tinsmith up`` (the executable next to this Python) on a free port with a fresh data
directory, waits for its ``tinsmith ready at URL`` line, runs ``examples/sft_pig_latin.py`` against
that URL with the same Python, and stops the system with SIGTERM whatever happened: on success, on
failure and on Ctrl-C. The exit status is the training script's. If something fails, the tails of
the service logs are printed and the data directory (with the logs) is kept. On Linux the
children get SIGTERM even if this process is killed outright.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

from tinsmith.child import UpProcess, sigterm_as_interrupt
from tinsmith.embedded import die_with_parent

READY_TIMEOUT_S = 300.0  # models convert on first use, not at start: this is for a loaded machine
REPO = Path(__file__).resolve().parent.parent


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
    (REPO / ".tinsmith").mkdir(exist_ok=True)
    data_dir = Path(tempfile.mkdtemp(prefix="demo-", dir=REPO / ".tinsmith"))
    status = 1
    with sigterm_as_interrupt():
        system: UpProcess | None = None
        try:
            print(f"Starting tinsmith (data in {data_dir.relative_to(REPO)}) ...", flush=True)
            system = UpProcess(data_dir, echo=True)
            try:
                url = system.wait_ready(READY_TIMEOUT_S)
            except RuntimeError as exc:
                print(exc, file=sys.stderr)
                system.print_logs()
                return 1
            print(f"tinsmith ready at {url} after {time.monotonic() - started:.0f}s", flush=True)
            training = subprocess.run(
                [sys.executable, "-m", "examples.sft_pig_latin", "--base-url", url, *extra],
                cwd=REPO,
                check=False,
                preexec_fn=die_with_parent,
            )
            status = training.returncode
            if status != 0:
                print(f"\nthe training script failed (exit status {status})", file=sys.stderr)
                system.print_logs()
        except KeyboardInterrupt:
            print("\ninterrupted", file=sys.stderr)
            status = 130
        finally:
            if system is not None:
                print("Stopping tinsmith ...", flush=True)
                stopped = system.stop()
                if stopped not in (0, -signal.SIGTERM) and status == 0:
                    print(f"tinsmith exited with {stopped}", file=sys.stderr)
            if status == 0:
                shutil.rmtree(data_dir, ignore_errors=True)
            else:
                print(f"logs kept in {data_dir / 'logs'}", file=sys.stderr)
    print(f"demo finished in {time.monotonic() - started:.0f}s (exit status {status})")
    return status


if __name__ == "__main__":
    sys.exit(main())
