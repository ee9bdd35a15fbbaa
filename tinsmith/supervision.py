"""Keeping the processes of ``tinsmith up`` running: a child that dies is started again, the
same way, after a backoff.

Owns: starting a child process (its own session, so that a terminal's Ctrl-C reaches only the
launcher; a clear signal mask; ``PR_SET_PDEATHSIG``, so that it dies with the launcher),
noticing that one ended (``SIGCHLD``), the one line that says so on the launcher's stderr, the
backoff before the restart (``Backoff``: 0.5 s doubling up to 30 s, back to 0.5 s once a child
has stayed up a minute), and stopping the children in groups, each group only after the one
before has ended. Also the standby interpreter (tinsmith/standby.py): one process kept with the
engines' libraries imported, which a Python child that died becomes instead of a fresh process
(``Supervisor.keep_standby``), and another one started a while after it was used.

Signals are taken by handlers that only note them, with a wakeup pipe that the supervising loop
waits on (``signal.set_wakeup_fd``), not with a blocked mask and ``sigtimedwait``: threads the
launcher made while starting (the tokenizers library keeps a pool) do not block them, and a
signal the kernel gave to one of those was never seen by ``sigtimedwait``: a dead child waited
for the next timeout, and a second Ctrl-C raised in the middle of an orderly stop.

Does not own: what the children are, their environment and ports (tinsmith/embedded.py), or the
command line (tinsmith/cli.py).
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import select
import signal
import subprocess
import sys
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType
from typing import TextIO

_PR_SET_PDEATHSIG = 1


def die_with_parent() -> None:
    """Run in a child before exec: the kernel sends it SIGTERM if its parent (the thread that
    started it: start children from the main thread) dies."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)


def _prepare_child() -> None:
    """Run in a child of the launcher before exec: a clean signal mask (a child started while the
    launcher blocks its stop signals would inherit the block, and never hear its own SIGTERM),
    and death with the launcher."""
    signal.pthread_sigmask(signal.SIG_SETMASK, set())
    die_with_parent()


def how_it_ended(returncode: int) -> str:
    """``exited with code 3`` or ``was killed by SIGKILL``, for a Popen's return code."""
    if returncode >= 0:
        return f"exited with code {returncode}"
    try:
        name = signal.Signals(-returncode).name
    except ValueError:
        name = f"signal {-returncode}"
    return f"was killed by {name}"


@dataclass(frozen=True)
class Backoff:
    """How long a dead child waits before it is started again: ``first_s`` after the first of a
    row of quick deaths, doubling with each further one up to ``max_s``. A child that stayed up
    ``stable_s`` or longer before it died starts a new row."""

    first_s: float = 0.5
    max_s: float = 30.0
    stable_s: float = 60.0

    def delay(self, quick_deaths: int) -> float:
        """The wait before the restart that follows the ``quick_deaths``-th death in a row."""
        return float(min(self.max_s, self.first_s * 2 ** max(0, quick_deaths - 1)))


@dataclass
class Child:
    """One supervised process: how to start it, and what became of it so far."""

    name: str
    argv: list[str]
    env: dict[str, str] | None
    log_path: Path
    process: subprocess.Popen[bytes] | None = None
    started: float = 0.0  # monotonic: when the current (or last) process started
    quick_deaths: int = 0  # deaths in a row, each within Backoff.stable_s of its start
    restarts: int = 0
    restart_at: float | None = None  # monotonic; set while it is dead and waiting
    # Whether it restarts as the standby interpreter when there is one (the engines: their
    # imports are most of their start; a light service starts sooner on its own).
    standby: bool = False

    @property
    def pid(self) -> int | None:
        return self.process.pid if self.process is not None else None

    @property
    def running(self) -> bool:
        return self.process is not None and self.process.poll() is None

    @property
    def module_args(self) -> list[str] | None:
        """``["-m", MODULE, *ARGS]`` for a child started as ``python -m MODULE ARGS`` with this
        Python (what a standby can become); None for any other."""
        if self.argv[:1] == [sys.executable] and self.argv[1:2] == ["-m"] and len(self.argv) > 2:
            return self.argv[1:]
        return None

    def spawn(self, standby: Standby | None = None) -> None:
        """Start it: a new process, or ``standby`` told to become it."""
        with self.log_path.open("ab") as log:
            if self.restarts:
                how = " (the standby interpreter)" if standby is not None else ""
                log.write(
                    f"--- tinsmith up: restart {self.restarts} of {self.name}{how} ---\n".encode()
                )
                log.flush()
            if standby is not None:
                self.process = standby.become(self)
            else:
                self.process = subprocess.Popen(
                    self.argv,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    env=self.env,
                    start_new_session=True,
                    preexec_fn=_prepare_child,
                )
        self.started = time.monotonic()
        self.restart_at = None


