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

It imports at the lowest CPU priority (``_import_quietly``): it is started when the services may
be busy (at start-up, as they take their first work; after a restart, while the replacement
catches up), and its seconds of imports are worth less than their work. Measured on 2 cores
beside two processes that keep both busy (``bench/standby_priority.py``): importing at their
priority took 18 to 23% of their work for the 4.2 s of the imports; the standby, at the lowest,
0.3 to 0.9%, its imports taking 10.6 s.

Owns: the standby's side only. Does not own: when one is started or used, its log before it is
used, or stopping it (tinsmith/supervision.py), or which modules it imports (tinsmith/
embedded.py). Imports only what it is named (numpy first, where there is numpy): the shared
library stays free of torch.
"""

from __future__ import annotations

import contextlib
import ctypes
import importlib
import json
import os
import runpy
import sys
import threading
import time
from collections.abc import Iterable

_PR_SET_NAME = 15
# The line its log starts with once it has imported what it is named.
READY = "standby: ready after"
# The lowest CPU priority (the highest nice value): the thread runs when no other wants the core.
LOWEST_PRIORITY = 19
# Imported first, on the main thread: importing numpy starts its BLAS library's worker threads,
# which would take the priority of the thread that imported it, and keep it when the standby
# becomes a service.
_STARTS_THREADS = ("numpy",)


def _name_process(name: str) -> None:
    """Set ``/proc/self/comm`` (15 bytes at most)."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None).prctl(_PR_SET_NAME, name.encode()[:15], 0, 0, 0)


def _import(modules: Iterable[str]) -> None:
    for module in modules:
        try:
            importlib.import_module(module)
        except ImportError as exc:  # an environment without torch: a standby saves less
            print(f"standby: could not import {module}: {exc}", flush=True)


def _import_quietly(modules: list[str]) -> None:
    """Import ``modules`` on a thread of the lowest CPU priority, which ends with the imports.
    Linux keeps a nice value per thread, and a process may not take a lowered priority back: so
    not the main thread, which goes on to run the service this standby becomes. Elsewhere (no
    per-thread priority), the imports run at the process's own."""

    def imports() -> None:
        with contextlib.suppress(OSError, AttributeError):
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), LOWEST_PRIORITY)
        _import(modules)

    if sys.platform != "linux":
        _import(modules)
        return
    _import(_STARTS_THREADS)
    thread = threading.Thread(target=imports, name="standby-imports")
    thread.start()
    thread.join()


def main(modules: list[str]) -> int:
    _name_process("tinsmith-spare")
    started = time.monotonic()
    _import_quietly(modules)
    print(f"{READY} {time.monotonic() - started:.1f} s of imports", flush=True)
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
