"""The catalog's catch-up with a long log, on a real nats-server and SQLite: a replay folds many
events per transaction, reads the rows a batch touches a few queries at a time, and gives exactly
the tables that folding one event at a time gives."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

from sqlalchemy import event as sa_event

from bench.log_scale import History
from services.checkpoint.projection import SqlProjection
from tinsmith import catalog
from tinsmith._proto import bus_pb2 as bus
from tinsmith.eventlog import EventLog


async def _append_all(eventlog: EventLog, log: list[bus.Event]) -> None:
    for start in range(0, len(log), 400):
        await asyncio.gather(*(eventlog.append(event) for event in log[start : start + 400]))


async def _one_at_a_time(url: str, log: list[bus.Event]) -> dict[str, Any]:
    """The tables as ``catalog.apply`` folds the log, one event per transaction, no prefetch."""
    engine = catalog.create_engine(url)
    sessions = await catalog.open_catalog(engine)
    for seq, event in enumerate(log, start=1):
        async with sessions.begin() as session:
            await catalog.apply(session, seq, event)
            (await catalog.position(session)).position = seq
    async with sessions() as session:
        dump = await catalog.dump(session)
    await engine.dispose()
    return dump


async def test_a_replay_folds_many_events_per_statement_into_the_same_tables(
    eventlog: EventLog, tmp_path: Path
) -> None:
    """Before, each event read its rows with a SELECT of its own, after a flush of the rows the
    events before it added: 43,000 events took 23 s to fold into SQLite."""
    log = list(History(1500, seed=3))
    await _append_all(eventlog, log)
    engine = catalog.create_engine(f"sqlite+aiosqlite:///{tmp_path}/catalog.db")
    statements: list[str] = []
    sa_event.listen(
        engine.sync_engine,
        "before_cursor_execute",
        lambda conn, cursor, statement, *rest: statements.append(statement),
    )
    projection = SqlProjection(eventlog, engine)
    await projection.start()
    assert projection.position == len(log)
    assert len(statements) < len(log) / 10, (len(statements), len(log))
    async with projection.session() as session:
        replayed = await catalog.dump(session)
    await engine.dispose()
    assert replayed["checkpoints"] and replayed["samplers"] and replayed["blobs"]
    assert replayed == await _one_at_a_time(f"sqlite+aiosqlite:///{tmp_path}/one.db", log)