@dataclass
class Standby:
    """A standby interpreter (tinsmith/standby.py) waiting for its order on stdin."""

    process: subprocess.Popen[bytes]

    @classmethod
    def start(cls, argv: list[str], env: dict[str, str] | None, log_path: Path) -> Standby:
        with log_path.open("ab") as log:
            process = subprocess.Popen(
                argv,
                stdin=subprocess.PIPE,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=env,
                start_new_session=True,
                preexec_fn=_prepare_child,
            )
        return cls(process)

    @property
    def alive(self) -> bool:
        return self.process.poll() is None

    def become(self, child: Child) -> subprocess.Popen[bytes]:
        """Tell it to become ``child`` (started as ``python -m``); its process from now on."""
        assert self.process.stdin is not None
        order = {
            "argv": child.module_args,
            "env": dict(os.environ if child.env is None else child.env),
            "log": str(child.log_path),
            "name": child.name,
        }
        self.process.stdin.write(json.dumps(order).encode() + b"\n")
        self.process.stdin.close()
        return self.process

    def stop(self) -> None:
        """End it (it waits on its stdin, or still imports)."""
        if self.process.stdin is not None and not self.process.stdin.closed:
            with contextlib.suppress(OSError):
                self.process.stdin.close()  # end of its stdin: it exits
        with contextlib.suppress(ProcessLookupError):
            self.process.terminate()
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.process.wait(5)
            return
        self.process.kill()
        self.process.wait()


