"""The engines' host memory allocator: glibc's malloc, set for tensors that come and go.

On the CPU every activation of a training step or a sampling step is a host allocation, and
torch's CPU allocator is plain ``malloc``/``free``. glibc serves one of more than its mmap
threshold (dynamic, at most 32 MiB) with a fresh ``mmap`` and gives it back at ``free``, and
serves a thread other than the main one from an arena of 64 MiB heaps, past which it maps
memory too. The engines compute on a thread of their own (``ComputeThread``), so each step's
large activations were mapped, touched page by page (a minor fault per 4 KiB page, zeroed by
the kernel) and unmapped again: a trainer step over 20 datums of 163 to 955 tokens of
``tinsmith/small`` spent 7 to 12 s of its 14 s in the kernel (``bench/mixed_lengths.py``).

``tune`` makes every thread use the main heap (one arena), serves allocations under 2 GiB from
it, and keeps up to 2 GiB of freed memory at its top instead of trimming it: a step reuses the
memory the step before freed. The price is that a process keeps the memory of its largest step
(which the engines' budget counts anyway) rather than giving it back between steps.

``TINSMITH_HOST_ALLOCATOR=system`` leaves malloc as glibc sets it (or as the ``MALLOC_*`` and
``GLIBC_TUNABLES`` variables do); another C library (macOS, musl) is left alone and says so.
Call ``tune`` at the start of the process, before the threads that compute exist: a thread
keeps the arena it first allocated from.

Owns: the settings and the description of what was set. Imports nothing heavy (no torch).
"""

from __future__ import annotations

import ctypes
import os

VARIABLE = "TINSMITH_HOST_ALLOCATOR"
CHOICES = ("tuned", "system")
# mallopt's parameters (malloc.h).
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
_M_ARENA_MAX = -8
# The largest value mallopt takes (an int): 2 GiB - 1.
_MOST = (1 << 31) - 1


def glibc_version() -> str | None:
    """``glibc 2.36`` where this process runs on glibc, else None."""
    try:
        return os.confstr("CS_GNU_LIBC_VERSION")
    except (ValueError, OSError, AttributeError):
        return None


def tune() -> str:
    """Set glibc's malloc for the engines (the module doc) unless ``TINSMITH_HOST_ALLOCATOR``
    says ``system``; returns what this process's allocator now is, for its log and readiness
    facts. An unknown value of the variable is refused (``SystemExit``, naming the choices)."""
    choice = os.environ.get(VARIABLE, "").strip().lower() or "tuned"
    if choice not in CHOICES:
        raise SystemExit(f"{VARIABLE}={choice!r}: the choices are {', '.join(CHOICES)}")
    libc = glibc_version()
    if choice == "system":
        return f"{libc or 'the C library'}'s malloc as it is ({VARIABLE}=system)"
    if libc is None:
        return "the C library's malloc as it is (not glibc, whose settings this tunes)"
    mallopt = ctypes.CDLL(None).mallopt
    settings = ((_M_ARENA_MAX, 1), (_M_MMAP_THRESHOLD, _MOST), (_M_TRIM_THRESHOLD, _MOST))
    refused = [name for name, value in settings if mallopt(name, value) != 1]
    if refused:
        return f"{libc} malloc, partly tuned: mallopt refused parameters {refused}"
    return f"{libc} malloc: one arena, allocations under 2 GiB and 2 GiB of freed memory kept"
