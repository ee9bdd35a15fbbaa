"""The catalog: SQL read models of sessions, training runs, checkpoints, samplers, the blobs
they reference, requests, metrics and the audit log, folded from the event log, plus the log
position they reflect.

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
import math
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
SCHEMA = 3
# Snapshots of a run kept in the store: the newest, and the one before it.
SNAPSHOTS_KEPT = 2
_LOG = "events"


class Base(DeclarativeBase):
    type_annotation_map: ClassVar[dict[Any, Any]] = {
        dict[str, str]: JSON,
        list[str]: JSON,
        int: BigInteger,
        float: Float(precision=53),
        dict[str, float | None]: JSON,
        dict[str, Any]: JSON,
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
    # What the console lists and filters by: its session's tags (each between two separators,
    # so that one is found with LIKE), its sweep (``sweep_of``), the optim_steps it completed
    # (the step its next metrics belong to), its requests not yet settled, the loss function of
    # its latest forward_backward, and the newest trainer hold on it (RunPlaced.epoch: outcomes
    # of an older one are fenced off, as in tinsmith/jobs.py).
    tags: Mapped[str] = mapped_column(String(2000), default="")
    sweep: Mapped[str] = mapped_column(String(200), default="", index=True)
    steps: Mapped[int] = mapped_column(default=0)
    pending: Mapped[int] = mapped_column(default=0)
    loss_fn: Mapped[str] = mapped_column(String(50), default="")
    epoch: Mapped[int] = mapped_column(default=0)


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


class RequestRow(Base):
    """One request's life, from the log: when it was accepted, when its work began, how long it
    computed, when its outcome was recorded, and the scalars it reported. A sample counts toward
    the run whose weights it sampled (``model_id``) when that run is its caller's."""

    __tablename__ = "requests"
    request_id: Mapped[str] = mapped_column(String(250), primary_key=True)
    seq: Mapped[int] = mapped_column(index=True)
    aggregate_id: Mapped[str] = mapped_column(String(200))  # the run, or the sampler
    model_id: Mapped[str] = mapped_column(String(200), index=True)  # "" for no run
    session_id: Mapped[str] = mapped_column(String(200), index=True)
    op: Mapped[str] = mapped_column(String(30))
    status: Mapped[str] = mapped_column(String(12))  # pending | completed | failed | cancelled
    accepted_at: Mapped[float]
    started_at: Mapped[float | None]
    compute_s: Mapped[float | None]
    finished_at: Mapped[float | None]
    step: Mapped[int | None]
    weight: Mapped[int] = mapped_column(default=1)  # its datums: what a :mean is weighted by
    error_kind: Mapped[str] = mapped_column(String(50), default="")
    error_detail: Mapped[str] = mapped_column(String(500), default="")
    replica: Mapped[str] = mapped_column(String(200), default="")
    metrics: Mapped[dict[str, float | None]] = mapped_column(default=dict)


class MetricRow(Base):
    """One scalar of a run at a step: the step's requests' metrics combined as the SDK combines
    a batch's chunks (``:sum`` added, ``:mean`` weighted by datums, ``:min``, ``:max``; any other
    reduction keeps the latest), or a value the client reported (the latest). None: the value
    was not a finite number (a diverged loss)."""

    __tablename__ = "run_metrics"
    key: Mapped[str] = mapped_column(String(700), primary_key=True)  # _metric_key
    model_id: Mapped[str] = mapped_column(String(200), index=True)
    step: Mapped[int]
    name: Mapped[str] = mapped_column(String(200))
    value: Mapped[float | None]
    weight: Mapped[float] = mapped_column(default=0.0)


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


class AuditRow(Base):
    """One change the audit log shows (``AdminClient.get_audit_log``): a checkpoint created,
    copied, deleted, published, unpublished or given a TTL, a session moved into a project, an
    API key issued or revoked. ``subject`` is what it is about (the tinker:// path, the session
    id, the key id); a checkpoint's rows also carry its bytes, so the storage a tenant held in
    any hour can be read back (billing usage)."""

    __tablename__ = "audit"
    seq: Mapped[int] = mapped_column(primary_key=True, autoincrement=False)  # its log position
    time: Mapped[float] = mapped_column(index=True)
    category: Mapped[str] = mapped_column(String(20))  # checkpoints | projects | organizations
    event: Mapped[str] = mapped_column(String(50))  # <resource>_<action>
    owner: Mapped[str] = mapped_column(String(64), index=True)  # the tenant it concerns
    subject: Mapped[str] = mapped_column(String(600), index=True)
    size_bytes: Mapped[int] = mapped_column(default=0)
    details: Mapped[dict[str, Any]]


