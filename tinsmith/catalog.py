"""The catalog: SQL read models of sessions, training runs, checkpoints, samplers and the blobs
they reference, folded from the event log, plus the log position they reflect.

Owns: the tables (SQLAlchemy 2 models), opening a database by URL (``sqlite+aiosqlite://`` or
``postgresql+asyncpg://``), folding one event into the tables (``apply``), and the queries the
REST API needs. Does not own: following the log (services/checkpoint) or deciding anything: every
row is a pure consequence of the events, so the tables can be dropped and rebuilt at any time.

Tenancy in the queries: every session, run and checkpoint row carries its tenant (``owner``, the
session's ``SessionCreated.owner``). No row belongs to everyone: a query for the empty owner (a
caller that is no tenant) matches nothing, and rows whose owner is empty (folded from logs older
than tenants) match no tenant; only the every-tenant usage (``storage_usage`` with no owner, for
admins) still counts them. A published checkpoint is readable by every tenant, but only when its
run has a tenant: publishing a row that was everyone's proved nothing about who meant it.
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Any, ClassVar, TypeVar

from sqlalchemy import (
    JSON,
    BigInteger,
    ColumnElement,
    Float,
    String,
    and_,
    false,
    func,
    insert,
    or_,
    select,
)
from sqlalchemy.engine import make_url
from sqlalchemy.ext.asyncio import AsyncEngine, AsyncSession, async_sessionmaker
from sqlalchemy.ext.asyncio import create_async_engine as _create_engine
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column
from sqlalchemy.pool import StaticPool

from tinsmith import artifacts, events
from tinsmith._proto import bus_pb2 as bus

log = logging.getLogger(__name__)
_Row = TypeVar("_Row", bound="Base")

# Bump when the tables change: a catalog of another schema is dropped and rebuilt from the log.
SCHEMA = 1
# Snapshots of a run kept in the store: the newest, and the one before it.
SNAPSHOTS_KEPT = 2
_LOG = "events"


class Base(DeclarativeBase):
    type_annotation_map: ClassVar[dict[Any, Any]] = {
        dict[str, str]: JSON,
        list[str]: JSON,
        int: BigInteger,
        float: Float(precision=53),
    }


class Position(Base):
    """The log position the tables reflect, and the schema they were built with."""

    __tablename__ = "catalog_position"
    name: Mapped[str] = mapped_column(String(32), primary_key=True)
    position: Mapped[int]
    schema: Mapped[int]


class SessionRow(Base):
    __tablename__ = "sessions"
    session_id: Mapped[str] = mapped_column(String(200), primary_key=True)
    seq: Mapped[int] = mapped_column(index=True)
    created_at: Mapped[float]
    owner: Mapped[str] = mapped_column(String(64), index=True)
    project_id: Mapped[str] = mapped_column(String(200))
    display_name: Mapped[str] = mapped_column(String(500))
    sdk_version: Mapped[str] = mapped_column(String(50))
    tags: Mapped[list[str]]
    user_metadata: Mapped[dict[str, str]]
    finished: Mapped[bool] = mapped_column(default=False)
    finish_reason: Mapped[str] = mapped_column(String(50), default="")


class RunRow(Base):
    __tablename__ = "training_runs"
    model_id: Mapped[str] = mapped_column(String(200), primary_key=True)
    seq: Mapped[int] = mapped_column(index=True)
    session_id: Mapped[str] = mapped_column(String(200), index=True)
    owner: Mapped[str] = mapped_column(String(64), index=True)
    project_id: Mapped[str] = mapped_column(String(200))
    base_model: Mapped[str] = mapped_column(String(500))
    lora_rank: Mapped[int]
    train_mlp: Mapped[bool]
    train_attn: Mapped[bool]
    train_unembed: Mapped[bool]
    user_metadata: Mapped[dict[str, str]]
    created_at: Mapped[float]
    last_request_time: Mapped[float]
    ready: Mapped[bool] = mapped_column(default=False)
    tokenizer_id: Mapped[str] = mapped_column(String(1000), default="")
    loaded_from: Mapped[str] = mapped_column(String(600), default="")


class CheckpointRow(Base):
    __tablename__ = "checkpoints"
    tinker_path: Mapped[str] = mapped_column(String(600), primary_key=True)
    model_id: Mapped[str] = mapped_column(String(200), index=True)
    checkpoint_type: Mapped[str] = mapped_column(String(20))  # training | sampler | external
    checkpoint_id: Mapped[str] = mapped_column(String(200))  # <segment>/<name>
    blob_key: Mapped[str] = mapped_column(String(600))
    seq: Mapped[int] = mapped_column(index=True)
    created_at: Mapped[float]
    size_bytes: Mapped[int]
    base_model: Mapped[str] = mapped_column(String(500))
    lora_rank: Mapped[int]
    train_mlp: Mapped[bool]
    train_attn: Mapped[bool]
    train_unembed: Mapped[bool]
    user_metadata: Mapped[dict[str, str]]
    ttl_seconds: Mapped[int | None]
    expires_at: Mapped[float | None] = mapped_column(index=True)
    public: Mapped[bool] = mapped_column(default=False)
    owner: Mapped[str] = mapped_column(String(64), index=True)
    project_id: Mapped[str] = mapped_column(String(200))


class SamplerRow(Base):
    __tablename__ = "samplers"
    sampler_id: Mapped[str] = mapped_column(String(200), primary_key=True)
    seq: Mapped[int] = mapped_column(index=True)
    session_id: Mapped[str] = mapped_column(String(200), index=True)
    base_model: Mapped[str] = mapped_column(String(500))
    model_path: Mapped[str] = mapped_column(String(600))
    adapter_key: Mapped[str] = mapped_column(String(600))
    created_at: Mapped[float]


class BlobRow(Base):
    """Every artifact in the object store that the log says is live: checkpoints, the snapshots
    of unloaded runs, and the unnamed adapters behind samplers. Anything else under ``runs/`` is
    an orphan (garbage collection)."""

    __tablename__ = "blobs"
    key: Mapped[str] = mapped_column(String(600), primary_key=True)
    model_id: Mapped[str] = mapped_column(String(200), index=True)
    role: Mapped[str] = mapped_column(String(20))  # checkpoint | snapshot | ephemeral
    size_bytes: Mapped[int]
    seq: Mapped[int]


TABLES: tuple[type[Base], ...] = (Position, SessionRow, RunRow, CheckpointRow, SamplerRow, BlobRow)


# -- opening -----------------------------------------------------------------------------------


def create_engine(url: str) -> AsyncEngine:
    """An async engine for a catalog URL; a SQLite file's directory is created when missing, and
    an in-memory SQLite database lives as long as the engine."""
    parsed = make_url(url)
    if parsed.get_backend_name() == "sqlite":
        if not parsed.database or parsed.database == ":memory:":  # one connection, one database
            return _create_engine(url, poolclass=StaticPool)
        Path(parsed.database).parent.mkdir(parents=True, exist_ok=True)
        return _create_engine(url, connect_args={"timeout": 30})
    return _create_engine(url, pool_pre_ping=True)


async def open_catalog(engine: AsyncEngine) -> async_sessionmaker[AsyncSession]:
    """Create the tables when missing; drop and recreate them when they were built with another
    schema (they are read models: the log rebuilds them)."""
    async with engine.begin() as conn:
        await conn.run_sync(Base.metadata.create_all)
    makers = async_sessionmaker(engine, expire_on_commit=False)
    async with makers.begin() as session:
        row = await session.get(Position, _LOG)
        stale = row is not None and row.schema != SCHEMA
    if stale:
        log.warning("the catalog was built with another schema; rebuilding it from the log")
        await drop(engine)
        async with engine.begin() as conn:
            await conn.run_sync(Base.metadata.create_all)
    async with makers.begin() as session:
        if await session.get(Position, _LOG) is None:
            session.add(Position(name=_LOG, position=0, schema=SCHEMA))
    return makers


async def drop(engine: AsyncEngine) -> None:
    async with engine.begin() as conn:
        await conn.run_sync(Base.metadata.drop_all)


async def position(session: AsyncSession, *, for_update: bool = False) -> Position:
    """The position row; ``for_update`` locks it (PostgreSQL), so two writers never fold the same
    events."""
    stmt = select(Position).where(Position.name == _LOG)
    if for_update:
        stmt = stmt.with_for_update()
    row = (await session.execute(stmt)).scalar_one()
    return row


# -- folding -----------------------------------------------------------------------------------


# Rows a folding session has read, added or deleted, by table and primary key (None: no such
# row): ``apply`` reads each row once per transaction, and ``prefetch`` reads a whole batch's in a
# few queries. Before, every event read its rows one SELECT at a time, each after a flush of what
# the events before it added: 23 s to fold 43,000 events into SQLite.
_ROWS = "tinsmith.rows"
_PREFETCH_CHUNK = 500  # keys per IN (...) query: well under SQLite's bound on parameters


def _rows(session: AsyncSession) -> dict[tuple[type[Base], str], Base | None]:
    rows: dict[tuple[type[Base], str], Base | None] = session.info.setdefault(_ROWS, {})
    return rows


async def _get(session: AsyncSession, table: type[_Row], key: str) -> _Row | None:
    rows = _rows(session)
    if (table, key) in rows:
        return rows[(table, key)]  # type: ignore[return-value]
    row = await session.get(table, key)
    rows[(table, key)] = row
    return row


def _add(session: AsyncSession, row: Base) -> None:
    session.add(row)
    _rows(session)[(type(row), _key_of(row))] = row


async def _delete(session: AsyncSession, row: Base) -> None:
    await session.delete(row)
    _rows(session)[(type(row), _key_of(row))] = None


def _key_of(row: Base) -> str:
    return str(row.__mapper__.primary_key_from_instance(row)[0])


def _keys(event: bus.Event) -> list[tuple[type[Base], str]]:
    """The rows folding ``event`` reads (``apply``)."""
    kind = events.kind_of(event)
    body = getattr(event, kind)
    if kind in ("session_created", "session_finished"):
        return [(SessionRow, body.session_id)]
    if kind == "request_accepted":
        if body.WhichOneof("command") == "sample":
            return []
        keys: list[tuple[type[Base], str]] = [(RunRow, body.aggregate_id)]
        if body.HasField("create_model"):
            keys.append((SessionRow, body.create_model.session_id))
        return keys
    if kind == "run_created":
        return [(RunRow, body.model_id)]
    if kind == "weights_saved":
        return [
            (RunRow, body.model_id),
            (CheckpointRow, body.tinker_path),
            (BlobRow, body.blob_key),
        ]
    if kind in ("run_unloaded", "run_snapshotted"):
        return [(BlobRow, body.snapshot_key)]
    if kind == "sampler_created":
        return [(SamplerRow, body.sampler_id), (BlobRow, body.adapter_key)]
    if kind == "checkpoint_deleted":
        return [(CheckpointRow, body.tinker_path), (BlobRow, body.blob_key)]
    if kind in ("checkpoint_published", "checkpoint_ttl_set"):
        return [(CheckpointRow, body.tinker_path)]
    return []


async def prefetch(session: AsyncSession, batch: Sequence[bus.Event]) -> None:
    """Read every row that folding ``batch`` reads, a few queries per table, so that ``apply``
    then reads none one at a time."""
    wanted: dict[type[Base], set[str]] = {}
    for event in batch:
        for table, key in _keys(event):
            wanted.setdefault(table, set()).add(key)
    rows = _rows(session)
    for table, keys in wanted.items():
        column = table.__mapper__.primary_key[0]
        missing = sorted(key for key in keys if (table, key) not in rows)
        for start in range(0, len(missing), _PREFETCH_CHUNK):
            chunk = missing[start : start + _PREFETCH_CHUNK]
            for row in await session.scalars(select(table).where(column.in_(chunk))):
                rows[(table, _key_of(row))] = row
            for key in chunk:
                rows.setdefault((table, key), None)


async def apply(session: AsyncSession, seq: int, event: bus.Event) -> list[str]:
    """Fold one event into the tables. Returns the blob keys it stopped referencing (a checkpoint
    overwritten under a new key), which the caller may remove from the store."""
    kind = events.kind_of(event)
    body = getattr(event, kind)
    if kind == "session_created":
        if await _get(session, SessionRow, body.session_id) is None:
            _add(
                session,
                SessionRow(
                    session_id=body.session_id,
                    seq=seq,
                    created_at=event.time,
                    owner=body.owner,
                    project_id=body.project_id,
                    display_name=body.display_name,
                    sdk_version=body.sdk_version,
                    tags=list(body.tags),
                    user_metadata=dict(body.user_metadata),
                ),
            )
    elif kind == "session_finished":
        finished = await _get(session, SessionRow, body.session_id)
        if finished is not None:
            finished.finished, finished.finish_reason = True, body.reason
    elif kind == "request_accepted":
        await _accepted(session, seq, event)
    elif kind == "run_created":
        run = await _get(session, RunRow, body.model_id)
        if run is not None:
            run.ready, run.tokenizer_id = True, body.tokenizer_id
    elif kind == "weights_saved":
        return await _saved(session, seq, event)
    elif kind in ("run_unloaded", "run_snapshotted"):
        await _reference(session, body.snapshot_key, body.model_id, "snapshot", 0, seq)
        return await _superseded_snapshots(session, body.model_id)
    elif kind == "sampler_created":
        await _sampler(session, seq, event)
    elif kind == "checkpoint_deleted":
        row = await _get(session, CheckpointRow, body.tinker_path)
        if row is not None and row.blob_key == body.blob_key:
            await _delete(session, row)
            blob = await _get(session, BlobRow, body.blob_key)
            if blob is not None:
                await _delete(session, blob)
    elif kind == "checkpoint_published":
        row = await _get(session, CheckpointRow, body.tinker_path)
        if row is not None:
            row.public = body.public
    elif kind == "checkpoint_ttl_set":
        row = await _get(session, CheckpointRow, body.tinker_path)
        if row is not None:
            row.ttl_seconds = body.ttl_seconds if body.HasField("ttl_seconds") else None
            row.expires_at = body.expires_at if body.HasField("expires_at") else None
    return []


async def _accepted(session: AsyncSession, seq: int, event: bus.Event) -> None:
    accepted = event.request_accepted
    if accepted.WhichOneof("command") == "sample":
        return
    run = await _get(session, RunRow, accepted.aggregate_id)
    if run is not None:
        run.last_request_time = max(run.last_request_time, event.time)
        return
    if not accepted.HasField("create_model"):
        return
    create = accepted.create_model
    owner = await _get(session, SessionRow, create.session_id)
    _add(
        session,
        RunRow(
            model_id=accepted.aggregate_id,
            seq=seq,
            session_id=create.session_id,
            owner=owner.owner if owner else "",
            project_id=owner.project_id if owner else "",
            base_model=create.base_model,
            lora_rank=create.lora.rank,
            train_mlp=create.lora.train_mlp,
            train_attn=create.lora.train_attn,
            train_unembed=create.lora.train_unembed,
            user_metadata=dict(create.user_metadata),
            created_at=event.time,
            last_request_time=event.time,
            loaded_from=create.load_path,
        ),
    )


async def _saved(session: AsyncSession, seq: int, event: bus.Event) -> list[str]:
    saved = event.weights_saved
    path = artifacts.parse(saved.tinker_path)
    run = await _get(session, RunRow, saved.model_id)
    ttl = saved.ttl_seconds if saved.HasField("ttl_seconds") else None
    released = []
    row = await _get(session, CheckpointRow, saved.tinker_path)
    if row is not None:  # overwritten: the new save replaces the row, and its old blob goes
        if row.blob_key != saved.blob_key:
            released.append(row.blob_key)
            old = await _get(session, BlobRow, row.blob_key)
            if old is not None:
                await _delete(session, old)
        await _delete(session, row)
        await session.flush()
    _add(
        session,
        CheckpointRow(
            tinker_path=saved.tinker_path,
            model_id=saved.model_id,
            checkpoint_type=artifacts.CHECKPOINT_TYPES[path.kind],
            checkpoint_id=path.checkpoint_id,
            blob_key=saved.blob_key,
            seq=seq,
            created_at=event.time,
            size_bytes=saved.size_bytes,
            base_model=saved.base_model,
            lora_rank=saved.lora_rank,
            train_mlp=saved.lora.train_mlp if saved.HasField("lora") else True,
            train_attn=saved.lora.train_attn if saved.HasField("lora") else True,
            train_unembed=saved.lora.train_unembed if saved.HasField("lora") else True,
            user_metadata=dict(saved.user_metadata),
            ttl_seconds=ttl,
            expires_at=event.time + ttl if ttl is not None else None,
            owner=run.owner if run else "",
            project_id=run.project_id if run else "",
        ),
    )
    await _reference(session, saved.blob_key, saved.model_id, "checkpoint", saved.size_bytes, seq)
    return released


async def _sampler(session: AsyncSession, seq: int, event: bus.Event) -> None:
    created = event.sampler_created
    if await _get(session, SamplerRow, created.sampler_id) is not None:
        return
    _add(
        session,
        SamplerRow(
            sampler_id=created.sampler_id,
            seq=seq,
            session_id=created.session_id,
            base_model=created.base_model,
            model_path=created.model_path,
            adapter_key=created.adapter_key,
            created_at=event.time,
        ),
    )
    model_id = artifacts.ephemeral_run(created.adapter_key)
    if model_id and not created.model_path:  # the unnamed snapshot behind it
        await _reference(session, created.adapter_key, model_id, "ephemeral", 0, seq)


async def _reference(
    session: AsyncSession, key: str, model_id: str, role: str, size_bytes: int, seq: int
) -> None:
    row = await _get(session, BlobRow, key)
    if row is None:
        _add(
            session, BlobRow(key=key, model_id=model_id, role=role, size_bytes=size_bytes, seq=seq)
        )
    else:
        row.size_bytes, row.seq = size_bytes, seq


async def _superseded_snapshots(session: AsyncSession, model_id: str) -> list[str]:
    """Forget the run's snapshots older than its newest ``SNAPSHOTS_KEPT``, and return their keys
    for removal from the store: a rebuild reads only the newest. The one before it stays, should
    the newest have been recorded by a holder that was cut off meanwhile."""
    rows = (
        await session.execute(
            select(BlobRow)
            .where(BlobRow.model_id == model_id, BlobRow.role == "snapshot")
            .order_by(BlobRow.seq.desc())
        )
    ).scalars()
    superseded = list(rows)[SNAPSHOTS_KEPT:]
    for row in superseded:
        await _delete(session, row)
    return [row.key for row in superseded]


# -- queries -----------------------------------------------------------------------------------


def visible_to(owner: str, column: Any) -> ColumnElement[bool]:
    """Rows owned by the tenant ``owner``. The empty owner is no tenant and owns nothing, so rows
    with an empty owner (from before tenants) are nobody's."""
    if not owner:
        return false()
    owned: ColumnElement[bool] = column == owner
    return owned


