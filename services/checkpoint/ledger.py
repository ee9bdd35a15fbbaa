"""What happened and what was used, from the catalog: the audit log (``AdminClient.
get_audit_log``) and the billing usage events (``AdminClient.get_billing_usage``).

Owns: the JSON of both (the SDK's ``AuditLogResponse`` and ``BillingUsageResponse``), who may
read them, and how usage is measured and bucketed. Does not own: the rows they read (the audit
table, requests, sessions, runs and samplers of tinsmith/catalog.py, all folded from the log).

Who may read them. The audit log is the operators': it needs an admin key (a tenant's key gets a
403). Billing usage is like the storage usage beside it: a tenant's key gets its own, an admin's
every tenant's.

The audit log: one entry per checkpoint created (a save), copied, deleted (asked, or expired),
published, unpublished or given a TTL (``event_type=checkpoints``), per session moved into a
project (``projects``), and per API key issued or revoked (``organizations``); tinsmith has no
teams, so ``teams`` is always empty. A day is midnight to midnight UTC.

Billing usage, in hourly buckets of UTC (tinsmith prices nothing: every cost and rate is null):
- ``training``: the tokens of each forward_backward and forward, in the hour it completed, for
  the run's base model and session;
- ``sampling_prefill`` (never cached here) and ``sampling_sample``: each sample request's prompt
  tokens and generated tokens, for the sampler's base model and session;
- ``checkpoint``: the checkpoints created (saved or copied) in the hour;
- ``storage``: the gigabyte-hours (GiB, as the storage usage counts) each checkpoint was stored in
  the hour, from its creation to its deletion or overwrite, per base model, tenant and project
  (no session, as the SDK says of storage).
The project of each row is its session's as it is now.
"""

from __future__ import annotations

import math
import time
from collections import defaultdict
from datetime import UTC, date, datetime
from typing import Any

from sqlalchemy import and_, select
from sqlalchemy.ext.asyncio import AsyncSession

from tinsmith import catalog
from tinsmith._proto import bus_pb2 as bus
from tinsmith.failures import Forbidden, InvalidRequest

from . import access
from .projection import SqlProjection

JsonDict = dict[str, Any]
EVENT_TYPES = ("all", "checkpoints", "projects", "teams", "organizations")
_HOUR = 3600
_DAY = 86400
MAX_WINDOW_S = 14 * _DAY
_GIBIBYTE = 1024**3
_CREATED = ("checkpoint_created", "checkpoint_copied")
# The metrics of a completed request that count its tokens (the workers record them).
_TRAINING = ("tokens:sum", "forward/tokens:sum")
_PROMPT = "sample/prompt_tokens:sum"
_SAMPLED = "sample/sampled_tokens:sum"


class Ledger:
    def __init__(self, projection: SqlProjection) -> None:
        self.projection = projection

    async def audit_log(self, query: bus.CatalogQuery) -> JsonDict:
        """The audit entries of one UTC day, in the order they happened."""
        if not query.admin:
            raise Forbidden(
                "the audit log is the operators': it needs an admin key (`tinsmith keys create "
                "--tenant NAME --admin`)"
            )
        event_type = query.event_type or "all"
        if event_type not in EVENT_TYPES:
            raise InvalidRequest(
                f"event_type {event_type[:40]!r} is not accepted: use one of {list(EVENT_TYPES)}"
            )
        start = _day_start(query.day)
        audit = catalog.AuditRow
        condition = and_(audit.time >= start, audit.time < start + _DAY)
        if event_type != "all":
            condition = and_(condition, audit.category == event_type)
        await self.projection.catch_up()
        async with self.projection.session() as session:
            rows = (await session.scalars(select(audit).where(condition).order_by(audit.seq))).all()
        return {"entries": [_entry(row) for row in rows]}

    async def billing_usage(self, query: bus.CatalogQuery) -> JsonDict:
        """The usage of the window in hourly buckets: the caller's, or every tenant's for an
        admin."""
        start, end = _window(query.starting_on, query.ending_before)
        owner = None if query.admin else query.owner
        await self.projection.catch_up()
        async with self.projection.session() as session:
            usage = _Usage(start, end)
            await usage.tokens(session, owner)
            await usage.checkpoints(session, owner)
        return usage.response()


