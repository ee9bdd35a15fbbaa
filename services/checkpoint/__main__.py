"""`python -m services.checkpoint`: the checkpoint catalog service (wiring only).

Keeps the catalog of sessions, training runs and checkpoints as read models of the event log, and
answers the gateway's catalog queries over NATS.
"""

from __future__ import annotations

from tinsmith import runtime, subjects
from tinsmith.blobs import BlobStore
from tinsmith.bus import Bus
from tinsmith.eventlog import EventLog

from .config import CheckpointConfig
from .handlers import Catalog


async def start(bus: Bus) -> None:
    config = CheckpointConfig.from_env()
    catalog = Catalog(EventLog(bus), BlobStore(config.blob_url))
    await catalog.start()
    await bus.serve(subjects.RESOLVE_CHECKPOINT, catalog.resolve)
    await bus.serve(subjects.CATALOG_TRAINING_RUN, catalog.training_run)


if __name__ == "__main__":
    runtime.run("checkpoint", start, __doc__)
