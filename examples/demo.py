"""``make demo``: start a private tinsmith, teach a model pig latin through it, stop it again.

Run from the repository root::

    python -m examples.demo [options of examples/sft_pig_latin.py, e.g. --steps 20]

It runs ``tinsmith up`` (the executable next to this Python) on a free port with a fresh data
directory, waits for its ``tinsmith ready at URL`` line, runs ``examples/sft_pig_latin.py`` against
that URL with the same Python, and stops the system with SIGTERM whatever happened: on success, on
failure and on Ctrl-C. The exit status is the training script's. If something fails, the tails of
the service logs are printed and the data directory (with the logs) is kept. On Linux the
children get SIGTERM even if this process is killed outright.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from types import FrameType

READY = "tinsmith ready at "
READY_TIMEOUT_S = 300.0  # models convert on first use, not at start: this is for a loaded machine
STOP_TIMEOUT_S = 60.0
REPO = Path(__file__).resolve().parent.parent


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def _die_with_parent() -> None:
    """In the child before exec: get SIGTERM if this process dies, even by SIGKILL (Linux)."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


def print_logs(data_dir: Path, lines: int = 20) -> None:
    for log in sorted((data_dir / "logs").glob("*.log")):
        tail = log.read_text(errors="replace").splitlines()[-lines:]
        print(f"\n==> {log} (last {len(tail)} lines) <==", file=sys.stderr)
        print("\n".join(tail), file=sys.stderr)


class Tinsmith:
    """A ``tinsmith up`` child process: its URL once ready, and its output echoed after that."""

    def __init__(self, data_dir: Path) -> None:
        self.data_dir = data_dir
        self.url: str | None = None
        self._ready = threading.Event()
        self.process = subprocess.Popen(
            [
                str(Path(sys.executable).parent / "tinsmith"),
                *("up", "--port", str(free_port()), "--data-dir", str(data_dir)),
            ],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,  # Ctrl-C reaches only us; we stop it in order, with SIGTERM
            preexec_fn=_die_with_parent,
        )
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.process.stdout is not None
        for line in self.process.stdout:
            if line.startswith(READY) and self.url is None:
                self.url = line[len(READY) :].strip()
                self._ready.set()
            else:
                print(f"[tinsmith] {line.rstrip()}", file=sys.stderr, flush=True)
        self._ready.set()  # it exited: stop waiting

    def wait_ready(self, timeout: float) -> str | None:
        self._ready.wait(timeout)
        return self.url

    def stop(self) -> None:
        """SIGTERM, then wait; SIGKILL to its whole process group if it does not stop in time."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                print("tinsmith did not stop in time; killing it", file=sys.stderr)
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.process.pid, signal.SIGKILL)  # whatever is left in its group
        self.process.wait()


@contextlib.contextmanager
def sigterm_as_interrupt() -> Iterator[None]:
    """Stop on SIGTERM (``make`` being killed, say) the way Ctrl-C does, so cleanup runs."""

    def interrupt(signum: int, frame: FrameType | None) -> None:
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGTERM, interrupt)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def main(argv: Sequence[str] | None = None) -> int:
    extra = list(sys.argv[1:] if argv is None else argv)
    # For both children: tinsmith up and the training script.
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TINKER_TELEMETRY", "0")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    os.environ.setdefault("TINKER_API_KEY", "tml-tinsmith-demo")  # tinsmith takes any tml- key
    # The trainer and the sampler each default to half the cores, for RL loops that run both at
    # once. The demo trains and samples in turn, so each may use them all: ~1.6x faster steps.
    os.environ.setdefault("TINSMITH_TORCH_THREADS", str(os.cpu_count() or 1))

    started = time.monotonic()
    (REPO / ".tinsmith").mkdir(exist_ok=True)
    data_dir = Path(tempfile.mkdtemp(prefix="demo-", dir=REPO / ".tinsmith"))
    status = 1
    with sigterm_as_interrupt():
        system: Tinsmith | None = None
        try:
            print(f"Starting tinsmith (data in {data_dir.relative_to(REPO)}) ...", flush=True)
            system = Tinsmith(data_dir)
            url = system.wait_ready(READY_TIMEOUT_S)
            if url is None:
                print(f"tinsmith did not become ready in {READY_TIMEOUT_S:.0f}s", file=sys.stderr)
                print_logs(data_dir)
                return 1
            print(f"tinsmith ready at {url} after {time.monotonic() - started:.0f}s", flush=True)
            training = subprocess.run(
                [sys.executable, "-m", "examples.sft_pig_latin", "--base-url", url, *extra],
                cwd=REPO,
                check=False,
                preexec_fn=_die_with_parent,
            )
            status = training.returncode
            if status != 0:
                print(f"\nthe training script failed (exit status {status})", file=sys.stderr)
                print_logs(data_dir)
        except KeyboardInterrupt:
            print("\ninterrupted", file=sys.stderr)
            status = 130
        finally:
            if system is not None:
                print("Stopping tinsmith ...", flush=True)
                system.stop()
                if system.process.returncode not in (0, -signal.SIGTERM) and status == 0:
                    print(f"tinsmith exited with {system.process.returncode}", file=sys.stderr)
            if status == 0:
                shutil.rmtree(data_dir, ignore_errors=True)
            else:
                print(f"logs kept in {data_dir / 'logs'}", file=sys.stderr)
    print(f"demo finished in {time.monotonic() - started:.0f}s (exit status {status})")
    return status


if __name__ == "__main__":
    sys.exit(main())
