"""How a service process runs: parse its command line (``--help`` only), set up its logs and
telemetry, serve its health endpoint (with the Prometheus ``/metrics``), connect to NATS, make
sure the streams exist, start, answer the readiness ping, and stop cleanly on SIGINT or SIGTERM
(flushing the spans and metrics not yet exported).

Readiness means: connected to NATS, and ``start`` finished, which for the trainer and the sampler
includes loading the base models named in ``TINSMITH_BASE_MODELS`` (``preload_base_models``). On a
stop signal the process reports not ready first, so a load balancer stops sending it work.

Owns: the lifecycle shared by the four services, so that each ``__main__`` is wiring only. Does
not own: any service's behaviour, or the health server itself (``tinsmith/health.py``).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import math
import os
import signal
import socket
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path

from aiohttp import web
from nats.errors import Error as NatsError

from tinsmith import health, host_allocator, models, subjects, telemetry
from tinsmith.bus import Bus, ended
from tinsmith.compute import ComputeThread
from tinsmith.failures import TinsmithError
from tinsmith.limits import count_from_env

log = logging.getLogger(__name__)

# Results (forward_backward outputs, samples) are kept this long for the SDK to fetch.
DEFAULT_RESULTS_MAX_AGE_S = 24 * 3600.0
SHUTDOWN_TIMEOUT_S = 15.0
# How often a service publishes its status report (the operators' engines view).
STATUS_INTERVAL_S = 2.0
END_TASKS_TIMEOUT_S = 1.0


def nats_url() -> str:
    url = os.environ.get("TINSMITH_NATS_URL", "")
    if not url:
        raise SystemExit(
            "TINSMITH_NATS_URL is not set: `tinsmith serve` runs one service against an existing "
            "NATS server (use `tinsmith up` to run everything with an embedded one)"
        )
    return url


def available_cpus() -> int:
    """The CPUs this process may use: its CPU affinity, within its cgroup's CPU quota (a
    container's limit), at least one. ``os.cpu_count()`` counts the whole machine: a container
    limited to 2 CPUs on a 64-core node would run 32 torch threads per engine."""
    count = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    quota = _cgroup_cpu_quota()
    if quota is not None:
        count = min(count or 1, max(1, math.floor(quota)))
    return max(1, count or 1)


def _cgroup_cpu_quota(root: Path = Path("/sys/fs/cgroup")) -> float | None:
    """CPUs' worth of time the cgroup may use (cgroup v2 ``cpu.max``, or v1's CFS quota);
    None when unlimited or unknown."""
    try:
        quota, period = (root / "cpu.max").read_text().split()[:2]
        return None if quota == "max" else int(quota) / int(period)
    except (OSError, ValueError):
        pass
    try:
        quota_us = int((root / "cpu" / "cpu.cfs_quota_us").read_text())
        period_us = int((root / "cpu" / "cpu.cfs_period_us").read_text())
    except (OSError, ValueError):
        return None
    return None if quota_us <= 0 or period_us <= 0 else quota_us / period_us


def torch_threads() -> int:
    """The torch threads of each engine's compute thread by default: the trainer and the
    sampler compute at the same time in RL loops, so each takes half the CPUs this process may
    use (``available_cpus``); ``TINSMITH_TORCH_THREADS`` overrides it."""
    threads = count_from_env("TINSMITH_TORCH_THREADS")
    return threads if threads is not None else max(1, available_cpus() // 2)


def results_max_age_s() -> float:
    return float(os.environ.get("TINSMITH_RESULTS_MAX_AGE_S", DEFAULT_RESULTS_MAX_AGE_S))


def base_models() -> tuple[str, ...]:
    """The base models to load at start-up, from ``TINSMITH_BASE_MODELS`` (comma-separated names
    as the model registry knows them). Empty: each loads on its first use."""
    raw = os.environ.get("TINSMITH_BASE_MODELS", "")
    names = tuple(dict.fromkeys(name.strip() for name in raw.split(",") if name.strip()))
    for name in names:
        try:
            models.get(name)
        except TinsmithError as exc:
            raise SystemExit(f"TINSMITH_BASE_MODELS: {exc}") from None
    return names


async def preload_base_models(compute: ComputeThread, load_base: Callable[[str], None]) -> None:
    """Load every model of ``TINSMITH_BASE_MODELS`` with ``load_base`` on the compute thread
    (all torch work of a process runs there), one after another, before the service starts."""
    for name in base_models():
        began = time.monotonic()
        await compute.run(load_base, name)
        log.info("base model %s loaded in %.1f s", name, time.monotonic() - began)


Start = Callable[[Bus], Awaitable[Callable[[], Awaitable[None]] | None]]

_EPILOG = """\
configuration comes from the environment: TINSMITH_NATS_URL (required), TINSMITH_HEALTH_PORT
(/livez, /readyz and the Prometheus /metrics; unset: no health server), TINSMITH_LOG_LEVEL,
TINSMITH_LOG_FORMAT (json or text), the standard OTEL_* variables for traces and metrics, and the
service's own TINSMITH_* variables (README.md, docs/deploy.md). Stop with SIGINT or SIGTERM."""


