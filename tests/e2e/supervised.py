"""What tests of a supervised ``tinsmith up`` use: the pid of each of its children (read from
/proc: the launcher is another process), killing one and waiting for its successor, and the
launcher's restart lines."""

from __future__ import annotations

import os
import re
import signal
import time
from dataclasses import dataclass
from pathlib import Path

from tinsmith.child import UpProcess

# Every child of a `tinsmith up` with its embedded NATS (and its standby interpreter, while it
# waits: tinsmith/standby.py).
CHILDREN = ("nats-server", "checkpoint", "trainer", "sampler", "gateway")
# tinsmith/supervision.py's line for a child that died.
RESTART_LINE = re.compile(
    r"^tinsmith: (?P<name>\S+) \(pid (?P<pid>\d+)\) (?P<how>.+?) after [\d.]+ s up; "
    r"restarting it in (?P<delay>[\d.]+) s \(restart (?P<restart>\d+), log \S+\)$"
)


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/status").read_text().split("State:\t", 1)[1][0]
    except (OSError, IndexError):
        return False
    return state != "Z"


def _name(pid: int, cmdline: list[str]) -> str | None:
    """Which child a process is: the nats-server, a service (``tinsmith serve NAME``, or the
    standby interpreter that became it, named by its comm), or the waiting standby."""
    if cmdline and Path(cmdline[0]).name == "nats-server":
        return "nats-server"
    if cmdline[-2:-1] == ["serve"]:
        return cmdline[-1]
    if cmdline[1:3] == ["-m", "tinsmith.standby"]:
        # It names itself once it became a child (until then: python, then tinsmith-spare).
        comm = Path(f"/proc/{pid}/comm").read_text().strip()
        return comm if comm in CHILDREN else "standby"
    return None


def child_pids(launcher: int) -> dict[str, int]:
    """The living children of the launcher with pid ``launcher``, by name."""
    found: dict[str, int] = {}
    for status in Path("/proc").glob("[0-9]*/status"):
        try:
            if f"\nPPid:\t{launcher}\n" not in status.read_text():
                continue
            cmdline = (status.parent / "cmdline").read_bytes().decode().split("\0")[:-1]
        except OSError:
            continue
        pid = int(status.parent.name)
        try:
            name = _name(pid, cmdline)
        except OSError:
            continue
        if name is not None and _alive(pid):
            found[name] = pid
    return found


def child_pid(launcher: int, name: str, *, other_than: int = 0, timeout_s: float = 120.0) -> int:
    """The pid of the launcher's child ``name`` once there is one (other than ``other_than``)."""
    deadline = time.monotonic() + timeout_s
    while True:
        pid = child_pids(launcher).get(name)
        if pid is not None and pid != other_than:
            return pid
        assert time.monotonic() < deadline, f"no {name} started within {timeout_s} s"
        time.sleep(0.02)


def environment(pid: int) -> dict[str, str]:
    pairs = Path(f"/proc/{pid}/environ").read_bytes().decode().split("\0")
    return dict(pair.split("=", 1) for pair in pairs if "=" in pair)


@dataclass(frozen=True)
class Kill:
    name: str
    old_pid: int
    new_pid: int
    killed_at: float  # monotonic
    restarted_at: float  # monotonic: when the successor was first seen


def kill_child(up: UpProcess, name: str, timeout_s: float = 120.0) -> Kill:
    """SIGKILL the child ``name`` of ``up`` and wait until the launcher has started another."""
    old, killed_at = send_kill(up, name)
    new = child_pid(up.process.pid, name, other_than=old, timeout_s=timeout_s)
    return Kill(name, old, new, killed_at, time.monotonic())


def send_kill(up: UpProcess, name: str) -> tuple[int, float]:
    """SIGKILL the child ``name`` of ``up``, and return at once: its pid and when (monotonic)."""
    pid = child_pid(up.process.pid, name)
    killed_at = time.monotonic()
    os.kill(pid, signal.SIGKILL)
    return pid, killed_at


def restart_lines(up: UpProcess) -> list[re.Match[str]]:
    """The launcher's restart lines so far, parsed."""
    return [m for line in list(up.output) if (m := RESTART_LINE.match(line.rstrip("\n")))]