def _published() -> ColumnElement[bool]:
    """Checkpoints every tenant may read: published, by a run that has a tenant."""
    return and_(CheckpointRow.public.is_(True), CheckpointRow.owner != "")


async def runs(
    session: AsyncSession,
    *,
    owner: str,
    accessible: bool,
    project_id: str,
    limit: int,
    offset: int,
) -> tuple[Sequence[RunRow], int]:
    """Training runs, newest first, and how many there are in all: the tenant's own and, when
    ``accessible``, other tenants' runs with a published checkpoint. A project filter is the
    tenant's own: another tenant's projects are private, so it matches the tenant's runs alone."""
    condition = visible_to(owner, RunRow.owner)
    if project_id:
        condition = and_(condition, RunRow.project_id == project_id)
    elif accessible and owner:
        published = select(CheckpointRow.model_id).where(_published())
        condition = or_(condition, RunRow.model_id.in_(published))
    total = await session.scalar(select(func.count()).select_from(RunRow).where(condition))
    rows = await session.scalars(
        select(RunRow).where(condition).order_by(RunRow.seq.desc()).limit(limit).offset(offset)
    )
    return rows.all(), int(total or 0)


async def has_public_checkpoint(session: AsyncSession, model_id: str) -> bool:
    """Whether the run has a checkpoint every tenant may read."""
    found = await session.scalar(
        select(func.count())
        .select_from(CheckpointRow)
        .where(CheckpointRow.model_id == model_id, _published())
    )
    return bool(found)


