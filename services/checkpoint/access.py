"""Who may read what of the catalog: the one place every catalog operation asks (the rules, in
full, are handlers.py's docstring), and the paging and time formats its answers share.

Owns: whether the caller is a row's tenant (``owns``), the run or session a query names as the
caller may see it (``find_run``, ``find_session``: NotFound, worded the same whether it exists
or not), ``access_scope``, and ``limit``/``offset``. Does not own: the tables (tinsmith/catalog.py).
"""

from __future__ import annotations

from datetime import UTC, datetime

from sqlalchemy.ext.asyncio import AsyncSession

from tinsmith import catalog
from tinsmith._proto import bus_pb2 as bus
from tinsmith.failures import InvalidRequest, NotFound


def owns(query: bus.CatalogQuery, owner: str) -> bool:
    """Whether the caller is the tenant ``owner``; the empty owner is no tenant and owns
    nothing."""
    return bool(query.owner) and owner == query.owner


def accessible(query: bus.CatalogQuery) -> bool:
    scope = query.access_scope or "owned"
    if scope not in ("owned", "accessible"):
        raise InvalidRequest(f"access_scope {scope!r} is not accepted: use 'owned' or 'accessible'")
    return scope == "accessible"


async def find_run(session: AsyncSession, query: bus.CatalogQuery, model_id: str) -> catalog.RunRow:
    """The run a query names: the caller's, or with ``access_scope=accessible`` another
    tenant's that has a published checkpoint. Anything else is NotFound, worded the same
    whether the run exists or not."""
    shared = accessible(query)  # a scope that is not one is refused either way
    run = await session.get(catalog.RunRow, model_id)
    if run is not None and owns(query, run.owner):
        return run
    if (
        run is not None
        and shared
        and query.owner
        and await catalog.has_public_checkpoint(session, model_id)
    ):
        return run
    raise NotFound(
        f"no training run {model_id!r} of this tenant (access_scope='accessible' also "
        "finds other tenants' runs with a published checkpoint)"
    )


async def find_own_run(
    session: AsyncSession, query: bus.CatalogQuery, model_id: str
) -> catalog.RunRow:
    """The caller's own run (its curves, requests and metrics are never shared: publishing a
    checkpoint shares its weights alone); NotFound otherwise."""
    run = await session.get(catalog.RunRow, model_id)
    if run is None or not owns(query, run.owner):
        raise NotFound(f"no training run {model_id!r} of this tenant")
    return run


async def find_session(
    session: AsyncSession, query: bus.CatalogQuery, session_id: str
) -> catalog.SessionRow:
    """The caller's session; NotFound otherwise."""
    row = await session.get(catalog.SessionRow, session_id)
    if row is None or not owns(query, row.owner):
        raise NotFound(f"no session {session_id!r} of this tenant")
    return row


def page(query: bus.CatalogQuery, *, default_limit: int) -> tuple[int, int]:
    limit = query.limit or default_limit
    if not 1 <= limit <= 1000:
        raise InvalidRequest(f"limit {limit} is out of range: use 1 to 1000")
    if query.offset < 0:
        raise InvalidRequest(f"offset {query.offset} is out of range: use 0 or more")
    return limit, query.offset


def iso(timestamp: float) -> str:
    return datetime.fromtimestamp(timestamp, UTC).isoformat()