class _Usage:
    """The buckets of one window as they fill: ``(bucket, kind, base model, owner, session,
    project, cached) -> quantity``, and the sessions they name."""

    def __init__(self, start: float, end: float) -> None:
        self.start, self.end = start, end
        self.totals: dict[tuple[float, str, str, str, str, str], float] = defaultdict(float)
        self.sessions: dict[str, catalog.SessionRow] = {}

    def add(
        self, at: float, kind: str, base: str, session: catalog.SessionRow | None, n: float
    ) -> None:
        owner = session.owner if session else ""
        project = session.project_id if session else ""
        sid = session.session_id if session and kind != "storage" else ""
        if sid and session is not None:
            self.sessions[sid] = session
        bucket = math.floor(at / _HOUR) * _HOUR
        self.totals[(bucket, kind, base, owner, sid, project)] += n

    async def tokens(self, session: AsyncSession, owner: str | None) -> None:
        """Training and sampling tokens of the requests completed in the window."""
        request = catalog.RequestRow
        rows = (
            await session.scalars(
                select(request).where(
                    request.status == "completed",
                    request.finished_at >= self.start,
                    request.finished_at < self.end,
                    request.op.in_(("forward_backward", "forward", "sample")),
                )
            )
        ).all()
        for row in rows:
            held = await _session(session, row.session_id)
            if held is None or (owner is not None and not _mine(owner, held.owner)):
                continue
            at = row.finished_at or 0.0  # set on every completed request
            if row.op == "sample":
                sampler = await session.get(catalog.SamplerRow, row.aggregate_id)
                base = sampler.base_model if sampler else ""
                self.add(at, "sampling_prefill", base, held, row.metrics.get(_PROMPT) or 0)
                self.add(at, "sampling_sample", base, held, row.metrics.get(_SAMPLED) or 0)
            else:
                run = await session.get(catalog.RunRow, row.aggregate_id)
                tokens = sum(row.metrics.get(name) or 0 for name in _TRAINING)
                self.add(at, "training", run.base_model if run else "", held, tokens)

    async def checkpoints(self, session: AsyncSession, owner: str | None) -> None:
        """Checkpoints created in the window, and the storage of every checkpoint that lived
        in it: from its creation to its deletion or the save that overwrote it."""
        audit = catalog.AuditRow
        condition = and_(audit.time < self.end, audit.event.in_((*_CREATED, "checkpoint_deleted")))
        if owner is not None:
            condition = and_(condition, catalog.visible_to(owner, audit.owner))
        rows = (await session.scalars(select(audit).where(condition).order_by(audit.seq))).all()
        living: dict[str, catalog.AuditRow] = {}  # tinker path -> the row that created it
        for row in rows:
            created = living.pop(row.subject, None)
            if created is not None:
                await self._stored(session, created, float(row.time))
            if row.event in _CREATED:
                living[row.subject] = row
                if row.time >= self.start:
                    held = await _session(session, str(row.details.get("session_id", "")))
                    base = str(row.details.get("base_model", ""))
                    self.add(float(row.time), "checkpoint", base, held, 1)
        for created in living.values():
            await self._stored(session, created, min(self.end, time.time()))

    async def _stored(self, session: AsyncSession, created: catalog.AuditRow, until: float) -> None:
        """The gigabyte-hours of one checkpoint stored from its creation to ``until``, by hour."""
        begin = max(float(created.time), self.start)
        held = await _session(session, str(created.details.get("session_id", "")))
        base = str(created.details.get("base_model", ""))
        gibibytes = created.size_bytes / _GIBIBYTE
        hour = math.floor(begin / _HOUR) * _HOUR
        while hour < min(until, self.end):
            overlap = min(until, hour + _HOUR) - max(begin, hour)
            if overlap > 0:
                self.add(hour, "storage", base, held, gibibytes * overlap / _HOUR)
            hour += _HOUR

    def response(self) -> JsonDict:
        """The events ordered by bucket, then by quantity (largest first), as the SDK says."""
        ordered = sorted(self.totals.items(), key=lambda item: (item[0][0], -item[1]))
        data = []
        for (bucket, kind, base, owner, sid, project), n in ordered:
            if n <= 0:
                continue
            data.append(
                {
                    "bucket_start": access.iso(bucket),
                    "bucket_end": access.iso(bucket + _HOUR),
                    "base_model": base or None,
                    "user_id": owner or None,
                    "session_id": sid or None,
                    "project_id": project or None,
                    "estimated_cost_usd": None,
                    "event_info": _info(kind, n),
                }
            )
        return {
            "data": data,
            "sessions": {
                sid: {"user_metadata": dict(row.user_metadata) or None}
                for sid, row in sorted(self.sessions.items())
            },
            "cost_data_through": None,
        }


def _info(kind: str, n: float) -> JsonDict:
    if kind == "storage":
        return {"type": "storage", "free": False, "gigabyte_hours": n}
    if kind == "checkpoint":
        return {"type": "checkpoint", "count": int(n)}
    if kind == "sampling_prefill":
        return {"type": kind, "cached": False, "token_count": int(n)}
    return {"type": kind, "token_count": int(n)}


async def _session(session: AsyncSession, session_id: str) -> catalog.SessionRow | None:
    if not session_id:
        return None
    row: catalog.SessionRow | None = await session.get(catalog.SessionRow, session_id)
    return row


def _mine(owner: str, row_owner: str) -> bool:
    return bool(owner) and owner == row_owner


def _entry(row: catalog.AuditRow) -> JsonDict:
    checkpoint = row.category == "checkpoints"
    return {
        "timestamp": access.iso(row.time),
        "event": row.event,
        "event_details": row.details,
        "model_id": row.details.get("model_id") if checkpoint else None,
        "tinker_path": row.subject if checkpoint else None,
    }


def _day_start(day: str) -> float:
    """Midnight UTC of ``YYYY-MM-DD``, or of today for ""."""
    if not day:
        today = datetime.now(UTC).date()
    else:
        try:
            today = date.fromisoformat(day)
        except ValueError:
            raise InvalidRequest(f"day must be a date, YYYY-MM-DD; got {day[:40]!r}") from None
    return datetime(today.year, today.month, today.day, tzinfo=UTC).timestamp()


def _window(start: float, end: float) -> tuple[float, float]:
    """The billing window: whole UTC hours, starting no later than now, ending after it starts
    and at most 14 days later."""
    if start % _HOUR or end % _HOUR:
        raise InvalidRequest(
            "starting_on and ending_before must be on UTC hour boundaries, e.g. "
            "2026-07-13T00:00:00Z"
        )
    if start > time.time():
        raise InvalidRequest(f"starting_on {access.iso(start)} is in the future")
    if not start < end <= start + MAX_WINDOW_S:
        raise InvalidRequest(
            "ending_before must be after starting_on and at most 14 days later; got "
            f"{access.iso(start)} to {access.iso(end)}"
        )
    return start, end
