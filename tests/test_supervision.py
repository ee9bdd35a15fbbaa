"""The supervisor of `tinsmith up`'s children, on small real processes: a child that dies is
started again the same way after a backoff that grows while it keeps dying, one line says so each
time, a stop signal ends the watch whichever thread it lands on, and a stop ends each group of
children before it signals the next."""

from __future__ import annotations

import io
import itertools
import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.e2e.supervised import RESTART_LINE
from tinsmith.standby import LOWEST_PRIORITY
from tinsmith.supervision import Backoff, Supervisor, how_it_ended


def _python(code: str) -> list[str]:
    return [sys.executable, "-c", code]


def test_the_backoff_doubles_from_half_a_second_to_thirty() -> None:
    backoff = Backoff()
    assert [backoff.delay(n) for n in range(1, 10)] == [0.5, 1, 2, 4, 8, 16, 30, 30, 30]


def test_how_a_child_ended_reads_as_a_code_or_a_signal() -> None:
    assert how_it_ended(3) == "exited with code 3"
    assert how_it_ended(0) == "exited with code 0"
    assert how_it_ended(-signal.SIGKILL) == "was killed by SIGKILL"
    assert how_it_ended(-signal.SIGSEGV) == "was killed by SIGSEGV"


def test_a_child_that_keeps_dying_is_restarted_ever_later(tmp_path: Path) -> None:
    out = io.StringIO()
    supervisor = Supervisor(Backoff(first_s=0.2, max_s=0.8, stable_s=30), out=out)
    env = {**os.environ, "WHO": "the-same"}
    # Each start writes its WHO and time, then exits with code 3.
    code = (
        "import os, sys, time\n"
        "with open(sys.argv[1], 'a') as f: f.write(os.environ['WHO'] + f' {time.monotonic()}\\n')\n"
        "sys.exit(3)"
    )
    starts = tmp_path / "starts"
    supervisor.start("flaky", [*_python(code), str(starts)], env, tmp_path / "flaky.log")
    deadline = time.monotonic() + 4.5
    while time.monotonic() < deadline:
        supervisor.check()
        time.sleep(0.01)
    supervisor.stop([["flaky"]], grace_s=5)

    lines = [RESTART_LINE.match(line) for line in out.getvalue().splitlines()]
    assert all(lines), out.getvalue()
    assert [m["how"] for m in lines if m] == ["exited with code 3"] * len(lines)
    delays = [float(m["delay"]) for m in lines if m]
    assert delays[:5] == [0.2, 0.4, 0.8, 0.8, 0.8], delays
    assert [int(m["restart"]) for m in lines if m] == list(range(1, len(lines) + 1))
    records = [line.split() for line in starts.read_text().splitlines()]
    assert {who for who, _ in records} == {"the-same"}  # the same environment each time
    times = [float(at) for _, at in records]
    gaps = [later - earlier for earlier, later in itertools.pairwise(times)]
    # Each restart waited at least its delay (a start takes a moment more).
    for gap, delay in zip(gaps, delays, strict=False):
        assert gap >= delay, (gaps, delays)
    assert len(times) <= 8  # 4.5 s at 0.2, 0.4, 0.8, 0.8, ...: never spun
    # The child's log marks each restart. The stop may come while the last death's restart
    # waits out its delay (a death announced, not restarted), and before the last restart's
    # process wrote its start (so the starts are one more than the restarts, or as many).
    restarts = (tmp_path / "flaky.log").read_text().count("--- tinsmith up: restart")
    assert len(lines) - restarts in (0, 1), out.getvalue()
    assert len(times) - restarts in (0, 1), (times, out.getvalue())


def test_a_child_that_stayed_up_starts_its_backoff_over(tmp_path: Path) -> None:
    out = io.StringIO()
    supervisor = Supervisor(Backoff(first_s=0.2, max_s=10, stable_s=0.5), out=out)
    # Up one second (longer than stable_s), then dead: the first delay each time.
    child = supervisor.start("steady", _python("import time; time.sleep(1)"), None, tmp_path / "l")
    deadline = time.monotonic() + 5
    while child.restarts < 2 and time.monotonic() < deadline:
        supervisor.check()
        time.sleep(0.01)
    supervisor.stop([["steady"]], grace_s=5)
    delays = [m["delay"] for m in map(RESTART_LINE.match, out.getvalue().splitlines()) if m]
    assert delays[:2] == ["0.2", "0.2"], out.getvalue()


