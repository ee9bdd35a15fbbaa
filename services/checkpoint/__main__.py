"""`python -m services.checkpoint`: the checkpoint catalog service (wiring only).

Keeps the catalog of sessions, training runs, checkpoints and samplers as SQL read models of the
event log (TINSMITH_CATALOG_URL), answers the gateway's catalog queries over NATS, deletes
checkpoints whose TTL has passed, garbage-collects orphaned blobs (TINSMITH_BLOB_URL), snapshots
the catalog and purges the event log below what every snapshot covers.
"""

from __future__ import annotations

import logging
import tempfile
from collections.abc import Awaitable, Callable

from tinsmith import catalog, runtime, snapshots, subjects
from tinsmith.blobs import BlobStore
from tinsmith.bus import Bus
from tinsmith.eventlog import EventLog

from .config import CheckpointConfig
from .handlers import Catalog
from .projection import SqlProjection
from .retention import Retention
from .storage import Storage

log = logging.getLogger(__name__)
# How long a stop waits for the catalog's own tasks to end before it closes the database: a
# transaction or query they had begun finishes in milliseconds; the runtime then gives what is
# left of the process a second more (tinsmith/runtime.py).
_STOP_WAIT_S = 2.0


async def start(bus: Bus) -> Callable[[], Awaitable[None]]:
    config = CheckpointConfig.from_env()
    eventlog = EventLog(bus)
    blobs = BlobStore(config.blob_url)
    scratch = None
    url = config.catalog_url
    if not url:  # no database configured: a throwaway one, rebuilt from the log at each start
        scratch = tempfile.TemporaryDirectory(prefix="tinsmith-catalog-")
        url = f"sqlite+aiosqlite:///{scratch.name}/catalog.db"
    engine = catalog.create_engine(url)
    projection = SqlProjection(eventlog, engine, gather_s=config.catalog_gather_s)
    # The catalog's snapshots (TINSMITH_PROJECTION_SNAPSHOT_EVENTS, _S), and after each, the event
    # log's retention (TINSMITH_EVENTS_RETENTION).
    projection.keep_snapshots(snapshots.Policy.from_env())
    purge = Retention(bus, projection.snapshots, purge=config.events_retention == "snapshots")
    projection.on_snapshot(purge.after_snapshot)
    storage = Storage(
        eventlog,
        projection,
        blobs,
        gc_grace_s=config.gc_grace_s,
        gc_interval_s=config.gc_interval_s,
    )
    service = Catalog(eventlog, projection, storage, blobs, url_ttl_s=config.url_ttl_s)
    await projection.start()
    storage.start()
    for op, handler in service.operations().items():
        await bus.serve(subjects.catalog_subject(op), handler)

    async def stop() -> None:
        # What uses the database ends first: a query still running in SQLite's thread when the
        # engine is disposed and its directory removed writes into a removed directory.
        running = await storage.stop(_STOP_WAIT_S) + await projection.stop(_STOP_WAIT_S)
        if running:
            log.warning("%d catalog task(s) did not end within %.0f s", running, _STOP_WAIT_S)
        await engine.dispose()
        if scratch is not None:
            try:
                scratch.cleanup()
            except OSError as exc:  # a query that outlived its cancellation wrote into it
                log.warning("could not remove the throwaway catalog %s: %s", scratch.name, exc)

    return stop


if __name__ == "__main__":
    runtime.run("checkpoint", start, __doc__)
