"""Shared fixtures: a real nats-server on a free port, and the whole system via `tinsmith up`."""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import os
import shutil
import subprocess
import tempfile
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import nats.js.errors
import pytest

from tinsmith import subjects
from tinsmith.bus import Bus
from tinsmith.child import UpProcess
from tinsmith.embedded import free_port, nats_server_binary
from tinsmith.eventlog import EventLog

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TINKER_TELEMETRY", "0")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# A Hugging Face home of the tests' own, for them and the systems they start, never the
# developer's: get_tokenizer() loads a built-in model by its name from the hub cache, so only
# what `tinsmith up` installed there makes it work.
_HF_HOME = tempfile.mkdtemp(prefix="tinsmith-tests-hf-")
atexit.register(shutil.rmtree, _HF_HOME, ignore_errors=True)
os.environ["HF_HOME"] = _HF_HOME
for _variable in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE"):
    os.environ.pop(_variable, None)


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


@pytest.fixture
async def eventlog(nats_url: str) -> AsyncIterator[EventLog]:
    """The event log on the private nats-server, emptied first: each test starts with none."""
    connection = await Bus.connect(nats_url, name="test")
    for stream in (subjects.EVENTS_STREAM, subjects.RESULTS_STREAM):
        with contextlib.suppress(Exception):
            await connection.js.delete_stream(stream)
    # nats-server removes a deleted stream's store after it answered, and now and then refuses
    # a stream of the same name made at once ("error creating store for stream"): again.
    for attempt in range(20):
        try:
            await connection.ensure_streams(results_max_age_s=60)
            break
        except nats.js.errors.ServerError:
            if attempt == 19:
                raise
            await asyncio.sleep(0.05)
    yield EventLog(connection)
    await connection.close()


class RunningSystem:
    """A ``tinsmith up`` the tests started, with what it announced."""

    def __init__(self, up: UpProcess) -> None:
        self.up = up
        self.process = up.process
        self.url = up.url
        self.data_dir = up.data_dir
        self.grpc_target = up.grpc_target  # host:port of the gateway's gRPC API
        self.metrics = up.metrics  # service -> its Prometheus /metrics URL

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
    standby: bool = True,
) -> RunningSystem:
    up = UpProcess(data_dir, port=port, env=env, standby=standby)
    try:
        up.wait_ready(timeout)
    except RuntimeError:
        up.stop()
        raise
    return RunningSystem(up)


def stop_system(system: RunningSystem) -> int:
    return system.up.stop(60)


@pytest.fixture(scope="session")
def system(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningSystem]:
    running = start_system(tmp_path_factory.mktemp("tinsmith"))
    yield running
    stop_system(running)
