"""Sessions beyond one at a time: moving a session into a project (``assign_session_project``)
and searching sessions (``search_sessions``, the SDK's ``SessionSearchRequest``).

Owns: the ``SessionProjectAssigned`` event, reading a search request (every field the SDK 0.38
sends; anything else is a 400 that says what is accepted), and the search's JSON
(``SessionSearchResponse``). Does not own: who may see a session (access.py: its tenant alone;
an admin's search may cover every tenant, as ``storage_usage`` does), or the tables.

A project in tinsmith is a name a session carries (``create_session``'s ``project_id``); its
runs and checkpoints are listed and counted under their session's project as it is now
(``list_training_runs(project_id=...)``, ``get_current_checkpoint_storage_usage``), so moving a
session moves them. Every name is a project the caller may list: there are no grants.

A session's status: ``active`` until its client finishes it, then ``client_finished`` with the
client's reason (``success``, ``errored``, ``interrupted``). Sessions are never failed or
cancelled here, so those statuses match nothing; a session made for a copy of weights
(``copy_weights``) is finished without a client and has no status (null), as the SDK allows.
"""

from __future__ import annotations

import json
from datetime import datetime
from typing import Any

from sqlalchemy import ColumnElement, and_, false, func, or_, select
from sqlalchemy.ext.asyncio import AsyncSession

from tinsmith import catalog, events
from tinsmith._proto import bus_pb2 as bus
from tinsmith.eventlog import EventLog
from tinsmith.failures import InvalidRequest

from . import access
from .copies import MAX_PROJECT_ID
from .projection import SqlProjection

JsonDict = dict[str, Any]
_CLIENT_REASONS = ("success", "errored", "interrupted")
_STATUSES = ("active", "cancelled", "failed", "client_finished")
_FIELDS = frozenset(
    {
        "session_id",
        "project_ids",
        "user_metadata",
        "display_name",
        "owner",
        "statuses",
        "limit",
        "cursor",
    }
)
_SCAN = 500  # sessions read at a time while a user_metadata filter drops some


def project_id(value: str) -> str:
    """A project id as a session carries it: 1-200 printable characters."""
    if not 1 <= len(value) <= MAX_PROJECT_ID or not value.isprintable():
        raise InvalidRequest(
            f"project_id must be 1-{MAX_PROJECT_ID} printable characters, got {value!r:.80}"
        )
    return value


class Sessions:
    def __init__(self, eventlog: EventLog, projection: SqlProjection) -> None:
        self.log = eventlog
        self.projection = projection

    async def assign_project(self, query: bus.CatalogQuery) -> JsonDict:
        """Move the caller's session, its runs and their checkpoints into a project."""
        project = project_id(query.project_id)
        await self.projection.catch_up()
        async with self.projection.session() as session:
            row = await access.find_session(session, query, query.session_id)
        if row.project_id != project:
            assigned = bus.SessionProjectAssigned(session_id=row.session_id, project_id=project)
            seq, _ = await self.log.append(events.make(session_project_assigned=assigned))
            await self.projection.wait_for(seq)
        return {}

    async def search(self, query: bus.CatalogQuery) -> JsonDict:
        """One page of the sessions a ``SessionSearchRequest`` matches, newest first."""
        found = Search.read(query)
        await self.projection.catch_up()
        async with self.projection.session() as session:
            condition = await found.condition(session, query)
            # One more than a page tells whether another follows; a user_metadata filter (read
            # here, not in SQL: JSON columns differ between databases) may drop some.
            scan = _SCAN if found.user_metadata else found.limit + 1
            rows: list[catalog.SessionRow] = []
            while len(rows) <= found.limit:
                batch = (
                    await session.scalars(
                        select(catalog.SessionRow)
                        .where(condition)
                        .order_by(catalog.SessionRow.seq.desc())
                        .limit(scan)
                    )
                ).all()
                rows.extend(row for row in batch if found.metadata_matches(row))
                if len(batch) < scan:
                    break
                condition = and_(condition, catalog.SessionRow.seq < batch[-1].seq)
            page = rows[: found.limit]
            stored = await _checkpoints_by_session(session, [row.session_id for row in page])
        more = len(rows) > found.limit
        return {
            "sessions": [_summary(row, *stored.get(row.session_id, (0, 0))) for row in page],
            "next_cursor": (
                {
                    "last_created_at": access.iso(page[-1].created_at),
                    "last_session_id": page[-1].session_id,
                }
                if more and page
                else None
            ),
        }


