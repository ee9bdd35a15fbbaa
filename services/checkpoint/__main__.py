"""`python -m services.checkpoint`: the checkpoint catalog service (wiring only).

Keeps the catalog of sessions, training runs, checkpoints and samplers as SQL read models of the
event log (TINSMITH_CATALOG_URL), answers the gateway's catalog queries over NATS, deletes
checkpoints whose TTL has passed, garbage-collects orphaned blobs (TINSMITH_BLOB_URL), snapshots
the catalog and purges the event log below what every snapshot covers.
"""

from __future__ import annotations

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
        await engine.dispose()
        if scratch is not None:
            scratch.cleanup()

    return stop


if __name__ == "__main__":
    runtime.run("checkpoint", start, __doc__)
