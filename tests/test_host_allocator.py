"""The engines' host allocator (tinsmith/host_allocator.py): with it tuned, a thread's large
allocations reuse the memory that the ones before freed instead of mapping and faulting in fresh
pages each time; ``TINSMITH_HOST_ALLOCATOR=system`` leaves glibc as it is."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import Any

import pytest

from tinsmith import host_allocator

# In a fresh interpreter: tune (or not), then on a new thread (as the engines' compute thread)
# allocate, touch and free 256 MiB three times, and count the minor page faults of the last two.
_PROBE = """
import json, resource, sys, threading
from tinsmith import host_allocator
said = host_allocator.tune()
SIZE, PAGE = 256 << 20, 4096
faults = []
def step():
    block = bytearray(SIZE)
    block[::PAGE] = bytes(SIZE // PAGE)  # touch every page
    del block
def work():
    step()
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    step(); step()
    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
thread = threading.Thread(target=work)
thread.start(); thread.join()
print(json.dumps({"said": said, "faults": faults[0]}))
"""

PAGES = (256 << 20) // 4096


def _probe(**env: str) -> dict[str, Any]:
    out = subprocess.run(
        [sys.executable, "-c", _PROBE],
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    )
    result: dict[str, Any] = json.loads(out.stdout)
    return result


needs_glibc = pytest.mark.skipif(
    host_allocator.glibc_version() is None, reason="the allocator tuned is glibc's"
)


@needs_glibc
def test_tuned_reuses_freed_memory_on_a_thread() -> None:
    tuned = _probe(TINSMITH_HOST_ALLOCATOR="tuned")
    system = _probe(TINSMITH_HOST_ALLOCATOR="system")
    assert "one arena" in str(tuned["said"])
    assert "TINSMITH_HOST_ALLOCATOR=system" in str(system["said"])
    # Untuned, each 256 MiB block is a fresh mapping: a fault per page, twice.
    assert int(system["faults"]) > PAGES
    # Tuned, the second and third blocks are the first one's memory again.
    assert int(tuned["faults"]) < PAGES // 20


def test_unknown_values_are_refused_and_system_changes_nothing(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv(host_allocator.VARIABLE, "jemalloc")
    with pytest.raises(SystemExit, match="the choices are tuned, system"):
        host_allocator.tune()
    monkeypatch.setenv(host_allocator.VARIABLE, "system")
    assert "as it is" in host_allocator.tune()