class Search:
    """A ``SessionSearchRequest`` as read from its JSON."""

    def __init__(self, body: dict[str, Any]) -> None:
        unknown = sorted(set(body) - _FIELDS)
        if unknown:
            raise InvalidRequest(
                f"search_sessions does not accept {unknown}; the fields are {sorted(_FIELDS)}"
            )
        self.session_id = _opt_str(body, "session_id")
        self.display_words = (_opt_str(body, "display_name") or "").lower().split()
        if body.get("display_name") is not None and not self.display_words:
            raise InvalidRequest("display_name must hold a word to search for")
        projects = body.get("project_ids")
        if projects is not None and (
            not isinstance(projects, list) or not all(isinstance(p, str) for p in projects)
        ):
            raise InvalidRequest("project_ids must be a list of project ids, or null for all")
        self.project_ids = None if projects is None else [project_id(p) for p in projects]
        metadata = body.get("user_metadata") or {}
        if not isinstance(metadata, dict) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in metadata.items()
        ):
            raise InvalidRequest("user_metadata must be an object of strings to match exactly")
        self.user_metadata: dict[str, str] = metadata
        self.owner = _owner(body.get("owner"))
        self.statuses = _statuses(body.get("statuses"))
        limit = body.get("limit", 50)
        if not isinstance(limit, int) or isinstance(limit, bool) or not 1 <= limit <= 200:
            raise InvalidRequest(f"limit must be 1 to 200, got {limit!r:.40}")
        self.limit = limit
        self.cursor = _cursor(body.get("cursor"))

    @classmethod
    def read(cls, query: bus.CatalogQuery) -> Search:
        try:
            body = json.loads(query.search or "{}")
        except ValueError:
            raise InvalidRequest("the search request is not JSON") from None
        if not isinstance(body, dict):
            raise InvalidRequest("the search request must be a JSON object")
        return cls(body)

    async def condition(
        self, session: AsyncSession, query: bus.CatalogQuery
    ) -> ColumnElement[bool]:
        """The SQL part of the search: whose, which, in what status, after the cursor."""
        row = catalog.SessionRow
        kind, urns = self.owner
        if kind == "own" or not query.admin:
            # A tenant may list its own sessions alone, whatever it asks for.
            mine = catalog.visible_to(query.owner, row.owner)
            whose = and_(mine, row.owner.in_(urns)) if kind == "user" else mine
        else:
            whose = row.owner.in_(urns) if kind == "user" else row.owner != ""
        condition = whose
        named: list[ColumnElement[bool]] = []
        if self.session_id is not None:
            named.append(row.session_id == self.session_id)
        if self.display_words:
            named.append(
                and_(
                    *(
                        func.lower(row.display_name).contains(word, autoescape=True)
                        for word in self.display_words
                    )
                )
            )
        if named:
            condition = and_(condition, or_(*named))
        if self.project_ids is not None:
            condition = and_(condition, row.project_id.in_(self.project_ids))
        if self.statuses is not None:
            condition = and_(condition, or_(false(), *self.statuses))
        if self.cursor is not None:
            last = await session.get(row, self.cursor)
            if last is None or not (access.owns(query, last.owner) or query.admin):
                raise InvalidRequest(
                    "cursor names no session of this search: pass a response's next_cursor back "
                    "unchanged"
                )
            condition = and_(condition, row.seq < last.seq)
        return condition

    def metadata_matches(self, row: catalog.SessionRow) -> bool:
        return all(row.user_metadata.get(k) == v for k, v in self.user_metadata.items())