async def checkpoints_of(
    session: AsyncSession, model_id: str, *, published_only: bool = False
) -> Sequence[CheckpointRow]:
    """A run's checkpoints (only those every tenant may read, with ``published_only``), newest
    first."""
    condition = CheckpointRow.model_id == model_id
    if published_only:
        condition = and_(condition, _published())
    rows = await session.scalars(
        select(CheckpointRow).where(condition).order_by(CheckpointRow.seq.desc())
    )
    return rows.all()


async def latest_checkpoint(
    session: AsyncSession,
    model_id: str,
    checkpoint_type: str | None,
    *,
    published_only: bool = False,
) -> CheckpointRow | None:
    """A run's newest checkpoint of a type (of any type for None); with ``published_only``, the
    newest that every tenant may read."""
    condition = CheckpointRow.model_id == model_id
    if checkpoint_type is not None:
        condition = and_(condition, CheckpointRow.checkpoint_type == checkpoint_type)
    if published_only:
        condition = and_(condition, _published())
    row = await session.scalar(
        select(CheckpointRow).where(condition).order_by(CheckpointRow.seq.desc()).limit(1)
    )
    return row


async def user_checkpoints(
    session: AsyncSession, *, owner: str, limit: int, offset: int
) -> tuple[Sequence[CheckpointRow], int]:
    """Every checkpoint of the user's runs, newest first, and how many there are in all."""
    condition = visible_to(owner, CheckpointRow.owner)
    total = await session.scalar(select(func.count()).select_from(CheckpointRow).where(condition))
    rows = await session.scalars(
        select(CheckpointRow)
        .where(condition)
        .order_by(CheckpointRow.seq.desc())
        .limit(limit)
        .offset(offset)
    )
    return rows.all(), int(total or 0)


