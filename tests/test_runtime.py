"""How many torch threads a compute process takes: half of the CPUs it may use, which a
container's cgroup quota bounds."""

from __future__ import annotations

import asyncio
import contextlib
from pathlib import Path

import pytest

from tinsmith import runtime
from tinsmith.bus import ended


def _cgroup(root: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    return root


@pytest.mark.parametrize(
    ("files", "quota"),
    [
        ({"cpu.max": "200000 100000\n"}, 2.0),
        ({"cpu.max": "150000 100000\n"}, 1.5),
        ({"cpu.max": "max 100000\n"}, None),
        ({"cpu/cpu.cfs_quota_us": "400000", "cpu/cpu.cfs_period_us": "100000"}, 4.0),
        ({"cpu/cpu.cfs_quota_us": "-1", "cpu/cpu.cfs_period_us": "100000"}, None),
        ({}, None),
    ],
)
def test_a_cgroups_cpu_quota_is_read_in_either_version(
    tmp_path: Path, files: dict[str, str], quota: float | None
) -> None:
    assert runtime._cgroup_cpu_quota(_cgroup(tmp_path, files)) == quota


def test_torch_threads_are_half_the_usable_cpus_unless_set(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("TINSMITH_TORCH_THREADS", raising=False)
    assert runtime.torch_threads() == max(1, runtime.available_cpus() // 2)
    monkeypatch.setenv("TINSMITH_TORCH_THREADS", "3")
    assert runtime.torch_threads() == 3
    monkeypatch.setenv("TINSMITH_TORCH_THREADS", "0")
    with pytest.raises(SystemExit, match="at least 1"):
        runtime.torch_threads()


async def test_ended_waits_for_cancelled_tasks_to_finish_and_names_those_that_do_not() -> None:
    finished: list[str] = []

    async def cleans_up() -> None:
        try:
            await asyncio.sleep(3600)
        finally:
            await asyncio.sleep(0.05)  # a transaction being rolled back, say
            finished.append("cleaned up")

    released = asyncio.Event()

    async def ignores_it() -> None:
        while not released.is_set():
            with contextlib.suppress(asyncio.CancelledError):
                await released.wait()

    polite = asyncio.ensure_future(cleans_up())
    await asyncio.sleep(0)
    assert await ended([polite], timeout_s=10) == set()
    assert finished == ["cleaned up"] and polite.cancelled()

    stubborn = asyncio.ensure_future(ignores_it())
    await asyncio.sleep(0)
    assert await ended([stubborn, polite], timeout_s=0.2) == {stubborn}
    assert not stubborn.done()
    released.set()
    await stubborn