TABLES: tuple[type[Base], ...] = (
    Position,
    SessionRow,
    RunRow,
    CheckpointRow,
    SamplerRow,
    BlobRow,
    RequestRow,
    MetricRow,
    AuditRow,
)
# The tags column's separator: a character no tag a person types holds.
_TAG_SEP = "\x1f"


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
# Per run: the step from which every metric row of the run was read by ``prefetch``.
_METRIC_FLOORS = "tinsmith.metric_floors"
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
        keys: list[tuple[type[Base], str]] = [(RequestRow, body.request_id)]
        if body.WhichOneof("command") == "sample":
            keys.append((SamplerRow, body.aggregate_id))
            run_id = artifacts.run_of_key(body.sample.adapter_key)
            return keys + ([(RunRow, run_id)] if run_id else [])
        keys.append((RunRow, body.aggregate_id))
        if body.HasField("create_model"):
            keys.append((SessionRow, body.create_model.session_id))
        return keys
    if kind in ("request_completed", "request_failed", "request_cancelled"):
        # A run's own outcome names the run; a sample's names its sampler (no run row).
        return [(RequestRow, body.request_id), (RunRow, body.aggregate_id)]
    if kind in ("run_created", "run_placed", "metrics_reported"):
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
    if kind == "weights_copied":
        return [
            (SessionRow, body.session_id),
            (RunRow, body.model_id),
            (CheckpointRow, body.saved.tinker_path),
            (BlobRow, body.saved.blob_key),
        ]
    if kind == "session_project_assigned":
        return [(SessionRow, body.session_id)]
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
    await _prefetch_metrics(session, wanted)


async def _prefetch_metrics(session: AsyncSession, wanted: dict[type[Base], set[str]]) -> None:
    """Read the metric rows the batch may fold into: each run's (those the batch names, and
    those of the stored requests it settles) from the step the run has reached on, as a run's
    steps only grow. A metric key at or past that step and not read does not exist then
    (``_metric``), so a replay adds each step's metrics without asking for them first."""
    rows = _rows(session)
    run_ids = set(wanted.get(RunRow, ()))
    for key in wanted.get(RequestRow, ()):
        request = rows.get((RequestRow, key))
        if isinstance(request, RequestRow) and request.model_id:
            run_ids.add(request.model_id)
    floors: dict[str, int] = session.info.setdefault(_METRIC_FLOORS, {})
    for model_id in sorted(run_ids - set(floors)):
        run = await _get(session, RunRow, model_id)
        floors[model_id] = run.steps if run is not None else 0
    todo = sorted(run_ids)
    for start in range(0, len(todo), _PREFETCH_CHUNK):
        chunk = todo[start : start + _PREFETCH_CHUNK]
        reached = [and_(MetricRow.model_id == r, MetricRow.step >= floors[r]) for r in chunk]
        for row in await session.scalars(select(MetricRow).where(or_(*reached))):
            rows.setdefault((MetricRow, row.key), row)


async def _metric(session: AsyncSession, model_id: str, step: int, key: str) -> MetricRow | None:
    """A run's metric row at ``step``, known missing without a query where ``prefetch`` read
    every row of the run from an earlier step on."""
    floor = session.info.get(_METRIC_FLOORS, {}).get(model_id)
    if floor is not None and step >= floor:
        _rows(session).setdefault((MetricRow, key), None)
    return await _get(session, MetricRow, key)