def test_a_stop_signal_ends_the_watch_and_a_dead_child_is_restarted_at_once(
    tmp_path: Path,
) -> None:
    out = io.StringIO()
    supervisor = Supervisor(out=out)
    child = supervisor.start(
        "sleeper", _python("import time; time.sleep(60)"), None, tmp_path / "l"
    )
    first = child.pid
    assert first is not None

    def later() -> None:
        time.sleep(0.5)
        os.kill(first, signal.SIGKILL)
        # Restarted 0.5 s after its death, not at the next idle wake (5 s).
        deadline = time.monotonic() + 3
        while child.pid == first and time.monotonic() < deadline:
            time.sleep(0.01)
        # From a thread that does not block it: the kernel may hand it to either thread.
        os.kill(os.getpid(), signal.SIGTERM)

    previous = signal.getsignal(signal.SIGTERM)
    threading.Thread(target=later).start()
    started = time.monotonic()
    try:
        assert supervisor.supervise({signal.SIGINT, signal.SIGTERM}) == signal.SIGTERM
        assert time.monotonic() - started < 3
        assert child.pid != first and child.running
    finally:
        supervisor.stop([["sleeper"]], grace_s=5)
    assert not child.running
    assert signal.getsignal(signal.SIGTERM) == previous  # the handlers are given back
    assert "sleeper (pid" in out.getvalue() and "was killed by SIGKILL" in out.getvalue()


def test_a_stop_signals_each_group_only_after_the_one_before_has_ended(tmp_path: Path) -> None:
    marks = tmp_path / "marks"
    # The first group's child takes a second over its stop; the second's notes when it is told.
    slow = (
        "import signal, sys, time\n"
        "def stop(*_):\n"
        "    time.sleep(1)\n"
        "    open(sys.argv[1], 'a').write(f'slow ended {time.time()}\\n')\n"
        "    sys.exit(0)\n"
        "signal.signal(signal.SIGTERM, stop)\n"
        "open(sys.argv[1], 'a').write('slow ready\\n')\n"
        "time.sleep(60)"
    )
    last = (
        "import signal, sys, time\n"
        "def stop(*_):\n"
        "    open(sys.argv[1], 'a').write(f'last told {time.time()}\\n')\n"
        "    sys.exit(0)\n"
        "signal.signal(signal.SIGTERM, stop)\n"
        "open(sys.argv[1], 'a').write('last ready\\n')\n"
        "time.sleep(60)"
    )
    supervisor = Supervisor(out=io.StringIO())
    supervisor.start("slow", [*_python(slow), str(marks)], None, tmp_path / "slow.log")
    supervisor.start("last", [*_python(last), str(marks)], None, tmp_path / "last.log")
    deadline = time.monotonic() + 30
    while not (marks.exists() and marks.read_text().count("ready") == 2):
        assert time.monotonic() < deadline
        time.sleep(0.05)
    supervisor.stop([["slow"], ["last"]], grace_s=10)
    events = dict(
        line.rsplit(" ", 1) for line in marks.read_text().splitlines() if "ready" not in line
    )
    assert float(events["slow ended"]) <= float(events["last told"])


def test_a_child_that_outlives_the_grace_is_killed(tmp_path: Path) -> None:
    out = io.StringIO()
    supervisor = Supervisor(out=out)
    stubborn = "import signal, time\nsignal.signal(signal.SIGTERM, signal.SIG_IGN)\ntime.sleep(60)"
    child = supervisor.start("stubborn", _python(stubborn), None, tmp_path / "l")
    time.sleep(1)  # its handler is in place
    supervisor.stop([["stubborn"]], grace_s=1)
    assert child.process is not None and child.process.returncode == -signal.SIGKILL
    assert "stubborn did not stop within 1 s; killing it" in out.getvalue()


@pytest.mark.parametrize("mask", [set(), {signal.SIGTERM, signal.SIGINT}])
def test_a_child_starts_with_a_clear_signal_mask_in_its_own_session(
    tmp_path: Path, mask: set[signal.Signals]
) -> None:
    """Started while the launcher blocks signals, a child still hears its SIGTERM; and a
    terminal's Ctrl-C (to the launcher's process group) does not reach it."""
    code = "import signal, time\nprint(sorted(signal.pthread_sigmask(signal.SIG_BLOCK, [])))\n"
    code += "import os; print(os.getsid(0) == os.getpid(), flush=True); time.sleep(60)"
    supervisor = Supervisor(out=io.StringIO())
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, mask)
    try:
        child = supervisor.start("masked", _python(code), None, tmp_path / "l")
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)
    deadline = time.monotonic() + 30
    while (tmp_path / "l").read_text().count("\n") < 2:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    supervisor.stop([["masked"]], grace_s=10)
    assert (tmp_path / "l").read_text().splitlines() == ["[]", "True"]
    assert child.process is not None and child.process.returncode == -signal.SIGTERM


