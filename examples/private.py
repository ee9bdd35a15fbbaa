"""A private ``tinsmith up`` for the examples that start their own (``make demo``,
``examples.autoresearch`` without ``--url``).

Owns: its life. ``tinsmith up`` (the executable next to this Python) on a free port with a
fresh data directory under ``.tinsmith/``, waited for until its ``tinsmith ready at URL`` line,
and stopped with SIGTERM whatever happened: on success, on failure and on Ctrl-C (on Linux the
children get SIGTERM even if this process is killed outright). If the work fails, the tails of
the service logs are printed and the data directory (with the logs) is kept; on success it is
removed. Does not own: the work done against it.
"""

from __future__ import annotations

import shutil
import signal
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from tinsmith.child import UpProcess, sigterm_as_interrupt

READY_TIMEOUT_S = 300.0  # models convert on first use, not at start: this is for a loaded machine
REPO = Path(__file__).resolve().parent.parent


def with_private_tinsmith(
    name: str, work: Callable[[str, Path], int], *, echo: bool = False
) -> int:
    """Start a private tinsmith, run ``work(url, data_dir)`` against it, stop it: the work's
    exit status (1 if tinsmith did not start, 130 on Ctrl-C). ``echo``: show tinsmith's own
    output as it starts."""
    started = time.monotonic()
    (REPO / ".tinsmith").mkdir(exist_ok=True)
    data_dir = Path(tempfile.mkdtemp(prefix=f"{name}-", dir=REPO / ".tinsmith"))
    status = 1
    with sigterm_as_interrupt():
        system: UpProcess | None = None
        try:
            print(f"Starting tinsmith (data in {data_dir.relative_to(REPO)}) ...", flush=True)
            system = UpProcess(data_dir, echo=echo)
            try:
                url = system.wait_ready(READY_TIMEOUT_S)
            except RuntimeError as exc:
                print(exc, file=sys.stderr)
                return 1
            print(f"tinsmith ready at {url} after {time.monotonic() - started:.0f}s", flush=True)
            status = work(url, data_dir)
        except KeyboardInterrupt:
            print("\ninterrupted", file=sys.stderr)
            status = 130
        finally:
            if system is not None:
                if status not in (0, 130):
                    system.print_logs()
                print("Stopping tinsmith ...", flush=True)
                stopped = system.stop()
                if stopped not in (0, -signal.SIGTERM) and status == 0:
                    print(f"tinsmith exited with {stopped}", file=sys.stderr)
            if status == 0:
                shutil.rmtree(data_dir, ignore_errors=True)
            else:
                print(f"logs kept in {data_dir / 'logs'}", file=sys.stderr)
    return status
