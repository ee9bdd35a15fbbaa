"""`tinsmith up` starts everything, and a signal stops everything: nothing is left behind."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest

from tests.conftest import start_system


def _children(pid: int) -> set[int]:
    found = set()
    for status in Path("/proc").glob("[0-9]*/status"):
        try:
            text = status.read_text()
        except OSError:
            continue
        if f"\nPPid:\t{pid}\n" in text:
            found.add(int(status.parent.name))
    return found


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/status").read_text().split("State:\t", 1)[1][0]
    except (OSError, IndexError):
        return False
    return state != "Z"


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
def test_a_signal_stops_every_process(tmp_path: Path, signum: signal.Signals) -> None:
    system = start_system(tmp_path)
    children = _children(system.process.pid)
    assert len(children) == 5, system.logs()  # nats-server and the four services
    system.process.send_signal(signum)
    assert system.process.wait(60) == 0
    assert not [pid for pid in children if _alive(pid)]


def test_killing_the_launcher_still_stops_its_children(tmp_path: Path) -> None:
    system = start_system(tmp_path)
    children = _children(system.process.pid)
    os.kill(system.process.pid, signal.SIGKILL)
    system.process.wait(10)
    for pid in children:  # they get SIGTERM from the kernel (PR_SET_PDEATHSIG) and exit
        for _ in range(200):
            if not _alive(pid):
                break
            time.sleep(0.1)
    assert not [pid for pid in children if _alive(pid)]
