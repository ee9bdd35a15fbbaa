"""How a service process runs: connect to NATS, make sure the streams exist, start, answer the
readiness ping, and stop cleanly on SIGINT or SIGTERM.

Owns: the lifecycle shared by the four services, so that each ``__main__`` is wiring only. Does
not own: any service's behaviour.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
from collections.abc import Awaitable, Callable

from tinsmith import subjects
from tinsmith.bus import Bus

log = logging.getLogger(__name__)

# Results (forward_backward outputs, samples) are kept this long for the SDK to fetch.
DEFAULT_RESULTS_MAX_AGE_S = 24 * 3600.0
SHUTDOWN_TIMEOUT_S = 15.0


def nats_url() -> str:
    url = os.environ.get("TINSMITH_NATS_URL", "")
    if not url:
        raise SystemExit(
            "TINSMITH_NATS_URL is not set: `tinsmith serve` runs one service against an existing "
            "NATS server (use `tinsmith up` to run everything with an embedded one)"
        )
    return url


def results_max_age_s() -> float:
    return float(os.environ.get("TINSMITH_RESULTS_MAX_AGE_S", DEFAULT_RESULTS_MAX_AGE_S))


def configure_logging() -> None:
    logging.basicConfig(
        level=os.environ.get("TINSMITH_LOG_LEVEL", "INFO").upper(),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )


def run(name: str, start: Callable[[Bus], Awaitable[Callable[[], Awaitable[None]] | None]]) -> None:
    """Run service ``name`` until a signal: ``start(bus)`` sets it up and may return a cleanup."""
    configure_logging()
    asyncio.run(_main(name, start))


async def _main(
    name: str, start: Callable[[Bus], Awaitable[Callable[[], Awaitable[None]] | None]]
) -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    bus = await Bus.connect(nats_url(), name=f"tinsmith-{name}")
    await bus.ensure_streams(results_max_age_s())
    cleanup = await start(bus)

    async def pong(_: bytes) -> bytes:
        return b"ok"

    await bus.serve(subjects.ping_subject(name), pong)
    log.info("%s ready", name)
    await stop.wait()
    log.info("%s stopping", name)
    # Bounded: when NATS itself is gone (it may be stopping too), draining would wait forever.
    try:
        async with asyncio.timeout(SHUTDOWN_TIMEOUT_S):
            if cleanup is not None:
                await cleanup()
            await bus.close()
    except TimeoutError:
        log.warning("%s: shutdown took over %.0f s; exiting anyway", name, SHUTDOWN_TIMEOUT_S)
