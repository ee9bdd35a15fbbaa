"""A standby interpreter: a Python process that has imported the engines' libraries already and
waits to become a service of ``tinsmith up`` whose process died.

Most of a trainer's or a sampler's restart is importing torch, transformers and peft: 3.7 s on
an idle 2-core machine, 8.7 s on one that keeps serving meanwhile, against about 1 s for all the
rest (connecting, reading the log, taking the runs back). The launcher keeps one standby
(tinsmith/supervision.py), started with the services' environment, which imports the modules it
is named on its command line and then blocks on its stdin. A child that dies and was started as
``python -m MODULE ARGS`` is started again by telling the standby, in one JSON line:

    {"argv": ["-m", "tinsmith.cli", "serve", "trainer"], "env": {...}, "log": "/.../trainer.log"}

It makes the log its stdout and stderr, takes the child's environment, names its process after
the child (``/proc/PID/comm``, which ``ps`` and ``top`` show), and runs the module as
``__main__``: the same code a fresh process runs, minus the imports. Nothing it imported reads
the environment while being imported (the standby's environment is the services' own, without
what differs per service: the health port, the replica name), so what it knows matches a fresh
start.

Owns: the standby's side only. Does not own: when one is started or used, its log before it is
used, or stopping it (tinsmith/supervision.py), or which modules it imports (tinsmith/
embedded.py). Imports only what it is named: the shared library stays free of torch.
"""

from __future__ import annotations

import contextlib
import ctypes
import importlib
import json
import os
import runpy
import sys
import time

_PR_SET_NAME = 15


def _name_process(name: str) -> None:
    """Set ``/proc/self/comm`` (15 bytes at most)."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None).prctl(_PR_SET_NAME, name.encode()[:15], 0, 0, 0)


def main(modules: list[str]) -> int:
    _name_process("tinsmith-spare")
    started = time.monotonic()
    for module in modules:
        try:
            importlib.import_module(module)
        except ImportError as exc:  # an environment without torch: a standby saves less
            print(f"standby: could not import {module}: {exc}", flush=True)
    print(f"standby: ready after {time.monotonic() - started:.1f} s of imports", flush=True)
    line = sys.stdin.readline()
    if not line:
        return 0  # the launcher stops, or replaced this standby
    order = json.loads(line)
    argv: list[str] = order["argv"]
    if argv[:1] != ["-m"] or len(argv) < 2:
        print(f"standby: cannot run {argv!r}: only `-m MODULE ARGS`", flush=True)
        return 2
    log = os.open(order["log"], os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
    sys.stdout.flush()
    sys.stderr.flush()
    os.dup2(log, 1)
    os.dup2(log, 2)
    os.close(log)
    os.environ.clear()
    os.environ.update(order["env"])
    _name_process(order.get("name") or argv[1])
    sys.argv = argv[1:]
    runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
