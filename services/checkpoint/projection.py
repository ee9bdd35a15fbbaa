"""The SQL catalog kept current: follows the event log from the position the tables reflect and
folds each batch of events in one transaction that also moves the position.

Owns: starting from the stored position (a dropped or new database replays the whole log), the
batching, read-your-writes (``wait_for``, ``catch_up``), and telling its owner which blobs an
event stopped referencing and which events it folded. Does not own: what an event means to a
table (tinsmith/catalog.py).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

from sqlalchemy.exc import InterfaceError, OperationalError
from sqlalchemy.ext.asyncio import AsyncEngine, AsyncSession, async_sessionmaker

from tinsmith import catalog, events, subjects
from tinsmith.eventlog import EventLog

log = logging.getLogger(__name__)

_BATCH = 512
_TRANSIENT = (OperationalError, InterfaceError, OSError, TimeoutError)
Folded = Callable[[list[str], set[str]], Awaitable[None]]


class SqlProjection:
    def __init__(self, eventlog: EventLog, engine: AsyncEngine) -> None:
        self.eventlog = eventlog
        self.engine = engine
        self.sessions: async_sessionmaker[AsyncSession] | None = None
        self.position = 0
        # Events up to here were in the log when this process started: a blob they released is
        # left to garbage collection, never removed during a replay (the key may be live again).
        self.replayed_until = 0
        # Bounded: while folding lags (a long replay), delivery waits, and JetStream's flow
        # control holds the rest of the log back instead of this process's memory.
        self._queue: asyncio.Queue[tuple[int, bytes]] = asyncio.Queue(maxsize=4 * _BATCH)
        self._changed = asyncio.Condition()
        self._listeners: list[Folded] = []

    def on_folded(self, listener: Folded) -> None:
        """Call ``listener(released blob keys, event kinds)`` after each committed batch, before
        ``wait_for`` sees it; a listener must not wait on the projection itself."""
        self._listeners.append(listener)

    def session(self) -> AsyncSession:
        assert self.sessions is not None, "start() first"
        return self.sessions()

    async def start(self) -> None:
        """Open the catalog, replay the log from where the tables are, then keep following."""
        bus_ = self.eventlog.bus
        self.sessions = await catalog.open_catalog(self.engine)
        last = await bus_.last_seq(subjects.EVENTS_STREAM)
        async with self.sessions.begin() as session:
            stored = (await catalog.position(session)).position
        if stored > last:  # the tables reflect another log (its stream was reset): rebuild
            log.warning("the catalog is at %d, the log ends at %d: rebuilding", stored, last)
            await catalog.drop(self.engine)
            self.sessions = await catalog.open_catalog(self.engine)
            stored = 0
        self.position = stored
        self.replayed_until = last
        bus_.spawn(self._fold_forever())
        await bus_.follow(
            subjects.EVENTS_STREAM, subjects.EVENTS_ALL, self._on_event, start_seq=stored + 1
        )
        await self.wait_for(last)
        log.info("catalog at log position %d (replayed from %d)", last, stored)

    async def _on_event(self, seq: int, data: bytes) -> None:
        await self._queue.put((seq, data))

    async def _fold_forever(self) -> None:
        while True:
            batch = [await self._queue.get()]
            while len(batch) < _BATCH:
                if self._queue.empty():
                    # Let the reader hand over what it holds already (a replay has a window of
                    # events in hand): one transaction then folds them all, where a live event
                    # that comes alone is folded at once.
                    await asyncio.sleep(0)
                    if self._queue.empty():
                        break
                batch.append(self._queue.get_nowait())
            released, kinds = await self._fold_batch(batch)
            # Listeners first (they must not wait on this projection): a reader that waited for
            # this position then also sees their effects, e.g. a replaced blob removed.
            for listener in self._listeners:
                try:
                    await listener(released, kinds)
                except Exception:
                    log.exception("a catalog listener failed")
            async with self._changed:
                self.position = max(self.position, batch[-1][0])
                self._changed.notify_all()

    async def _fold_batch(self, batch: list[tuple[int, bytes]]) -> tuple[list[str], set[str]]:
        """Fold a batch in one transaction. While the database is unreachable, retry; an event
        that cannot be folded (a bug, or an event from a newer version) is logged and skipped, so
        it never stops the catalog."""
        while True:
            try:
                return await self._fold(batch, skip=set())
            except _TRANSIENT:
                log.exception("the catalog database failed; retrying in 1 s")
                await asyncio.sleep(1.0)
            except Exception:
                break
        released: list[str] = []
        kinds: set[str] = set()
        for one in batch:
            while True:
                try:
                    gone, done = await self._fold([one], skip=set())
                except _TRANSIENT:
                    log.exception("the catalog database failed; retrying in 1 s")
                    await asyncio.sleep(1.0)
                    continue
                except Exception:
                    log.exception("event %d could not be folded into the catalog; skipped", one[0])
                    gone, done = await self._fold([one], skip={one[0]})
                released.extend(gone)
                kinds |= done
                break
        return released, kinds

    async def _fold(
        self, batch: list[tuple[int, bytes]], skip: set[int]
    ) -> tuple[list[str], set[str]]:
        released: list[str] = []
        kinds: set[str] = set()
        async with self.session() as session, session.begin():
            row = await catalog.position(session, for_update=True)
            # Events folded already (by another replica sharing the database) are left out.
            todo = [
                (seq, events.decode(data))
                for seq, data in batch
                if seq > row.position and seq not in skip
            ]
            await catalog.prefetch(session, [event for _, event in todo])
            for seq, event in todo:
                gone = await catalog.apply(session, seq, event)
                kinds.add(events.kind_of(event))
                if seq > self.replayed_until:
                    released.extend(gone)
            row.position = max(row.position, batch[-1][0])
        return released, kinds

    async def wait_for(self, position: int, timeout: float | None = None) -> bool:
        """Wait until the tables reflect the log up to ``position``; False on timeout."""
        async with self._changed:
            try:
                await asyncio.wait_for(
                    self._changed.wait_for(lambda: self.position >= position), timeout
                )
            except TimeoutError:
                return False
        return True

    async def catch_up(self) -> None:
        """Wait until every event appended so far, by any process, is in the tables."""
        await self.wait_for(await self.eventlog.bus.last_seq(subjects.EVENTS_STREAM))