@dataclass
class Supervisor:
    """The children of one launcher, restarted when they die until ``stop``."""

    backoff: Backoff = field(default_factory=Backoff)
    out: TextIO = field(default_factory=lambda: sys.stderr)
    children: dict[str, Child] = field(default_factory=dict)
    stopping: bool = False
    # A standby is started again this long after the last one was used or died: it imports for
    # seconds, and should not take the CPU from the service that just replaced a dead one.
    standby_delay_s: float = 15.0
    _standby_how: tuple[list[str], dict[str, str] | None, Path] | None = field(
        default=None, init=False, repr=False
    )
    _standby: Standby | None = field(default=None, init=False, repr=False)
    _standby_at: float | None = field(default=None, init=False, repr=False)
    _signals: _Signals | None = field(default=None, init=False, repr=False)

    def start(
        self,
        name: str,
        argv: list[str],
        env: dict[str, str] | None,
        log_path: Path,
        *,
        standby: bool = False,
    ) -> Child:
        """Start a child; with ``standby``, its restarts use the standby interpreter while there
        is one (its ``argv`` must be ``python -m MODULE ARGS``, with this Python)."""
        child = Child(name, argv, env, log_path, standby=standby)
        self.children[name] = child
        child.spawn()
        return child

    def keep_standby(self, argv: list[str], env: dict[str, str] | None, log_path: Path) -> None:
        """From now on, keep a standby interpreter (``python -m tinsmith.standby MODULES``) for
        the Python children to become when they die; the first one starts now."""
        self._standby_how = (argv, env, log_path)
        self._standby_at = time.monotonic()
        self._check_standby(self._standby_at)

    def _check_standby(self, now: float) -> None:
        """Notice a standby that died unused (one line), and start one when it is due."""
        standby = self._standby
        if standby is not None and not standby.alive:
            print(
                f"tinsmith: the standby interpreter (pid {standby.process.pid}) "
                f"{how_it_ended(standby.process.wait())}; another one in "
                f"{self.standby_delay_s:.0f} s",
                file=self.out,
                flush=True,
            )
            self._standby, self._standby_at = None, now + self.standby_delay_s
        due, how = self._standby_at, self._standby_how
        if how is not None and due is not None and due <= now and not self.stopping:
            self._standby, self._standby_at = Standby.start(*how), None

    def _take_standby(self, child: Child, now: float) -> Standby | None:
        """The standby, for ``child`` to become, if it may (a living standby, and a ``python -m``
        child started with ``standby``); another one is due ``standby_delay_s`` from now. One
        still importing is taken too: it is ahead of a fresh process."""
        standby = self._standby
        if standby is None or not standby.alive or not child.standby or not child.module_args:
            return None
        self._standby, self._standby_at = None, now + self.standby_delay_s
        return standby

    def first_exit(self) -> Child | None:
        """A child whose process has ended and that is not waiting for its restart yet."""
        for child in self.children.values():
            if child.process is not None and child.restart_at is None and not child.running:
                return child
        return None

    def check(self, now: float | None = None) -> None:
        """Notice the children that died (one line each on ``out``) and start those whose wait
        is over."""
        now = time.monotonic() if now is None else now
        while (dead := self.first_exit()) is not None:
            self._schedule(dead, now)
        self._check_standby(now)
        for child in self.children.values():
            if child.restart_at is not None and child.restart_at <= now and not self.stopping:
                child.restarts += 1
                child.spawn(self._take_standby(child, now))

    def _schedule(self, child: Child, now: float) -> None:
        assert child.process is not None
        up_s = now - child.started
        child.quick_deaths = 1 if up_s >= self.backoff.stable_s else child.quick_deaths + 1
        delay = self.backoff.delay(child.quick_deaths)
        child.restart_at = now + delay
        print(
            f"tinsmith: {child.name} (pid {child.process.pid}) "
            f"{how_it_ended(child.process.returncode)} after {up_s:.1f} s up; restarting it in "
            f"{delay:.1f} s (restart {child.restarts + 1}, log {child.log_path})",
            file=self.out,
            flush=True,
        )

    def next_wake(self, now: float, idle_s: float = 5.0) -> float:
        """Seconds until the next restart is due; ``idle_s`` when none is."""
        due = [c.restart_at for c in self.children.values() if c.restart_at is not None]
        if self._standby is None and self._standby_at is not None:
            due.append(self._standby_at)
        return max(0.0, min(due) - now) if due else idle_s

    def supervise(self, stop_signals: Iterable[signal.Signals]) -> int:
        """Restart children as they die until one of ``stop_signals`` arrives; return its
        number. Run it in the main thread. From here until ``stop`` has ended, these signals
        are only noted: a second Ctrl-C does not cut the stop short."""
        self._signals = _Signals({*stop_signals, signal.SIGCHLD})
        while True:
            self.check()
            for signum in self._signals.take():
                if signum != signal.SIGCHLD:
                    return signum
            self._signals.wait(self.next_wake(time.monotonic()))

    def stop(self, groups: Iterable[Sequence[str]], grace_s: float) -> None:
        """Restart nothing more, then SIGTERM each group's children and wait for them to end
        before the next group; SIGKILL whatever outlives ``grace_s``."""
        self.stopping = True
        standby, self._standby = self._standby, None
        if standby is not None:
            standby.stop()
        try:
            self._stop(groups, grace_s)
        finally:
            if self._signals is not None:
                self._signals.close()
                self._signals = None

    def _stop(self, groups: Iterable[Sequence[str]], grace_s: float) -> None:
        for group in groups:
            alive = [self.children[n] for n in group if n in self.children]
            alive = [c for c in alive if c.running]
            for child in alive:
                assert child.process is not None
                with contextlib.suppress(ProcessLookupError):
                    child.process.terminate()
            deadline = time.monotonic() + grace_s
            for child in alive:
                assert child.process is not None
                try:
                    child.process.wait(max(0.0, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    print(
                        f"tinsmith: {child.name} did not stop within {grace_s:.0f} s; killing it",
                        file=self.out,
                        flush=True,
                    )
                    child.process.kill()
                    child.process.wait()


class _Signals:
    """Signals noted as they arrive, whichever thread the kernel hands them to: Python runs the
    handler in the main thread, and the C-level handler writes to a pipe (``set_wakeup_fd``)
    that ``wait`` selects on, so a signal that lands just before the wait still ends it."""

    def __init__(self, signums: Iterable[signal.Signals]) -> None:
        self._read, self._write = os.pipe()
        os.set_blocking(self._read, False)
        os.set_blocking(self._write, False)
        self._noted: list[int] = []
        self._previous_fd = signal.set_wakeup_fd(self._write, warn_on_full_buffer=False)
        self._previous = {signum: signal.signal(signum, self._note) for signum in signums}

    def _note(self, signum: int, frame: FrameType | None) -> None:
        self._noted.append(signum)

    def take(self) -> list[int]:
        """The signals noted since the last call, oldest first."""
        noted, self._noted = self._noted, []
        return noted

    def wait(self, timeout_s: float) -> None:
        """Until a signal arrives, or ``timeout_s``."""
        select.select([self._read], [], [], timeout_s)
        with contextlib.suppress(BlockingIOError):
            while os.read(self._read, 512):
                pass

    def close(self) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)
        signal.set_wakeup_fd(self._previous_fd)
        os.close(self._read)
        os.close(self._write)