async def apply(session: AsyncSession, seq: int, event: bus.Event) -> list[str]:
    """Fold one event into the tables. Returns the blob keys it stopped referencing (a checkpoint
    overwritten under a new key), which the caller may remove from the store."""
    kind = events.kind_of(event)
    body = getattr(event, kind)
    await _audit(session, seq, event)
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
        await _request(session, seq, event)
    elif kind in ("request_completed", "request_failed", "request_cancelled"):
        await _settled(session, event)
    elif kind == "run_placed":
        run = await _get(session, RunRow, body.model_id)
        if run is not None:
            run.epoch = max(run.epoch, body.epoch)
    elif kind == "metrics_reported":
        run = await _get(session, RunRow, body.model_id)
        if run is not None:
            for name, value in body.metrics.items():
                await _fold_metric(session, run.model_id, body.step, name, value, weight=None)
    elif kind == "run_created":
        run = await _get(session, RunRow, body.model_id)
        if run is not None:
            run.ready, run.tokenizer_id = True, body.tokenizer_id
    elif kind == "weights_saved":
        if await _fenced(session, body.model_id, event):
            return []
        return await _saved(session, seq, body, event.time)
    elif kind == "weights_copied":
        return await _copied(session, seq, event)
    elif kind == "session_project_assigned":
        await _project_assigned(session, body)
    elif kind in ("run_unloaded", "run_snapshotted"):
        if await _fenced(session, body.model_id, event):
            return []
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


async def _fenced(session: AsyncSession, model_id: str, event: bus.Event) -> bool:
    """Whether ``event`` was recorded by a trainer whose hold on the run a later placement
    ended (``jobs.fenced``): what such a trainer saved or snapshotted is not the run's, as it
    is not in the run's own fold. Its files are then referenced by nothing, and collected."""
    epoch = events.epoch_of(event)
    run = await _get(session, RunRow, model_id)
    return run is not None and epoch != 0 and epoch < run.epoch


async def _accepted(session: AsyncSession, seq: int, event: bus.Event) -> None:
    accepted = event.request_accepted
    if accepted.WhichOneof("command") == "sample":
        return
    run = await _get(session, RunRow, accepted.aggregate_id)
    if run is not None:
        run.last_request_time = max(run.last_request_time, event.time)
        if accepted.HasField("forward_backward") and not accepted.forward_backward.forward_only:
            run.loss_fn = accepted.forward_backward.loss_fn[:50]
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
            tags="".join(f"{_TAG_SEP}{tag}" for tag in owner.tags) + _TAG_SEP if owner else "",
            sweep=sweep_of(dict(create.user_metadata), owner.user_metadata if owner else {}),
            steps=0,
            pending=0,
            loss_fn="",
            epoch=0,
        ),
    )


def sweep_of(run_metadata: dict[str, str], session_metadata: dict[str, str]) -> str:
    """The sweep a run belongs to: the ``sweep`` of its own user_metadata, else of its
    session's (``ServiceClient(user_metadata={"sweep": ...})`` tags every run of a session)."""
    return (run_metadata.get("sweep") or session_metadata.get("sweep") or "")[:200]


async def _request(session: AsyncSession, seq: int, event: bus.Event) -> None:
    """A request's row, from its acceptance. A run's counts toward the run; a sample toward the
    run whose weights it samples when its session's tenant owns that run (a published
    checkpoint sampled by another tenant is not the publisher's to chart)."""
    accepted = event.request_accepted
    if await _get(session, RequestRow, accepted.request_id) is not None:
        return
    op = events.command_of(accepted)
    weight = 1
    if op == "sample":
        sampler = await _get(session, SamplerRow, accepted.aggregate_id)
        session_id = sampler.session_id if sampler else ""
        caller = await _get(session, SessionRow, session_id) if session_id else None
        run_id = artifacts.run_of_key(accepted.sample.adapter_key)
        run = await _get(session, RunRow, run_id) if run_id else None
        mine = run is not None and caller is not None and run.owner == caller.owner != ""
        model_id = run.model_id if run is not None and mine else ""
    else:
        run = await _get(session, RunRow, accepted.aggregate_id)
        if run is None:
            return
        model_id, session_id = run.model_id, run.session_id
        run.pending += 1
        if op == "forward_backward":
            weight = max(1, len(accepted.forward_backward.data))
            op = "forward" if accepted.forward_backward.forward_only else op
    _add(
        session,
        RequestRow(
            request_id=accepted.request_id,
            seq=seq,
            aggregate_id=accepted.aggregate_id,
            model_id=model_id,
            session_id=session_id,
            op=op,
            status="pending",
            accepted_at=event.time,
            started_at=None,
            compute_s=None,
            finished_at=None,
            step=None,
            weight=weight,
            error_kind="",
            error_detail="",
            replica="",
            metrics={},
        ),
    )