async def sessions(
    session: AsyncSession, *, owner: str, limit: int, offset: int
) -> Sequence[SessionRow]:
    """The user's sessions, newest first."""
    rows = await session.scalars(
        select(SessionRow)
        .where(visible_to(owner, SessionRow.owner))
        .order_by(SessionRow.seq.desc())
        .limit(limit)
        .offset(offset)
    )
    return rows.all()


async def session_members(session: AsyncSession, session_id: str) -> tuple[list[str], list[str]]:
    """The ids of a session's training runs and samplers, in the order they were made."""
    run_ids = await session.scalars(
        select(RunRow.model_id).where(RunRow.session_id == session_id).order_by(RunRow.seq)
    )
    sampler_ids = await session.scalars(
        select(SamplerRow.sampler_id)
        .where(SamplerRow.session_id == session_id)
        .order_by(SamplerRow.seq)
    )
    return list(run_ids.all()), list(sampler_ids.all())


async def expired(session: AsyncSession, now: float) -> Sequence[CheckpointRow]:
    rows = await session.scalars(
        select(CheckpointRow)
        .where(CheckpointRow.expires_at.is_not(None), CheckpointRow.expires_at <= now)
        .order_by(CheckpointRow.expires_at)
    )
    return rows.all()


async def next_expiry(session: AsyncSession) -> float | None:
    value = await session.scalar(select(func.min(CheckpointRow.expires_at)))
    return float(value) if value is not None else None


