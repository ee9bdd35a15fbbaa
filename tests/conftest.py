"""Shared fixtures: a real nats-server on a free port, and the whole system via `tinsmith up`."""

from __future__ import annotations

import os
import select
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tinsmith.embedded import free_port, nats_server_binary

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TINKER_TELEMETRY", "0")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


@pytest.fixture(scope="session")
def nats_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A private nats-server with JetStream, for the tests that talk to the bus directly."""
    store = tmp_path_factory.mktemp("nats")
    port = free_port()
    process = subprocess.Popen(
        [nats_server_binary(), "-a", "127.0.0.1", "-p", str(port), "-js", "-sd", str(store)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    _wait_port(port)
    yield f"nats://127.0.0.1:{port}"
    process.terminate()
    process.wait(10)


def _wait_port(port: int, timeout: float = 10.0) -> None:
    import socket

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with socket.socket() as sock:
            if sock.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.05)
    raise TimeoutError(f"nothing listens on {port}")


class RunningSystem:
    def __init__(
        self,
        process: subprocess.Popen[bytes],
        url: str,
        data_dir: Path,
        grpc_target: str = "",
        metrics: dict[str, str] | None = None,
    ) -> None:
        self.process = process
        self.url = url
        self.data_dir = data_dir
        self.grpc_target = grpc_target  # host:port of the gateway's gRPC API
        self.metrics = metrics or {}  # service -> its Prometheus /metrics URL

    def logs(self) -> str:
        return "\n".join(
            f"== {p.name}\n{p.read_text()[-3000:]}"
            for p in sorted((self.data_dir / "logs").glob("*"))
        )


def start_system(
    data_dir: Path,
    timeout: float = 300.0,
    port: int | None = None,
    env: dict[str, str] | None = None,
) -> RunningSystem:
    port = port or free_port()
    tinsmith = Path(sys.executable).parent / "tinsmith"
    process = subprocess.Popen(
        [str(tinsmith), "up", "--port", str(port), "--data-dir", str(data_dir)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        env={**os.environ, **(env or {})},
    )
    assert process.stdout is not None
    deadline = time.monotonic() + timeout
    seen: list[str] = []
    grpc_target = ""
    metrics = {}
    for line in _lines(process.stdout.fileno(), deadline):
        seen.append(line)
        words = line.split()
        if line.startswith("tinsmith gRPC at "):
            grpc_target = words[-1]
        if words[2:4] == ["metrics", "at"]:
            metrics[words[1]] = words[-1]
        if line.startswith("tinsmith ready at "):
            return RunningSystem(process, words[-1], data_dir, grpc_target, metrics)
    process.kill()
    raise RuntimeError(f"tinsmith up did not become ready: {''.join(seen)}")


def _lines(fd: int, deadline: float) -> Iterator[str]:
    """The lines written to ``fd`` until it closes or ``deadline`` passes. Read unbuffered: a
    buffered reader may take several lines in one read, which ``select`` then never reports."""
    pending = b""
    while time.monotonic() < deadline:
        ready, _, _ = select.select([fd], [], [], 1.0)
        if not ready:
            continue
        chunk = os.read(fd, 65536)
        if not chunk:
            return
        *lines, pending = (pending + chunk).split(b"\n")
        yield from (line.decode() + "\n" for line in lines)


def stop_system(system: RunningSystem) -> int:
    system.process.send_signal(signal.SIGTERM)
    return system.process.wait(60)


@pytest.fixture(scope="session")
def system(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningSystem]:
    running = start_system(tmp_path_factory.mktemp("tinsmith"))
    yield running
    stop_system(running)