async def _settled(session: AsyncSession, event: bus.Event) -> None:
    """A request's outcome: the first one recorded under the run's newest hold wins. Its step
    is the run's optim_steps completed before it (an optim_step closes its own step), and its
    metrics are folded into the run's at that step."""
    kind = events.kind_of(event)
    body = getattr(event, kind)
    row = await _get(session, RequestRow, body.request_id)
    if row is None or row.status != "pending":
        return
    run = await _get(session, RunRow, row.model_id) if row.model_id else None
    own = run is not None and row.aggregate_id == run.model_id
    if own and await _fenced(session, row.model_id, event):
        return  # recorded by a trainer that had lost the run
    row.finished_at = event.time
    if kind == "request_completed":
        row.status = "completed"
        row.started_at = body.started or None
        row.compute_s = body.compute_seconds
        row.replica = body.replica
        row.metrics = {name: _finite(value) for name, value in body.metrics.items()}
    else:
        row.status = "failed" if kind == "request_failed" else "cancelled"
        row.error_kind = body.kind[:50] if kind == "request_failed" else "cancelled"
        row.error_detail = body.detail[:500]
        if kind == "request_failed":
            row.started_at = body.started or None
    if run is None:
        return
    if own:
        run.pending = max(0, run.pending - 1)
    row.step = run.steps
    for name, value in body.metrics.items() if kind == "request_completed" else ():
        await _fold_metric(session, run.model_id, run.steps, name, value, weight=row.weight)
    if own and row.op == "optim_step" and row.status == "completed":
        run.steps += 1


def _finite(value: float) -> float | None:
    return value if math.isfinite(value) else None


def _metric_key(model_id: str, step: int, name: str) -> str:
    return f"{model_id}\n{step}\n{name}"


async def _fold_metric(
    session: AsyncSession, model_id: str, step: int, name: str, value: float, *, weight: int | None
) -> None:
    """Fold one scalar into the run's at ``step``: combined with what the step has of it by the
    reduction its name ends with (a request's, ``weight`` its datums), or replacing it (a
    client's report, ``weight`` None)."""
    name = name[:200]
    key = _metric_key(model_id, step, name)
    row = await _metric(session, model_id, step, key)
    new = _finite(value)
    if row is None:
        _add(
            session,
            MetricRow(
                key=key, model_id=model_id, step=step, name=name, value=new, weight=weight or 0
            ),
        )
        return
    datums = weight or 0
    reduction = name.rpartition(":")[2] if datums else ""  # a client's report replaces
    old = row.value
    if reduction not in ("sum", "mean", "min", "max"):
        row.value = new
    elif old is None or new is None:
        row.value = None  # a step with a non-finite part is not finite
    elif reduction == "sum":
        row.value = old + new
    elif reduction == "mean":
        row.value = (old * row.weight + new * datums) / (row.weight + datums)
    else:
        row.value = min(old, new) if reduction == "min" else max(old, new)
    row.weight += datums


async def _saved(
    session: AsyncSession, seq: int, saved: bus.WeightsSaved, time: float
) -> list[str]:
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
            created_at=time,
            size_bytes=saved.size_bytes,
            base_model=saved.base_model,
            lora_rank=saved.lora_rank,
            train_mlp=saved.lora.train_mlp if saved.HasField("lora") else True,
            train_attn=saved.lora.train_attn if saved.HasField("lora") else True,
            train_unembed=saved.lora.train_unembed if saved.HasField("lora") else True,
            user_metadata=dict(saved.user_metadata),
            ttl_seconds=ttl,
            expires_at=time + ttl if ttl is not None else None,
            owner=run.owner if run else "",
            project_id=run.project_id if run else "",
        ),
    )
    await _reference(session, saved.blob_key, saved.model_id, "checkpoint", saved.size_bytes, seq)
    return released


