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


def test_what_the_system_writes_is_its_owners_alone(tmp_path: Path) -> None:
    """The catalog, the logs, the event log and the object store (with the key that signs
    download URLs) were readable by every user of the machine."""
    system = start_system(tmp_path / "data")
    try:
        assert (system.data_dir.stat().st_mode & 0o777) == 0o700
        written = [p for p in system.data_dir.rglob("*") if p.is_file()]
        assert any(p.name == "catalog.db" for p in written)
        assert any(p.suffix == ".log" for p in written)
        loose = [p for p in written if p.stat().st_mode & 0o077]
        assert not loose, loose
    finally:
        system.up.stop(60)