async def storage_usage(
    session: AsyncSession, project_id: str, *, owner: str | None
) -> list[tuple[str, str, int, int]]:
    """``(owner, project_id, checkpoint count, bytes)`` of the live checkpoints, per owner and
    project: the tenant ``owner``'s alone, or every tenant's (rows of no tenant included) for
    None."""
    stmt = select(
        CheckpointRow.owner,
        CheckpointRow.project_id,
        func.count(),
        func.coalesce(func.sum(CheckpointRow.size_bytes), 0),
    ).group_by(CheckpointRow.owner, CheckpointRow.project_id)
    if owner is not None:
        stmt = stmt.where(visible_to(owner, CheckpointRow.owner))
    if project_id:
        stmt = stmt.where(CheckpointRow.project_id == project_id)
    rows = await session.execute(stmt.order_by(CheckpointRow.owner, CheckpointRow.project_id))
    return [(str(o), str(p), int(n), int(b)) for o, p, n, b in rows.all()]


async def referenced_keys(session: AsyncSession) -> set[str]:
    return set((await session.scalars(select(BlobRow.key))).all())


async def dump(session: AsyncSession) -> dict[str, list[dict[str, Any]]]:
    """Every row of every table, in a stable order: two catalogs folded from the same log dump
    equal."""
    out: dict[str, list[dict[str, Any]]] = {}
    for table in TABLES:
        columns = [c.key for c in table.__table__.columns]
        rows = (await session.scalars(select(table))).all()
        out[table.__tablename__] = sorted(
            ({c: getattr(row, c) for c in columns} for row in rows),
            key=lambda r: repr(sorted(r.items())),
        )
    return out


