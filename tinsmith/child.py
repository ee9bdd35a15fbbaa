"""``tinsmith up`` as a child process of a client program: the demo, the benchmarks, the tests.

Owns: starting the launcher (the ``tinsmith`` executable beside this Python) on a port and data
directory of the caller's choosing, reading what it announces (the gRPC target, each service's
metrics address, then ``tinsmith ready at URL``), and stopping it with SIGTERM, with SIGKILL to
its process group as the last resort (its children, each in a session of its own, then get
SIGTERM from the kernel: ``PR_SET_PDEATHSIG``). Its output is read by a thread, never with
``select`` on a buffered pipe: the launcher writes its last lines in one burst, and lines already
in a reader's buffer would never wake ``select``. Does not own: the launcher itself
(tinsmith/embedded.py).
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator, Mapping
from pathlib import Path
from types import FrameType

from tinsmith import standby
from tinsmith.embedded import free_port
from tinsmith.supervision import die_with_parent

READY = "tinsmith ready at "
GRPC = "tinsmith gRPC at "


class UpProcess:
    """A running ``tinsmith up``: its URL, gRPC target and metrics addresses once it is ready."""

    def __init__(
        self,
        data_dir: Path,
        *,
        port: int | None = None,
        env: Mapping[str, str] | None = None,
        echo: bool = False,
        standby: bool = True,
    ) -> None:
        """Start it. ``env`` adds to this process's environment; with ``echo``, its output is
        printed to stderr as it comes, prefixed ``[tinsmith]``; without ``standby``, it keeps
        no standby interpreter (``--no-standby``)."""
        self.data_dir = data_dir
        self.keeps_standby = standby
        self.url = ""
        self.grpc_target = ""
        self.metrics: dict[str, str] = {}  # service -> its Prometheus /metrics URL
        self.output: list[str] = []
        self._echo = echo
        self._ready = threading.Event()
        argv = ["up", "--port", str(port or free_port()), "--data-dir", str(data_dir)]
        if not standby:
            argv.append("--no-standby")
        self.process = subprocess.Popen(
            [str(Path(sys.executable).parent / "tinsmith"), *argv],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env={**os.environ, **(env or {})},
            start_new_session=True,  # a Ctrl-C reaches only the caller, which stops it in order
            preexec_fn=die_with_parent,
        )
        threading.Thread(target=self._read, name="tinsmith-up-output", daemon=True).start()

    def _read(self) -> None:
        assert self.process.stdout is not None
        for line in self.process.stdout:
            self.output.append(line)
            words = line.split()
            if line.startswith(GRPC):
                self.grpc_target = words[-1]
            elif words[2:4] == ["metrics", "at"]:
                self.metrics[words[1]] = words[-1]
            elif line.startswith(READY) and not self.url:
                self.url = words[-1]
                self._ready.set()
            if self._echo:
                print(f"[tinsmith] {line.rstrip()}", file=sys.stderr, flush=True)
        self._ready.set()  # it exited: stop waiting

    def wait_ready(self, timeout_s: float) -> str:
        """The HTTP URL once every service is ready; RuntimeError, with what the launcher said,
        if it exits or ``timeout_s`` passes first."""
        self._ready.wait(timeout_s)
        if not self.url:
            state = (
                "exited" if self.process.poll() is not None else f"not ready in {timeout_s:.0f} s"
            )
            raise RuntimeError(f"tinsmith up {state}:\n{''.join(self.output)}")
        return self.url

    def wait_standby(self, timeout_s: float) -> None:
        """Return once the standby interpreter, which the launcher starts as soon as it is ready,
        has imported the engines' libraries (its log says so), at once without one. A benchmark
        measures after this: those seconds of imports share the machine with the services.
        RuntimeError if ``timeout_s`` passes first."""
        if not self.keeps_standby:
            return
        log = self.data_dir / "logs" / "standby.log"
        deadline = time.monotonic() + timeout_s
        while not (log.is_file() and standby.READY in log.read_text(errors="replace")):
            if time.monotonic() > deadline or self.process.poll() is not None:
                raise RuntimeError(f"the standby interpreter was not ready in {timeout_s:.0f} s")
            time.sleep(0.1)

    def stop(self, timeout_s: float = 60.0) -> int:
        """SIGTERM, then wait; SIGKILL to its whole process group if it does not stop in time.
        Returns its exit status."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                return self.process.wait(timeout_s)
            except subprocess.TimeoutExpired:
                print("tinsmith up did not stop in time; killing it", file=sys.stderr)
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.process.pid, signal.SIGKILL)  # whatever is left in its group
        return self.process.wait()

    def print_logs(self, lines: int = 20) -> None:
        """The last ``lines`` of each service's log, to stderr (for when something failed)."""
        for log in sorted((self.data_dir / "logs").glob("*.log")):
            tail = log.read_text(errors="replace").splitlines()[-lines:]
            print(f"\n==> {log} (last {len(tail)} lines) <==", file=sys.stderr)
            print("\n".join(tail), file=sys.stderr)


@contextlib.contextmanager
def sigterm_as_interrupt() -> Iterator[None]:
    """Take SIGTERM (``make`` being killed, say) the way Ctrl-C is taken, so that the caller's
    clean-up (stopping the child, removing a temporary directory) runs."""

    def interrupt(signum: int, frame: FrameType | None) -> None:
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGTERM, interrupt)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)