async def _copied(session: AsyncSession, seq: int, event: bus.Event) -> list[str]:
    """A copy of weights: its session (new, created finished; or the owner's own), its run
    (which holds the copy alone: ``loaded_from`` is the source) and its checkpoint. A repeat, or
    a session of another tenant, changes nothing."""
    copied = event.weights_copied
    saved = copied.saved
    owner = await _get(session, SessionRow, copied.session_id)
    if await _get(session, RunRow, copied.model_id) is not None or (
        owner is not None and owner.owner != copied.owner
    ):
        return []
    if owner is None:
        owner = SessionRow(
            session_id=copied.session_id,
            seq=seq,
            created_at=event.time,
            owner=copied.owner,
            project_id=copied.project_id,
            display_name="",
            sdk_version="",
            tags=[],
            user_metadata={},
            finished=True,
            finish_reason="copy_weights",
        )
        _add(session, owner)
    every = not saved.HasField("lora")
    _add(
        session,
        RunRow(
            model_id=copied.model_id,
            seq=seq,
            session_id=copied.session_id,
            owner=copied.owner,
            project_id=owner.project_id,
            base_model=saved.base_model,
            lora_rank=saved.lora_rank,
            train_mlp=every or saved.lora.train_mlp,
            train_attn=every or saved.lora.train_attn,
            train_unembed=every or saved.lora.train_unembed,
            user_metadata={},
            created_at=event.time,
            last_request_time=event.time,
            ready=True,
            loaded_from=copied.source_path,
            tags="",
            sweep="",
            steps=0,
            pending=0,
            loss_fn="",
            epoch=0,
        ),
    )
    return await _saved(session, seq, saved, event.time)


async def _project_assigned(session: AsyncSession, assigned: bus.SessionProjectAssigned) -> None:
    """A session moved into a project: its runs and their checkpoints move with it (each
    row's ``project_id`` is its session's, as of when it was made until now)."""
    found = await _get(session, SessionRow, assigned.session_id)
    if found is None:
        return
    found.project_id = assigned.project_id
    runs = (
        await session.scalars(select(RunRow).where(RunRow.session_id == assigned.session_id))
    ).all()
    for run in runs:
        run.project_id = assigned.project_id
    for start in range(0, len(runs), _PREFETCH_CHUNK):
        chunk = [run.model_id for run in runs[start : start + _PREFETCH_CHUNK]]
        for row in await session.scalars(
            select(CheckpointRow).where(CheckpointRow.model_id.in_(chunk))
        ):
            row.project_id = assigned.project_id


async def _audit(session: AsyncSession, seq: int, event: bus.Event) -> None:
    """The audit log's row of an event that changes what a tenant holds or may do, read
    against the tables as they were before the event is folded."""
    kind = events.kind_of(event)
    body = getattr(event, kind)
    found = _audit_entry(kind, body)
    if found is None:
        return
    category, name, subject = found
    owner, size, details = "", 0, {}
    if kind == "weights_saved":
        run = await _get(session, RunRow, body.model_id)
        owner, size = (run.owner if run else ""), body.size_bytes
        details = {
            "model_id": body.model_id,
            "checkpoint_type": artifacts.CHECKPOINT_TYPES.get(body.kind, ""),
            "size_bytes": size,
            "base_model": body.base_model,
            "session_id": run.session_id if run else "",
            "ttl_seconds": body.ttl_seconds if body.HasField("ttl_seconds") else None,
            "overwrote": await _get(session, CheckpointRow, body.tinker_path) is not None,
        }
    elif kind == "weights_copied":
        held = await _get(session, SessionRow, body.session_id)
        if await _get(session, RunRow, body.model_id) is not None or (
            held is not None and held.owner != body.owner
        ):
            return  # a repeat, or refused by the fold (``_copied``)
        saved = body.saved
        owner, size = body.owner, saved.size_bytes
        details = {
            "model_id": body.model_id,
            "source_path": body.source_path,
            "checkpoint_type": artifacts.CHECKPOINT_TYPES.get(saved.kind, ""),
            "size_bytes": size,
            "base_model": saved.base_model,
            "session_id": body.session_id,
            "project_id": body.project_id or None,
            "ttl_seconds": saved.ttl_seconds if saved.HasField("ttl_seconds") else None,
        }
    elif kind.startswith("checkpoint_"):
        row = await _get(session, CheckpointRow, body.tinker_path)
        if row is None or (kind == "checkpoint_deleted" and row.blob_key != body.blob_key):
            return  # gone already: nothing changed
        owner, details = row.owner, {"model_id": row.model_id}
        if kind == "checkpoint_deleted":
            details["reason"] = body.reason
        elif kind == "checkpoint_ttl_set":
            details["ttl_seconds"] = body.ttl_seconds if body.HasField("ttl_seconds") else None
    elif kind == "session_project_assigned":
        held = await _get(session, SessionRow, body.session_id)
        if held is None:
            return
        owner = held.owner
        details = {"project_id": body.project_id, "previous_project_id": held.project_id or None}
    elif kind == "key_issued":
        owner = body.tenant
        details = {"key_id": body.key_id, "admin": body.admin, "label": body.label}
    elif kind == "key_revoked":
        issued = await session.scalar(
            select(AuditRow.owner).where(
                AuditRow.event == "api_key_issued", AuditRow.subject == body.key_id
            )
        )
        owner, details = issued or "", {"key_id": body.key_id, "reason": body.reason}
    session.add(
        AuditRow(
            seq=seq,
            time=event.time,
            category=category,
            event=name,
            owner=owner,
            subject=subject,
            size_bytes=size,
            details={"tenant": owner, "subject": subject, **details},
        )
    )