def _summary(row: catalog.SessionRow, checkpoints: int, size: int) -> JsonDict:
    status: JsonDict | None = {"type": "active"}
    if row.finished:
        status = (
            {"type": "client_finished", "reason": {"type": row.finish_reason}, "detail": None}
            if row.finish_reason in _CLIENT_REASONS
            else None
        )
    return {
        "session_id": row.session_id,
        "created_at": access.iso(row.created_at),
        "owner": row.owner,
        "project_id": row.project_id,
        "status": status,
        "checkpoints_count": checkpoints,
        "display_name": row.display_name or None,
        "user_metadata": dict(row.user_metadata) or None,
        "checkpoint_storage_bytes": size,
    }


async def _checkpoints_by_session(
    session: AsyncSession, session_ids: list[str]
) -> dict[str, tuple[int, int]]:
    """Each session's live checkpoints: how many, and their bytes."""
    if not session_ids:
        return {}
    rows = await session.execute(
        select(
            catalog.RunRow.session_id,
            func.count(),
            func.coalesce(func.sum(catalog.CheckpointRow.size_bytes), 0),
        )
        .join(catalog.RunRow, catalog.RunRow.model_id == catalog.CheckpointRow.model_id)
        .where(catalog.RunRow.session_id.in_(session_ids))
        .group_by(catalog.RunRow.session_id)
    )
    return {str(sid): (int(n), int(size)) for sid, n, size in rows.all()}


def _opt_str(body: dict[str, Any], name: str) -> str | None:
    value = body.get(name)
    if value is not None and (not isinstance(value, str) or len(value) > 1000):
        raise InvalidRequest(f"{name} must be a string of at most 1000 characters, or null")
    return value


def _owner(value: Any) -> tuple[str, list[str]]:
    """``owner``: ``{"type": "own"}`` (the default), ``"accessible"``, or ``"user"`` with
    ``owner_urns`` (1-10 tenants)."""
    value = value or {"type": "own"}
    kind = value.get("type") if isinstance(value, dict) else None
    if kind in ("own", "accessible"):
        return kind, []
    urns = value.get("owner_urns") if isinstance(value, dict) else None
    if (
        kind == "user"
        and isinstance(urns, list)
        and 1 <= len(urns) <= 10
        and all(isinstance(u, str) for u in urns)
    ):
        return kind, urns
    raise InvalidRequest(
        'owner must be {"type": "own"}, {"type": "accessible"} or {"type": "user", '
        '"owner_urns": [1 to 10 owners]}'
    )


def _statuses(value: Any) -> list[ColumnElement[bool]] | None:
    """``statuses``: any of ``active``, ``cancelled``, ``failed`` and ``client_finished`` (with
    ``reasons``, a list of ``success``, ``errored``, ``interrupted``); null for every status."""
    if value is None:
        return None
    if not isinstance(value, list) or not value:
        raise InvalidRequest("statuses must be a non-empty list of statuses, or null for all")
    row = catalog.SessionRow
    out: list[ColumnElement[bool]] = []
    for status in value:
        kind = status.get("type") if isinstance(status, dict) else None
        if kind not in _STATUSES:
            raise InvalidRequest(
                f"a status is an object whose type is one of {list(_STATUSES)}, got {status!r:.80}"
            )
        if kind == "active":
            out.append(row.finished.is_(False))
        elif kind == "client_finished":
            reasons = status.get("reasons") or list(_CLIENT_REASONS)
            if not isinstance(reasons, list) or not set(reasons) <= set(_CLIENT_REASONS):
                raise InvalidRequest(
                    f"client_finished reasons must be a list of {list(_CLIENT_REASONS)}"
                )
            out.append(and_(row.finished.is_(True), row.finish_reason.in_(reasons)))
        else:
            out.append(false())  # never failed nor cancelled here
    return out


def _cursor(value: Any) -> str | None:
    """The session a page ended with (``next_cursor``); its time is checked, its id used."""
    if value is None:
        return None
    last_id = value.get("last_session_id") if isinstance(value, dict) else None
    last_at = value.get("last_created_at") if isinstance(value, dict) else None
    try:
        datetime.fromisoformat(str(last_at))
    except ValueError:
        last_id = None
    if not isinstance(last_id, str):
        raise InvalidRequest(
            "cursor must be a response's next_cursor, {last_created_at, last_session_id}, "
            "passed back unchanged"
        )
    return last_id
