"""The health endpoint of one service process, for Kubernetes probes and load balancers.

Owns: a small HTTP server (aiohttp) with two routes, and the readiness checks a process registers:

- ``GET /livez``: 200 while the process's event loop answers. Compute runs on its own thread, so
  a long step or a model load does not make a process look dead.
- ``GET /readyz``: 200 when every registered check passes, else 503; the JSON body names each
  check and its result, so an operator sees why a pod is not ready, and the facts the process
  states about itself (``state_fact``: the device an engine computes on).

The server listens on ``TINSMITH_HEALTH_PORT`` (unset or empty: no server), on the service's own
host: ``TINSMITH_HEALTH_HOST``, else ``TINSMITH_HOST``, else loopback. The kustomize base sets
``TINSMITH_HOST=0.0.0.0`` (the kubelet probes the pod's address); ``tinsmith up --host H`` keeps
its health and metrics on ``H``. ``tinsmith up`` gives each of its services a free port of its own
(it prints their ``/metrics`` addresses) and checks readiness over NATS.

Does not own: what the checks look at, or the Prometheus ``/metrics`` route (``tinsmith/runtime.py``
registers both; routes are added with ``add_route`` before ``start``).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Awaitable, Callable

from aiohttp import web

log = logging.getLogger(__name__)

PORT_VARIABLE = "TINSMITH_HEALTH_PORT"
HOST_VARIABLE = "TINSMITH_HEALTH_HOST"

Check = Callable[[], bool]
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]

# What this process states about itself for operators (say, the device an engine computes on):
# shown in /readyz, answered to the readiness ping, which ``tinsmith up`` prints.
_FACTS: dict[str, str] = {}


def state_fact(name: str, value: str) -> None:
    """Publish one fact about this process, e.g. ``state_fact("device", "cuda:0 (...)")``."""
    _FACTS[name] = value


def facts() -> dict[str, str]:
    return dict(_FACTS)


def port_from_env() -> int | None:
    """The health port from the environment: None (no server) when unset or empty."""
    value = os.environ.get("TINSMITH_HEALTH_PORT", "").strip()
    if not value:
        return None
    try:
        port = int(value)
    except ValueError:
        raise SystemExit(f"{PORT_VARIABLE}={value!r} is not a port number") from None
    if not 0 < port < 65536:
        raise SystemExit(f"{PORT_VARIABLE}={value!r} is not a port number")
    return port


def host_from_env() -> str:
    """Where the health server listens: ``TINSMITH_HEALTH_HOST``, else the service's own
    ``TINSMITH_HOST``, else loopback."""
    for name in (HOST_VARIABLE, "TINSMITH_HOST"):
        value = os.environ.get(name, "").strip()
        if value:
            return value
    return "127.0.0.1"


class HealthServer:
    """Liveness and readiness of the process named ``service``."""

    def __init__(self, service: str) -> None:
        self.service = service
        self.app = web.Application()
        self._checks: dict[str, Check] = {}
        self._runner: web.AppRunner | None = None
        self.port: int | None = None
        self.add_route("/livez", self._livez)
        self.add_route("/readyz", self._readyz)

    def add_check(self, name: str, check: Check) -> None:
        """Make readiness depend on ``check()`` too; it must be cheap and must not block."""
        self._checks[name] = check

    def add_route(self, path: str, handler: Handler) -> None:
        """Serve ``GET path`` (before ``start``: the routes are fixed once the server runs)."""
        self.app.router.add_get(path, handler)

    def readiness(self) -> dict[str, bool]:
        """Each check's result, by name."""
        results = {}
        for name, check in self._checks.items():
            try:
                results[name] = bool(check())
            except Exception:
                log.exception("readiness check %s failed", name)
                results[name] = False
        return results

    async def start(self, port: int, host: str = "127.0.0.1") -> None:
        """Listen on ``host:port`` (``0.0.0.0``: every interface)."""
        runner = web.AppRunner(self.app, access_log=None, handle_signals=False)
        await runner.setup()
        site = web.TCPSite(runner, host=host, port=port, reuse_address=True)
        await site.start()
        self._runner = runner
        self.port = port
        log.info("%s health endpoint on %s:%d (/livez, /readyz)", self.service, host, port)

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    async def _livez(self, _: web.Request) -> web.Response:
        return web.json_response({"service": self.service, "live": True})

    async def _readyz(self, _: web.Request) -> web.Response:
        checks = self.readiness()
        ready = all(checks.values())
        return web.json_response(
            {"service": self.service, "ready": ready, "checks": checks, "facts": facts()},
            status=200 if ready else 503,
        )
