"""The two tinsmith REST routes the examples use beside the SDK (``examples.autoresearch``,
``examples.text_to_sql``).

Owns: reporting a run's own scores at a step (``POST /api/v1/training_runs/{id}/metrics``, the
run owner's key), which the console draws as curves beside the trainer's, and the engines' busy
share over a span of time (``GET /api/v1/engines``, an admin key), computed from the duty cycle
each engine reports every few seconds. Neither is part of the Tinker API: against a server
without them (Tinker itself) the examples still run, with a line saying what they could not do.
Does not own: anything the SDK does.
"""

from __future__ import annotations

import asyncio
import itertools
import sys
import time
from types import TracebackType
from typing import Any

import aiohttp

TIMEOUT = aiohttp.ClientTimeout(total=60)
REPORTS_WAIT_S = 5.0  # the engines report every two seconds
ENGINES = ("trainer", "sampler")  # the services that compute; the rest only move requests


class NoBusyShare(Exception):
    """The engines' busy share could not be read; the message says why and what to do."""


class Rest:
    """An HTTP session to the server's REST routes; use as ``async with``."""

    def __init__(self, url: str, api_key: str) -> None:
        self.url = url.rstrip("/")
        self.api_key = api_key
        self.reporting = True  # until the server shows it has no metrics route
        self._http: aiohttp.ClientSession | None = None

    async def __aenter__(self) -> Rest:
        self._http = aiohttp.ClientSession(timeout=TIMEOUT)
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        if self._http is not None:
            await self._http.close()

    @property
    def http(self) -> aiohttp.ClientSession:
        assert self._http is not None, "use Rest as `async with`"
        return self._http

    async def report(self, run_id: str, step: int, metrics: dict[str, float]) -> None:
        """Keep ``metrics`` for the run at ``step``, beside the trainer's own. A server without
        the route gets one warning on stderr; nothing is sent to it after that."""
        if not self.reporting:
            return
        async with self.http.post(
            f"{self.url}/api/v1/training_runs/{run_id}/metrics",
            json={"metrics": metrics, "step": step},
            headers={"X-API-Key": self.api_key},
        ) as response:
            if response.status == 200:
                return
            detail = await _detail(response)
        if response.status in (404, 405):  # not tinsmith: the example goes on without it
            self.reporting = False
            print(
                f"this server keeps no client metrics ({response.status}: {detail}); the"
                " scores are only in this program's output",
                file=sys.stderr,
            )
            return
        raise RuntimeError(f"reporting metrics to {run_id} failed: {response.status} {detail}")

    async def busy_shares(self, admin_key: str, since: float, until: float) -> dict[str, float]:
        """Each engine replica's busy share between ``since`` and ``until`` (Unix times), by
        name ("trainer", or "trainer <replica>" where a service has several). Waits for the
        engines' first reports after ``until`` (they come every two seconds), so the end of the
        span counts too. ``NoBusyShare`` if the key may not read it or the server has no such
        route."""
        deadline = time.monotonic() + REPORTS_WAIT_S
        engines = await self._engines(admin_key)
        while time.monotonic() < deadline and not all(
            e["busy"] and e["busy"][-1][0] >= until for e in engines
        ):
            await asyncio.sleep(0.5)
            engines = await self._engines(admin_key)
        several = {s for s in ENGINES if sum(e["service"] == s for e in engines) > 1}
        shares = {}
        for engine in engines:
            share = busy_share(engine["busy"], since, until, engine.get("busy_since"))
            if share is not None:
                name = engine["service"]
                if name in several:
                    name += f" {engine['replica']}"
                shares[name] = share
        if not shares:
            raise NoBusyShare("no engine reported its duty cycle in that time")
        return shares

    async def _engines(self, admin_key: str) -> list[dict[str, Any]]:
        """The trainer and sampler replicas of ``GET /api/v1/engines``."""
        async with self.http.get(
            f"{self.url}/api/v1/engines", headers={"X-API-Key": admin_key}
        ) as response:
            if response.status != 200:
                detail = await _detail(response)
                raise NoBusyShare(_why_not(response.status, detail))
            body = await response.json()
        return [engine for engine in body["engines"] if engine["service"] in ENGINES]


def busy_share(
    points: list[list[float]], since: float, until: float, first_since: float | None = None
) -> float | None:
    """The time-weighted busy share over ``[since, until]`` of a replica's ``[[time, share],
    ...]``, where each share is of the interval since the point before it, and the first one's
    since ``first_since`` (the server's ``busy_since``; without it, that interval is left out);
    None if no interval overlaps the span. A span shorter than the reports' period, right after
    the replica started reporting, may lie in its first interval alone."""
    if first_since is not None:
        points = [[first_since, 0.0], *points]
    busy = covered = 0.0
    for (start, _), (end, share) in itertools.pairwise(points):
        overlap = min(end, until) - max(start, since)
        if overlap > 0:
            busy += share * overlap
            covered += overlap
    return busy / covered if covered else None


def _why_not(status: int, detail: str) -> str:
    if status == 403:
        return (
            "the engines' busy share needs an admin key (the server said: "
            f"{detail}); issue one on the server with `tinsmith keys create --tenant ops --admin`"
            " and pass it as --admin-key or TINSMITH_ADMIN_KEY"
        )
    if status == 401:
        return f"the admin key was refused ({detail})"
    return f"this server has no engines view ({status}: {detail})"


async def _detail(response: aiohttp.ClientResponse) -> str:
    """The ``detail`` of an error answer, else the start of its text."""
    text = await response.text()
    try:
        body: Any = await response.json(content_type=None)
    except ValueError:
        return text[:200]
    if isinstance(body, dict) and isinstance(body.get("detail"), str):
        return str(body["detail"])
    return text[:200]
