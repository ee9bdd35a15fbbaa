"""What the checkpoint service does to the object store: deleting a checkpoint (asked, or because
its TTL passed), removing the blob an overwrite replaced, and garbage collection.

Owns: the order of a deletion (bytes first, then the ``CheckpointDeleted`` event: a checkpoint
is never listed as gone while its bytes remain, and a crash in between leaves a listed checkpoint
whose deletion can simply be asked again), the TTL clock (it sleeps until the next expiry, and is
woken when a TTL is set), and the garbage-collection pass. Does not own: the tables
(tinsmith/catalog.py) or the REST answers (handlers.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time

from tinsmith import artifacts, catalog, events
from tinsmith._proto import bus_pb2 as bus
from tinsmith.blobs import BlobStore
from tinsmith.bus import ended
from tinsmith.eventlog import EventLog

from .projection import SqlProjection

log = logging.getLogger(__name__)

# The longest the TTL clock sleeps without looking again (a bound, not a poll: it is also woken
# whenever a checkpoint with a TTL is saved or a TTL is set).
_MAX_SLEEP_S = 3600.0


class Storage:
    def __init__(
        self,
        eventlog: EventLog,
        projection: SqlProjection,
        blobs: BlobStore,
        *,
        gc_grace_s: float,
        gc_interval_s: float,
    ) -> None:
        self.log = eventlog
        self.projection = projection
        self.blobs = blobs
        self.gc_grace_s = gc_grace_s
        self.gc_interval_s = gc_interval_s
        self._wake = asyncio.Event()
        self._tasks: list[asyncio.Future[None]] = []
        projection.on_folded(self._after_fold)

    def start(self) -> None:
        self._tasks = [
            self.log.bus.spawn(self._expire_forever()),
            self.log.bus.spawn(self._collect_forever()),
        ]

    async def stop(self, timeout_s: float) -> int:
        """End the expiry and collection loops, waiting up to ``timeout_s`` for a query they had
        begun, so that the catalog's database can be closed under nothing; returns how many have
        not ended."""
        tasks, self._tasks = self._tasks, []
        return len(await ended(tasks, timeout_s))

    async def _after_fold(self, released: list[str], kinds: set[str]) -> None:
        if kinds & {"weights_saved", "checkpoint_ttl_set"}:
            self._wake.set()
        if not released:
            return
        async with self.projection.session() as session:
            live = await catalog.referenced_keys(session)
        for key in released:
            if key not in live and await self.blobs.delete(key):
                log.info("removed %s: its checkpoint was overwritten", key)

    async def delete(self, row: catalog.CheckpointRow, reason: str) -> int:
        """Delete a checkpoint: its bytes, then the event. Returns the event's log position once
        the catalog reflects it."""
        await self.blobs.delete(row.blob_key)
        deleted = bus.CheckpointDeleted(
            model_id=row.model_id, tinker_path=row.tinker_path, blob_key=row.blob_key, reason=reason
        )
        seq, _ = await self.log.append(
            events.make(checkpoint_deleted=deleted), msg_id=f"delete:{row.tinker_path}:{row.seq}"
        )
        await self.projection.wait_for(seq)
        log.info("deleted %s (%s, %d bytes)", row.tinker_path, reason, row.size_bytes)
        return seq

    # -- TTLs ----------------------------------------------------------------------------------

    async def _expire_forever(self) -> None:
        while True:
            self._wake.clear()
            try:
                wait = await self.expire_now()
            except Exception:
                log.exception("deleting expired checkpoints failed; trying again in a minute")
                wait = 60.0
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), wait)

    async def expire_now(self) -> float:
        """Delete every checkpoint whose TTL has passed; return how long until the next one."""
        now = time.time()
        async with self.projection.session() as session:
            due = await catalog.expired(session, now)
        for row in due:
            await self.delete(row, "expired")
        async with self.projection.session() as session:
            upcoming = await catalog.next_expiry(session)
        if upcoming is None:
            return _MAX_SLEEP_S
        return min(_MAX_SLEEP_S, max(0.0, upcoming - time.time()) + 0.05)

    # -- garbage collection --------------------------------------------------------------------

    async def _collect_forever(self) -> None:
        while True:
            try:
                await self.collect(self.gc_grace_s)
            except Exception:
                log.exception("garbage collection failed")
            await asyncio.sleep(self.gc_interval_s)

    async def collect(self, grace_s: float) -> list[dict[str, object]]:
        """Remove every artifact under ``runs/`` that no event records (a writer that crashed
        between writing its blob and recording it), once it is ``grace_s`` old. Logs each."""
        # List first, then read what is recorded: a blob recorded while we listed is then known.
        found_all = await self.blobs.artifacts(artifacts.RUNS, artifacts.KEY_DEPTH)
        await self.projection.catch_up()
        async with self.projection.session() as session:
            live = await catalog.referenced_keys(session)
        now = time.time()
        removed: list[dict[str, object]] = []
        for found in found_all:
            if found.key in live or now - found.modified < grace_s:
                continue
            if await self.blobs.delete(found.key):
                log.info(
                    "gc: removed orphaned artifact %s (%d bytes, %s, %.0f s old)",
                    found.key,
                    found.size_bytes,
                    "sealed" if found.sealed else "unsealed",
                    now - found.modified,
                )
                removed.append({"key": found.key, "size_bytes": found.size_bytes})
        log.info("gc: %d orphaned artifacts removed", len(removed))
        return removed