def run(name: str, start: Start, description: str | None = None, *, computes: bool = False) -> None:
    """Run service ``name`` until a signal: ``start(bus)`` sets it up and may return a cleanup.
    A service that ``computes`` (the trainer, the sampler) first sets the host allocator for
    its tensors (``host_allocator.tune``), before any thread of its own exists, and states it
    in its log and readiness facts.

    The command line takes no arguments; ``--help`` prints what the service is and how it is
    configured, and exits without connecting to anything."""
    parser = argparse.ArgumentParser(
        prog=f"python -m services.{name}",
        description=description,
        epilog=_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.parse_args()
    allocator = host_allocator.tune() if computes else None
    telemetry.configure_logging(name)
    if allocator is not None:
        log.info("%s: host memory through %s", name, allocator)
        health.state_fact("host allocator", allocator)
    telemetry.setup(name, instance=f"{socket.gethostname()}:{os.getpid()}")
    loop = asyncio.new_event_loop()
    try:
        loop.run_until_complete(_main(name, start))
        _end_tasks(loop, name)
    finally:
        loop.close()
        telemetry.shutdown()


def _end_tasks(loop: asyncio.AbstractEventLoop, name: str) -> None:
    """Cancel what is still running once the service has stopped, and give it
    ``END_TASKS_TIMEOUT_S`` to end: ``asyncio.run`` waits for every task without bound, and a
    task that never ends its cancellation (SQLAlchemy's aiosqlite connection, cancelled while it
    opened, waits for a close that never comes) kept a service that was stopped while starting
    from ever exiting."""
    pending = loop.run_until_complete(ended(asyncio.all_tasks(loop), END_TASKS_TIMEOUT_S))
    for task in pending:
        log.warning("%s: left behind a task that ignored its cancellation: %r", name, task)
    loop.run_until_complete(loop.shutdown_asyncgens())


@dataclass
class _Lifecycle:
    """What readiness looks at."""

    bus: Bus | None = None
    started: bool = False
    stopping: bool = False

    def connected(self) -> bool:
        return self.bus is not None and self.bus.nc.is_connected

    def serving(self) -> bool:
        return self.started and not self.stopping


async def _main(name: str, start: Start) -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    state = _Lifecycle()
    server = health.HealthServer(name)
    server.add_check("nats", state.connected)
    server.add_check("started", state.serving)
    server.add_route("/metrics", _metrics)
    port = health.port_from_env()
    if port is not None:  # first, so liveness answers while NATS or a model load is awaited
        await server.start(port, health.host_from_env())
    try:
        await _serve(name, start, stop, state)
    finally:
        await server.stop()


async def _metrics(_: web.Request) -> web.Response:
    body, content_type = telemetry.prometheus_text()
    return web.Response(body=body, headers={"Content-Type": content_type})


async def _serve(name: str, start: Start, stop: asyncio.Event, state: _Lifecycle) -> None:
    # A stop signal while starting (NATS unreachable, a long model load) ends the start-up.
    starting = asyncio.create_task(_start(name, start, state))
    stopped = asyncio.create_task(stop.wait())
    await asyncio.wait({starting, stopped}, return_when=asyncio.FIRST_COMPLETED)
    stopped.cancel()
    if not starting.done():
        starting.cancel()
        log.info("%s stopped while starting", name)
        if state.bus is not None:
            await _close(name, None, state.bus)
        return
    cleanup = starting.result()
    state.started = True
    log.info("%s ready", name)
    await stop.wait()
    state.stopping = True
    log.info("%s stopping", name)
    assert state.bus is not None
    await _close(name, cleanup, state.bus)


async def _start(
    name: str, start: Start, state: _Lifecycle
) -> Callable[[], Awaitable[None]] | None:
    bus = state.bus = await Bus.connect(nats_url(), name=f"tinsmith-{name}")
    await bus.ensure_streams(results_max_age_s())
    cleanup = await start(bus)

    async def pong(_: bytes) -> bytes:
        return json.dumps(health.facts()).encode()

    await bus.serve(subjects.ping_subject(name), pong)
    bus.spawn(_report_status(name, bus))
    return cleanup


async def _report_status(name: str, bus: Bus) -> None:
    """Publish ``telemetry.status`` every ``STATUS_INTERVAL_S`` on the service's status subject
    (core NATS: the gateways keep the last minutes of them for the engines view)."""
    while True:
        report = {"service": name, "replica": bus.replica, "time": time.time()}
        report.update(telemetry.status())
        try:
            await bus.notify(subjects.status_subject(name), json.dumps(report).encode())
        except NatsError as exc:  # the bus is away: this report is a gap in the chart
            log.debug("status report not sent: %r", exc)
        await asyncio.sleep(STATUS_INTERVAL_S)


async def _close(name: str, cleanup: Callable[[], Awaitable[None]] | None, bus: Bus) -> None:
    # Bounded: when NATS itself is gone (it may be stopping too), draining would wait forever.
    try:
        async with asyncio.timeout(SHUTDOWN_TIMEOUT_S):
            if cleanup is not None:
                await cleanup()
            try:
                await bus.close()
            except NatsError as exc:  # NATS is gone: nothing left to drain
                log.warning("%s: could not drain the NATS connection: %r", name, exc)
    except TimeoutError:
        log.warning("%s: shutdown took over %.0f s; exiting anyway", name, SHUTDOWN_TIMEOUT_S)