def _wait(condition: Callable[[], bool], supervisor: Supervisor, timeout_s: float = 30.0) -> None:
    """Run the supervisor's checks until ``condition()`` holds."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        supervisor.check()
        time.sleep(0.01)


def test_a_dead_python_child_becomes_the_standby_and_another_standby_follows(
    tmp_path: Path,
) -> None:
    """The standby interpreter (tinsmith/standby.py) imports what it is named, then becomes the
    next `python -m` child that dies: the child's environment, log and name, in the standby's
    process, at the process's CPU priority though it imported at the lowest; another standby
    starts ``standby_delay_s`` later."""
    (tmp_path / "worker.py").write_text(
        "import os, sys, time\n"
        "comm = open('/proc/self/comm').read().strip()\n"
        "nice = os.getpriority(os.PRIO_PROCESS, 0)\n"
        "print(f\"worker {os.getpid()} {os.environ['WHO']} {comm} {sys.argv[1:]} {nice}\", "
        "flush=True)\n"
        "time.sleep(60)\n"
    )
    # What the standby imports is named on its command line; heavy stands for torch here. On
    # Linux, getpriority(PRIO_PROCESS, 0) is the calling thread's nice value.
    (tmp_path / "heavy.py").write_text(
        "import os, time\n"
        "print(f'heavy imported at nice {os.getpriority(os.PRIO_PROCESS, 0)}', flush=True)\n"
        "time.sleep(0.3)\n"
    )
    common = {
        **os.environ,
        "PYTHONPATH": f"{tmp_path}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
    }
    out = io.StringIO()
    supervisor = Supervisor(Backoff(first_s=0.1), out=out, standby_delay_s=0.5)
    log = tmp_path / "worker.log"
    child = supervisor.start(
        "worker",
        [sys.executable, "-m", "worker", "--flag"],
        {**common, "WHO": "worker-0"},
        log,
        standby=True,
    )
    # Children that may not become it: one started without ``standby``, one not `python -m`.
    light = supervisor.start(
        "light", [sys.executable, "-m", "worker"], {**common, "WHO": "light-0"}, tmp_path / "l"
    )
    other = supervisor.start(
        "script", _python("import time; time.sleep(60)"), None, tmp_path / "s", standby=True
    )
    standby_log = tmp_path / "standby.log"
    supervisor.keep_standby(
        [sys.executable, "-m", "tinsmith.standby", "heavy"], common, standby_log
    )
    try:
        _wait(lambda: "ready" in standby_log.read_text(), supervisor)
        # The services are busy when a standby imports: it imports at the lowest priority.
        assert f"heavy imported at nice {LOWEST_PRIORITY}" in standby_log.read_text()
        standby = supervisor._standby
        assert standby is not None
        for fresh in (light, other):  # started afresh: the standby still waits
            before = fresh.pid
            assert before is not None
            os.kill(before, signal.SIGKILL)
            _wait(lambda: fresh.pid != before and fresh.running, supervisor)  # noqa: B023
            assert fresh.pid != standby.process.pid and supervisor._standby is standby
        first = child.pid
        assert first is not None
        os.kill(first, signal.SIGKILL)
        _wait(lambda: child.pid not in (first, None) and child.running, supervisor)
        assert child.pid == standby.process.pid  # the standby became the worker

        def worker_lines() -> list[str]:
            return [line for line in log.read_text().splitlines() if line.startswith("worker ")]

        _wait(lambda: len(worker_lines()) == 2, supervisor)
        # The service it became runs at the process's own priority, as the fresh one did.
        own = str(os.getpriority(os.PRIO_PROCESS, 0))
        assert worker_lines()[0].split()[5] == own
        assert worker_lines()[1].split()[2:] == ["worker-0", "worker", "['--flag']", own]
        assert (
            "--- tinsmith up: restart 1 of worker (the standby interpreter) ---" in log.read_text()
        )
        # Used: another one is started after the delay.
        assert supervisor._standby is None
        _wait(lambda: supervisor._standby is not None, supervisor)
        assert supervisor._standby is not None and supervisor._standby.process.pid != child.pid
        waiting = supervisor._standby.process
    finally:
        supervisor.stop([["worker", "light", "script"]], grace_s=5)
    assert not child.running and not light.running and not other.running
    assert waiting.poll() is not None  # the waiting standby ends with the stop