def _audit_entry(kind: str, body: Any) -> tuple[str, str, str] | None:
    """``(category, event, subject)`` of an event the audit log shows; None for the rest."""
    if kind in ("weights_saved", "checkpoint_deleted", "checkpoint_ttl_set"):
        return "checkpoints", kind.replace("weights_saved", "checkpoint_created"), body.tinker_path
    if kind == "checkpoint_published":
        name = "checkpoint_published" if body.public else "checkpoint_unpublished"
        return "checkpoints", name, body.tinker_path
    if kind == "weights_copied":
        return "checkpoints", "checkpoint_copied", body.saved.tinker_path
    if kind == "session_project_assigned":
        return "projects", "project_session_assigned", body.session_id
    if kind in ("key_issued", "key_revoked"):
        return "organizations", kind.replace("key_", "api_key_"), body.key_id
    return None


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


async def console_runs(
    session: AsyncSession, *, owner: str, tag: str, sweep: str, limit: int, offset: int
) -> tuple[Sequence[RunRow], int]:
    """The tenant's runs, newest first, of the sessions tagged ``tag`` and of the sweep
    ``sweep`` (each filter only when given), and how many there are in all."""
    condition = visible_to(owner, RunRow.owner)
    if tag:
        condition = and_(condition, RunRow.tags.contains(f"{_TAG_SEP}{tag}{_TAG_SEP}"))
    if sweep:
        condition = and_(condition, RunRow.sweep == sweep)
    total = await session.scalar(select(func.count()).select_from(RunRow).where(condition))
    rows = await session.scalars(
        select(RunRow).where(condition).order_by(RunRow.seq.desc()).limit(limit).offset(offset)
    )
    return rows.all(), int(total or 0)


def tags_of(run: RunRow) -> list[str]:
    return [tag for tag in run.tags.split(_TAG_SEP) if tag]


async def series(
    session: AsyncSession, model_ids: Sequence[str], names: Sequence[str] | None = None
) -> dict[str, dict[str, list[tuple[int, float | None]]]]:
    """The runs' metrics by run and name, each a list of ``(step, value)`` in step order (only
    the metrics ``names``, when given)."""
    out: dict[str, dict[str, list[tuple[int, float | None]]]] = {m: {} for m in model_ids}
    if not model_ids:
        return out
    condition: ColumnElement[bool] = MetricRow.model_id.in_(list(model_ids))
    if names is not None:
        condition = and_(condition, MetricRow.name.in_(list(names)))
    rows = await session.execute(
        select(MetricRow.model_id, MetricRow.name, MetricRow.step, MetricRow.value)
        .where(condition)
        .order_by(MetricRow.model_id, MetricRow.name, MetricRow.step)
    )
    for model_id, name, step, value in rows.all():
        out[model_id].setdefault(name, []).append((int(step), value))
    return out


async def run_requests(
    session: AsyncSession, model_id: str, *, limit: int, offset: int
) -> tuple[Sequence[RequestRow], int]:
    """The requests that count toward a run (its own, and the samples of its weights by its
    tenant), newest first, and how many there are in all."""
    condition = RequestRow.model_id == model_id
    total = await session.scalar(select(func.count()).select_from(RequestRow).where(condition))
    rows = await session.scalars(
        select(RequestRow)
        .where(condition)
        .order_by(RequestRow.seq.desc())
        .limit(limit)
        .offset(offset)
    )
    return rows.all(), int(total or 0)


async def session_requests(session: AsyncSession, session_id: str) -> Sequence[RequestRow]:
    """Every request of a session's runs and samplers, in the order they were accepted."""
    rows = await session.scalars(
        select(RequestRow).where(RequestRow.session_id == session_id).order_by(RequestRow.seq)
    )
    return rows.all()


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
