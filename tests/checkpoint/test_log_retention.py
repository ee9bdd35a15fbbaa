"""The catalog's snapshots and the event log's retention, on a real nats-server and SQLite: a new
database is filled from the newest catalog snapshot; after every kind has a snapshot, the
checkpoint service purges the log below them, keeping what a run's rebuild or a pending request
needs; every kind then starts again from its snapshot, with the same state as before."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from pathlib import Path
from typing import Any

import pytest
from nats.js.errors import NotFoundError

from bench.log_scale import History
from services.checkpoint.config import CheckpointConfig
from services.checkpoint.projection import SqlProjection
from services.checkpoint.retention import Retention
from tinsmith import catalog, events, jobs, snapshots, subjects
from tinsmith._proto import bus_pb2 as bus
from tinsmith.eventlog import EventLog, FollowedProjection, LogTruncated

NEVER = snapshots.Policy(every_events=10**9, every_s=10**6)  # written when the test says


async def _fill(eventlog: EventLog, log: list[bus.Event]) -> None:
    for start in range(0, len(log), 300):
        await asyncio.gather(*(eventlog.append(e) for e in log[start : start + 300]))


async def _fresh(eventlog: EventLog) -> None:
    with contextlib.suppress(NotFoundError):
        await eventlog.bus.js.delete_stream(f"OBJ_{subjects.SNAPSHOTS_BUCKET}")


async def _catalog(eventlog: EventLog, path: Path) -> SqlProjection:
    projection = SqlProjection(eventlog, catalog.create_engine(f"sqlite+aiosqlite:///{path}"))
    projection.keep_snapshots(NEVER)
    await projection.start()
    return projection


async def _dump(projection: SqlProjection) -> dict[str, list[dict[str, Any]]]:
    await projection.catch_up()
    async with projection.session() as session:
        return await catalog.dump(session)


def _idle(log: list[bus.Event]) -> list[bus.Event]:
    """Every run of ``log`` unloaded at the end, its snapshot covering all its requests (as the
    trainer leaves a run whose session fell silent)."""
    folded = jobs.Projection()
    for seq, event in enumerate(log, start=1):
        folded.apply(seq, event)
    return [
        events.make(
            run_unloaded=bus.RunUnloaded(
                model_id=run.model_id,
                snapshot_key=f"runs/{run.model_id}/snapshots/{run.next_seq_id:08d}",
                next_seq_id=run.next_seq_id,
            )
        )
        for run in folded.runs.values()
    ]


async def _whole_from(eventlog: EventLog, checkpoint: SqlProjection, keys: int) -> int:
    """Where the log is whole from; below it, only the ``keys`` key events stay."""
    purged = await checkpoint.snapshots.purged()
    seq, below = 1, []
    while True:
        with contextlib.suppress(NotFoundError):
            found = await eventlog.bus.js.get_msg(
                subjects.EVENTS_STREAM, seq, subject=subjects.EVENTS_ALL, next=True
            )
            if found.seq is not None and found.seq < purged:
                below.append(found.subject or "")
                seq = found.seq + 1
                continue
        break
    key = subjects.events_of("key").rstrip(">")
    assert all(subject.startswith(key) for subject in below), below
    assert len(below) == keys
    return max(purged, 1)


async def test_a_new_database_is_filled_from_the_newest_catalog_snapshot(
    eventlog: EventLog, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    await _fresh(eventlog)
    log = list(History(600, seed=11))
    await _fill(eventlog, log[:900])
    first = await _catalog(eventlog, tmp_path / "first.db")
    assert await first.write_snapshot()
    await _fill(eventlog, log[900:])
    with caplog.at_level(logging.INFO, logger="services.checkpoint.projection"):
        second = await _catalog(eventlog, tmp_path / "second.db")
    assert "catalog from its snapshot at log position 900" in caplog.text
    assert await _dump(second) == await _dump(first)
    await first.engine.dispose()
    await second.engine.dispose()


async def test_the_log_is_purged_below_every_snapshot_and_each_kind_starts_again(
    eventlog: EventLog, tmp_path: Path
) -> None:
    await _fresh(eventlog)
    log = list(History(800, seed=12))
    log += _idle(log)
    await _fill(eventlog, log)
    gateway, trainer = FollowedProjection(eventlog), FollowedProjection(eventlog)
    gateway.keep_snapshots("gateway", NEVER)
    trainer.keep_snapshots("trainer", NEVER)
    await gateway.start()
    await trainer.start()
    checkpoint = await _catalog(eventlog, tmp_path / "catalog.db")
    retention = Retention(eventlog.bus, checkpoint.snapshots, purge=True)
    checkpoint.on_snapshot(retention.after_snapshot)
    assert await retention.apply() is None  # no projection snapshot yet: nothing purged

    assert await gateway.write_snapshot()
    assert await checkpoint.write_snapshot()  # the trainer has none yet: the log stays whole
    assert await _whole_from(eventlog, checkpoint, keys=0) == 1

    # A request appended now is pending: it holds the log even once every snapshot is past it.
    sample = bus.RequestAccepted(
        request_id="late:sample:1:0", aggregate_id="late:sample:1", seq_id=0, sample=bus.Sample()
    )
    pending_at, _ = await eventlog.append(events.make(request_accepted=sample))
    await _fill(eventlog, list(History(50, seed=13)))
    for projection in (gateway, trainer):
        await projection.catch_up()
        assert await projection.write_snapshot()
    await checkpoint.catch_up()
    assert await checkpoint.write_snapshot()
    assert await _whole_from(eventlog, checkpoint, keys=4) == pending_at  # the first log's

    done = bus.RequestCompleted(
        request_id="late:sample:1:0", aggregate_id="late:sample:1", result_seq=1
    )
    await eventlog.append(events.make(request_completed=done))
    await _fill(eventlog, _idle(list(History(50, seed=13))))
    for projection in (gateway, trainer):
        await projection.catch_up()
        assert await projection.write_snapshot()
    await checkpoint.catch_up()
    assert await checkpoint.write_snapshot()
    positions = await checkpoint.snapshots.positions()
    whole_from = await _whole_from(eventlog, checkpoint, keys=8)  # and the second's
    assert whole_from == min(positions.values()) + 1 > pending_at

    # Each kind starts again from its snapshot, the log before it gone.
    again = FollowedProjection(eventlog)
    await again.start()
    assert again.started_from >= whole_from - 1
    assert again.state == gateway.state
    fresh = await _catalog(eventlog, tmp_path / "fresh.db")
    assert await _dump(fresh) == await _dump(checkpoint)
    await checkpoint.engine.dispose()
    await fresh.engine.dispose()

    # Without the snapshots, nothing starts below the purge, though the log's first message
    # (a key event) is at 1: the purge was marked.
    for kind in snapshots.KINDS:
        meta = checkpoint.snapshots._meta_subject(kind)
        await eventlog.bus.js.purge_stream(checkpoint.snapshots.stream, subject=meta)
    info = await eventlog.bus.js.stream_info(subjects.EVENTS_STREAM)
    assert info.state.first_seq == 1
    with pytest.raises(LogTruncated, match=f"starts at position {whole_from}"):
        await FollowedProjection(eventlog).start()
    with pytest.raises(LogTruncated, match=f"starts at {whole_from}"):
        await _catalog(eventlog, tmp_path / "late.db")


async def test_a_database_the_purged_log_no_longer_reaches_is_refused(
    eventlog: EventLog, tmp_path: Path
) -> None:
    await _fresh(eventlog)
    await _fill(eventlog, list(History(30, seed=14)))
    await eventlog.bus.js.purge_stream(subjects.EVENTS_STREAM, seq=10)
    with pytest.raises(LogTruncated, match="starts at 10"):
        await _catalog(eventlog, tmp_path / "late.db")


def test_the_log_is_kept_unless_told_to_purge(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TINSMITH_EVENTS_RETENTION", raising=False)
    assert CheckpointConfig.from_env().events_retention == "keep"
    monkeypatch.setenv("TINSMITH_EVENTS_RETENTION", "snapshots")
    assert CheckpointConfig.from_env().events_retention == "snapshots"
    monkeypatch.setenv("TINSMITH_EVENTS_RETENTION", "forever")
    with pytest.raises(SystemExit, match="TINSMITH_EVENTS_RETENTION='forever'"):
        CheckpointConfig.from_env()