# -- snapshots ---------------------------------------------------------------------------------
# The checkpoint service's snapshot of the catalog (tinsmith/snapshots.py): every row of every
# table at a log position, so that a new or dropped database is filled from it and folds only the
# log after it, once the log before it may have been purged.


def fingerprint() -> str:
    """What a catalog snapshot's rows fit: the schema version and every table's columns."""
    tables = [
        f"{table.__tablename__}({','.join(f'{c.key}:{c.type}' for c in table.__table__.columns)})"
        for table in TABLES
        if table is not Position
    ]
    return hashlib.sha256(f"{SCHEMA};{';'.join(tables)}".encode()).hexdigest()[:32]


async def rows(session: AsyncSession) -> tuple[int, dict[str, list[list[Any]]]]:
    """The position and every row of every table, each row its columns' values in order (JSON:
    strings, numbers, booleans, None, and the JSON columns' lists and dicts). Read in one
    transaction that sees one state (``snapshot_options``)."""
    position_ = (await position(session)).position
    out: dict[str, list[list[Any]]] = {}
    for table in TABLES:
        if table is Position:
            continue
        columns = [c.key for c in table.__table__.columns]
        result = await session.execute(select(*(table.__table__.c[c] for c in columns)))
        out[table.__tablename__] = [list(row) for row in result.all()]
    return position_, out


def snapshot_options(engine: AsyncEngine) -> dict[str, Any]:
    """Execution options under which ``rows`` sees one state of the tables: PostgreSQL's default
    isolation lets each statement see other commits; SQLite's transactions see one already."""
    if engine.dialect.name == "postgresql":
        return {"isolation_level": "REPEATABLE READ"}
    return {}


async def restore(session: AsyncSession, at: int, tables: dict[str, list[list[Any]]]) -> bool:
    """Fill the empty tables with a snapshot's rows at log position ``at``, in the caller's
    transaction. False, changing nothing, when the tables are at a position already (another
    replica sharing the database folded or restored meanwhile)."""
    row = await position(session, for_update=True)
    if row.position != 0:
        return False
    for table in TABLES:
        found = tables.get(table.__tablename__)
        if table is Position or not found:
            continue
        columns = [c.key for c in table.__table__.columns]
        for start in range(0, len(found), 1000):
            chunk = found[start : start + 1000]
            await session.execute(
                insert(table), [dict(zip(columns, values, strict=True)) for values in chunk]
            )
    row.position = at
    return True
