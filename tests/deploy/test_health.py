"""The health endpoint of a real service process: live as soon as the process runs, ready only
while connected to NATS and started, base models included; and the preload's configuration."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from tests.conftest import _wait_port
from tests.deploy.manifests import ROOT
from tinsmith import runtime
from tinsmith.embedded import free_port, nats_server_binary


class Nats:
    """A private nats-server that a test may stop and start again (same port, same store)."""

    def __init__(self, store: Path) -> None:
        self.port = free_port()
        self.store = store
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"nats://127.0.0.1:{self.port}"

    def start(self) -> None:
        self.process = subprocess.Popen(
            [
                nats_server_binary(),
                "-a",
                "127.0.0.1",
                "-p",
                str(self.port),
                "-js",
                "-sd",
                str(self.store),
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        _wait_port(self.port)

    def stop(self) -> None:
        if self.process is not None:
            self.process.terminate()
            self.process.wait(10)
            self.process = None


@pytest.fixture
def nats_server(tmp_path: Path) -> Iterator[Nats]:
    server = Nats(tmp_path / "nats")
    server.start()
    yield server
    server.stop()


def _service(
    name: str, nats: Nats, tmp_path: Path, **env: str
) -> tuple[subprocess.Popen[str], int]:
    port = free_port()
    process = subprocess.Popen(
        [sys.executable, "-m", f"services.{name}"],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        cwd=ROOT,
        env={
            **os.environ,
            "TINSMITH_NATS_URL": nats.url,
            "TINSMITH_HEALTH_PORT": str(port),
            "TINSMITH_BLOB_URL": f"file://{tmp_path / 'blobs'}",
            **env,
        },
    )
    return process, port


def _get(port: int, path: str, host: str = "127.0.0.1") -> tuple[int, dict[str, object]]:
    try:
        with urllib.request.urlopen(f"http://{host}:{port}{path}", timeout=5) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read())


def _eventually(
    port: int, path: str, done: Callable[[int, dict[str, object]], bool], timeout: float = 120.0
) -> dict[str, object]:
    deadline = time.monotonic() + timeout
    last: object = None
    while time.monotonic() < deadline:
        try:
            status, body = _get(port, path)
        except OSError as exc:  # not listening yet, or busy importing (URLError, timeouts)
            last = exc
        else:
            if done(status, body):
                return body
            last = (status, body)
        time.sleep(0.1)
    raise AssertionError(f"{path} never got there; last answer: {last}")


def _stop(process: subprocess.Popen[str]) -> str:
    if process.returncode is None:
        process.send_signal(signal.SIGTERM)
    out, _ = process.communicate(timeout=60)
    assert process.returncode == 0, out
    return out


def test_a_service_is_ready_only_while_it_is_connected_to_nats(
    nats_server: Nats, tmp_path: Path
) -> None:
    process, port = _service("checkpoint", nats_server, tmp_path)
    try:
        body = _eventually(port, "/readyz", lambda status, _: status == 200)
        assert body == {
            "service": "checkpoint",
            "ready": True,
            "checks": {"nats": True, "started": True},
            "facts": {},  # the engines state their device here; the checkpoint service has none
        }

        nats_server.stop()
        body = _eventually(port, "/readyz", lambda status, _: status == 503)
        assert body["checks"] == {"nats": False, "started": True}
        assert _get(port, "/livez") == (200, {"service": "checkpoint", "live": True})

        nats_server.start()  # the client reconnects by itself
        _eventually(port, "/readyz", lambda status, _: status == 200)
    finally:
        out = _stop(process)
    assert "checkpoint ready" in out


def test_health_and_metrics_listen_on_the_services_own_host_only(
    nats_server: Nats, tmp_path: Path
) -> None:
    """``tinsmith up --host 127.0.0.1`` must not open metrics to the network: the health server
    binds the service's host (TINSMITH_HOST), not every interface."""
    process, port = _service("checkpoint", nats_server, tmp_path, TINSMITH_HOST="127.0.0.2")
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                assert _get(port, "/livez", host="127.0.0.2")[0] == 200
                break
            except OSError:
                assert time.monotonic() < deadline, "the health server never answered"
                time.sleep(0.1)
        with pytest.raises(OSError):
            _get(port, "/livez", host="127.0.0.1")
    finally:
        _stop(process)


def test_a_service_stops_within_three_seconds_of_its_signal(
    nats_server: Nats, tmp_path: Path
) -> None:
    """Stopping used to wait up to 15 s for the NATS client's drain."""
    for name in ("checkpoint", "gateway", "trainer", "sampler"):
        extra = {"TINSMITH_PORT": str(free_port()), "TINSMITH_GRPC_PORT": str(free_port())}
        process, port = _service(name, nats_server, tmp_path, **extra)
        try:
            _eventually(port, "/readyz", lambda status, _: status == 200)
        finally:
            began = time.monotonic()
            _stop(process)
            took = time.monotonic() - began
        assert took < 3.0, f"{name} took {took:.1f} s to stop"


def test_a_service_stopped_while_it_starts_exits_at_once(nats_server: Nats, tmp_path: Path) -> None:
    """Stopped as soon as it is live, the checkpoint service is still opening its catalog; a
    cancelled SQLAlchemy connection to SQLite never ends its close, and the process used to
    wait for it forever (about one stop in ten here)."""
    for _ in range(8):
        process, port = _service("checkpoint", nats_server, tmp_path)
        _eventually(port, "/livez", lambda status, _: status == 200)
        began = time.monotonic()
        _stop(process)
        took = time.monotonic() - began
        assert took < 3.0, f"it took {took:.1f} s to stop"


def test_a_service_is_live_but_not_ready_while_nats_is_unreachable(
    nats_server: Nats, tmp_path: Path
) -> None:
    nats_server.stop()
    process, port = _service("gateway", nats_server, tmp_path, TINSMITH_PORT=str(free_port()))
    try:
        _eventually(port, "/livez", lambda status, _: status == 200)
        status, body = _get(port, "/readyz")
        assert (status, body["checks"]) == (503, {"nats": False, "started": False})
    finally:
        out = _stop(process)  # a stop signal ends the wait for NATS
    assert "gateway stopped while starting" in out


def test_the_trainer_and_the_sampler_are_ready_once_their_base_models_are_loaded(
    nats_server: Nats, tmp_path: Path
) -> None:
    started = {  # both at once: each spends most of its start importing torch
        service: _service(
            service,
            nats_server,
            tmp_path,
            TINSMITH_BASE_MODELS="tinsmith/tiny",
            TINSMITH_SAMPLER_ENGINE="torch",
        )
        for service in ("trainer", "sampler")
    }
    try:
        for _, port in started.values():
            _eventually(port, "/readyz", lambda status, _: status == 200)
    finally:  # one SIGTERM each (a second one could land after the service's own handler is gone)
        logs = {service: _stop(process) for service, (process, _) in started.items()}
    for service, out in logs.items():
        assert out.index("base model tinsmith/tiny loaded") < out.index(f"{service} ready")


def test_base_models_are_named_once_and_checked_against_the_registry(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("TINSMITH_BASE_MODELS", " tinsmith/tiny, tinsmith/tiny ,")
    assert runtime.base_models() == ("tinsmith/tiny",)
    monkeypatch.setenv("TINSMITH_BASE_MODELS", "")
    assert runtime.base_models() == ()
    monkeypatch.setenv("TINSMITH_BASE_MODELS", "tinsmith/tiny,no/such-model")
    with pytest.raises(SystemExit, match=r"TINSMITH_BASE_MODELS: .*no/such-model"):
        runtime.base_models()
