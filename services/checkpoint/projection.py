"""The SQL catalog kept current: follows the event log from the position the tables reflect and
folds each batch of events in one transaction that also moves the position; and the catalog's
snapshots.

A live trickle of events is gathered for up to ``gather_s`` into one transaction, unless a reader
waits for the tables (``wait_for``, ``catch_up``): then what has arrived is folded at once. A
transaction per event made the catalog the costliest service per sample request, as each
request's acceptance and outcome came alone (bench/request_cost.py).

Owns: starting from the stored position (a new, dropped or stale database is filled from the
newest catalog snapshot, else replays the whole log), the batching, read-your-writes
(``wait_for``, ``catch_up``), telling its owner which blobs an event stopped referencing and
which events it folded, and writing the catalog's snapshot (every row at a log position, kind
``checkpoint`` in tinsmith/snapshots.py) as ``keep_snapshots``'s policy says. Does not own: what
an event means to a table (tinsmith/catalog.py), or the retention rule (retention.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any

from sqlalchemy.exc import InterfaceError, OperationalError
from sqlalchemy.ext.asyncio import AsyncEngine, AsyncSession, async_sessionmaker

from tinsmith import catalog, events, snapshots, subjects
from tinsmith.bus import ended
from tinsmith.eventlog import EventLog, LogTruncated

log = logging.getLogger(__name__)

_BATCH = 512
_TRANSIENT = (OperationalError, InterfaceError, OSError, TimeoutError)
Folded = Callable[[list[str], set[str]], Awaitable[None]]
Snapshotted = Callable[[int], Awaitable[None]]
KIND = "checkpoint"
_RETRY_S = 30.0  # after a snapshot failed to be written, the next try waits this long


class SqlProjection:
    def __init__(self, eventlog: EventLog, engine: AsyncEngine, *, gather_s: float = 0.0) -> None:
        """``gather_s``: how long a live event waits for others to share its transaction while
        no reader waits for the tables (0: each is folded as it arrives)."""
        self.eventlog = eventlog
        self.engine = engine
        self.gather_s = gather_s
        self.sessions: async_sessionmaker[AsyncSession] | None = None
        self.position = 0
        # Events up to here were in the log when this process started: a blob they released is
        # left to garbage collection, never removed during a replay (the key may be live again).
        self.replayed_until = 0
        # Bounded: while folding lags (a long replay), delivery waits, and the reader asks the
        # server for no more than its window (tinsmith/follower.py) instead of buffering the log.
        self._queue: asyncio.Queue[tuple[int, bytes]] = asyncio.Queue(maxsize=4 * _BATCH)
        self._changed = asyncio.Condition()
        self._readers = 0  # waiting in wait_for: the batch being gathered is folded at once
        self._awaited = asyncio.Event()
        self._listeners: list[Folded] = []
        self.snapshots = snapshots.Store(eventlog.bus)
        self.policy: snapshots.Policy | None = None  # keep_snapshots: write the catalog's
        self._snapshot_listeners: list[Snapshotted] = []
        self._log = ""  # the event log's identity (snapshots.log_identity)
        self._folding = asyncio.Lock()  # a snapshot reads the tables between two folds
        self._since = 0  # events folded since the last snapshot
        self._first_since = 0.0
        self._writing = False
        self._failed_at = -_RETRY_S  # when the last write failed: the next waits _RETRY_S
        self._started = False
        self._folder: asyncio.Future[None] | None = None

    def on_folded(self, listener: Folded) -> None:
        """Call ``listener(released blob keys, event kinds)`` after each committed batch, before
        ``wait_for`` sees it; a listener must not wait on the projection itself."""
        self._listeners.append(listener)

    def keep_snapshots(self, policy: snapshots.Policy) -> None:
        """Write the catalog's snapshot as ``policy`` says (a start then fills a new or dropped
        database from it); call before ``start``."""
        self.policy = policy

    def on_snapshot(self, listener: Snapshotted) -> None:
        """Call ``listener(log position)`` after each catalog snapshot is stored."""
        self._snapshot_listeners.append(listener)

    def session(self) -> AsyncSession:
        assert self.sessions is not None, "start() first"
        return self.sessions()

    async def start(self) -> None:
        """Open the catalog, replay the log from where the tables are, then keep following."""
        bus_ = self.eventlog.bus
        self.sessions = await catalog.open_catalog(self.engine)
        info = await bus_.js.stream_info(subjects.EVENTS_STREAM)
        # Where the log is whole from: the retention keeps the key events below it.
        first = max(int(info.state.first_seq), await self.snapshots.purged())
        last = int(info.state.last_seq)
        self._log = info.created.isoformat() if info.created is not None else ""
        async with self.sessions.begin() as session:
            stored = (await catalog.position(session)).position
        if stored > last:  # the tables reflect another log (its stream was reset): rebuild
            log.warning("the catalog is at %d, the log ends at %d: rebuilding", stored, last)
            await catalog.drop(self.engine)
            self.sessions = await catalog.open_catalog(self.engine)
            stored = 0
        if stored == 0 or stored + 1 < first:
            stored = await self._restore(stored, first)
        self.position = stored
        self._first_since = time.monotonic()
        self.replayed_until = last
        self._folder = bus_.spawn(self._fold_forever())
        await bus_.follow(
            subjects.EVENTS_STREAM, subjects.EVENTS_ALL, self._on_event, start_seq=stored + 1
        )
        await self.wait_for(last)
        log.info("catalog at log position %d (replayed from %d)", last, stored)
        self._started = True  # snapshots from here on, not in the middle of the replay
        self._maybe_write()

    async def stop(self, timeout_s: float) -> int:
        """End the folding, waiting up to ``timeout_s`` for a transaction it had begun, so that
        the database can be closed under nothing; returns 1 if it has not ended. (What the reader
        still hands over waits in the queue, unfolded, until the connection's close ends the
        reader: the next start reads it again.)"""
        folder, self._folder = self._folder, None
        return len(await ended([folder] if folder is not None else [], timeout_s))

    async def _restore(self, stored: int, first: int) -> int:
        """Fill the tables from the newest catalog snapshot when they are empty (faster than a
        replay) or behind the log's start (its events before were purged); return the position
        they are at then. A database behind the log that no snapshot brings to its start cannot
        be folded: ``LogTruncated``."""
        header = await self.snapshots.latest(KIND)
        usable = (
            header is not None
            and header.log == self._log
            and header.fingerprint == catalog.fingerprint()
            and header.position > stored
        )
        if header is not None and not usable:
            log.warning(
                "the catalog snapshot at %d is not used: %s",
                header.position,
                "of another event log"
                if header.log != self._log
                else "written for other tables (another schema)"
                if header.fingerprint != catalog.fingerprint()
                else "older than the tables",
            )
        if header is not None and usable:
            started = time.perf_counter()
            data = await self.snapshots.read(KIND)
            if data is not None:
                found, body = snapshots.unpack(data)
                tables = await asyncio.to_thread(json.loads, body)
                if stored:  # stale rows: the tables start over from the snapshot
                    await catalog.drop(self.engine)
                    self.sessions = await catalog.open_catalog(self.engine)
                assert self.sessions is not None
                async with self.sessions.begin() as session:
                    restored = await catalog.restore(session, found.position, tables)
                async with self.sessions.begin() as session:
                    stored = (await catalog.position(session)).position
                if restored:
                    log.info(
                        "catalog from its snapshot at log position %d (%.1f MB, %.2f s)",
                        found.position,
                        found.size / 1e6,
                        time.perf_counter() - started,
                    )
        if stored + 1 < first:
            raise LogTruncated(
                f"the catalog is at log position {stored} and the event log starts at {first}: "
                "the events between were dropped, and no catalog snapshot this version reads "
                "covers them (see the warnings above); start the version that wrote the "
                "snapshot, which reads it"
            )
        return stored

    async def _on_event(self, seq: int, data: bytes) -> None:
        await self._queue.put((seq, data))

    async def _fold_forever(self) -> None:
        while True:
            batch = [await self._queue.get()]
            if self.gather_s > 0 and not self._awaited.is_set() and self._queue.qsize() < _BATCH:
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._awaited.wait(), self.gather_s)
            while len(batch) < _BATCH:
                if self._queue.empty():
                    # Let the reader hand over what it holds already (a replay has a window of
                    # events in hand): one transaction then folds them all, where a live event
                    # that comes alone is folded at once.
                    await asyncio.sleep(0)
                    if self._queue.empty():
                        break
                batch.append(self._queue.get_nowait())
            async with self._folding:
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
            if self._since == 0:
                self._first_since = time.monotonic()
                if self.policy is not None:  # a trickle of events is written after every_s too
                    loop = asyncio.get_running_loop()
                    loop.call_later(self.policy.every_s, self._maybe_write)
            self._since += len(batch)
            if self.policy is not None and self._since >= self.policy.every_events:
                self._maybe_write()

    def _maybe_write(self) -> None:
        policy = self.policy
        if policy is None or self._writing or not self._started:
            return
        if time.monotonic() - self._failed_at < _RETRY_S:
            return
        if policy.due(self._since, self._first_since, time.monotonic()):
            self._writing = True
            self.eventlog.bus.spawn(self._write())

    async def _write(self) -> None:
        try:
            await self.write_snapshot()
        except Exception:
            if not self.eventlog.bus.closing:
                log.exception("writing the catalog snapshot failed; trying again later")
            self._writing = False
            self._failed_at = time.monotonic()
            return
        self._writing = False
        self._maybe_write()  # what was folded meanwhile may be due already

    async def write_snapshot(self) -> bool:
        """Store every row of the catalog at its log position (between two folds, in one
        transaction), then tell the listeners. False when a newer snapshot is there already."""
        started = time.perf_counter()
        async with self._folding, self.engine.connect() as connection:
            connection = await connection.execution_options(**catalog.snapshot_options(self.engine))
            async with AsyncSession(connection) as session, session.begin():
                at, tables = await catalog.rows(session)
            self._since = 0
        header = snapshots.Header(
            kind=KIND,
            position=at,
            fingerprint=catalog.fingerprint(),
            log=self._log,
            written_at=time.time(),
        )
        data = await asyncio.to_thread(_pack, header, tables)
        saved = await self.snapshots.save(header, data)
        log.info(
            "catalog snapshot at log position %d: %d rows, %.1f MB, %.2f s%s",
            at,
            sum(len(found) for found in tables.values()),
            len(data) / 1e6,
            time.perf_counter() - started,
            "" if saved else "; not stored, a newer one is there",
        )
        for listener in self._snapshot_listeners:
            try:
                await listener(at)
            except Exception:
                log.exception("a catalog snapshot listener failed")
        return saved

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
        """Wait until the tables reflect the log up to ``position``; False on timeout. While
        anyone waits, events are folded as they arrive, not gathered."""
        async with self._changed:
            if self.position >= position:
                return True
            self._readers += 1
            self._awaited.set()
            try:
                await asyncio.wait_for(
                    self._changed.wait_for(lambda: self.position >= position), timeout
                )
            except TimeoutError:
                return False
            finally:
                self._readers -= 1
                if not self._readers:
                    self._awaited.clear()
        return True

    async def catch_up(self) -> None:
        """Wait until every event appended so far, by any process, is in the tables."""
        await self.wait_for(await self.eventlog.bus.last_seq(subjects.EVENTS_STREAM))


def _pack(header: snapshots.Header, tables: dict[str, list[list[Any]]]) -> bytes:
    return snapshots.pack(header, json.dumps(tables, separators=(",", ":")).encode())
