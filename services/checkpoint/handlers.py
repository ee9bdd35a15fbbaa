"""The catalog's answers: every REST read and change the gateway forwards, from the SQL read
models. (What a tinker:// path refers to, for loads and samplers, the gateway reads from its own
projection of the log: services/gateway/operations.py.)

Owns: the Tinker REST JSON of training runs, checkpoints, sessions and storage usage; who may
see or change what; and turning deletes, publishes and TTLs into events. Does not own: the
tables (tinsmith/catalog.py), following the log (projection.py), the object store
(storage.py), copies of weights (copies.py), projects and session search (sessions.py), the
audit log and billing usage (ledger.py), or how runs go (progress.py).

Every answer waits until the catalog reflects the whole log as it was when the question arrived,
so a client reads its own writes (a checkpoint listed as soon as save_state returned).

Who may see or change what (``CatalogQuery.owner`` is the calling tenant):

- A tenant owns its sessions and the runs, samplers and checkpoints made in them. No row belongs
  to everyone: a query with an empty owner sees nothing (published checkpoints included), and
  rows with an empty owner (logs older than tenants) are nobody's; only an admin's storage usage
  still counts them.
- Whatever is not the caller's answers NotFound with exactly the detail an id that does not
  exist gets: a 404, never a 403, so existence is not revealed. That holds for every operation
  on a run, a checkpoint or a session.
- A published checkpoint (of a run that has a tenant) is the one exception: every tenant may
  read it (``weights_info``, ``external_weights_urls``, ``checkpoint_archive_url``), and
  ``access_scope=accessible`` lists its run (``training_runs``, ``training_run``,
  ``checkpoints``); only its owner may change it (delete, publish, unpublish, TTL: NotFound for
  anyone else).
- ``storage_usage`` is the caller's own; an admin (``CatalogQuery.admin``) gets every tenant's,
  a row per tenant and project.
- Download URLs that the gateway serves are signed for the calling tenant (tinsmith/blobs.py);
  the gateway checks, on download, that the tenant may still read the checkpoint.

What another tenant sees of a run listed because of a published checkpoint, field by field
(``_training_run`` and ``_checkpoint`` with ``owned=False``):

- ``training_run_id``, ``base_model``, ``lora_rank``, ``is_lora``, ``corrupted``: as for the
  owner. Loading the published weights needs them, and ``weights_info`` tells them anyway.
- ``model_owner``: ``""``. The SDK requires a string; the tenant's name is the owner's (an open
  mode tenant's name is a digest of its API key).
- ``last_request_time``: the time of the run's newest published checkpoint, not of its last
  request (when a run trains is private).
- ``last_checkpoint``, ``last_sampler_checkpoint``: the newest published checkpoint of each type,
  or null. Never the newest overall: null for a private newer one would reveal it exists.
- ``user_metadata`` of the run: null.
- Its checkpoints (``checkpoints``, and the two above): only the published ones, each with
  ``checkpoint_id``, ``checkpoint_type``, ``time``, ``tinker_path``, ``size_bytes`` and ``public``
  as the owner sees them, and ``expires_at`` too (when the weights go away is what a reader of
  them needs to know); ``user_metadata`` null (publishing shares the weights, not the notes).
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any

from sqlalchemy.ext.asyncio import AsyncSession

from tinsmith import artifacts, catalog, events
from tinsmith._proto import bus_pb2 as bus
from tinsmith.blobs import BlobStore
from tinsmith.eventlog import EventLog
from tinsmith.failures import InvalidRequest, NotFound, TinsmithError
from tinsmith.limits import TTL_MAX_S, TTL_MIN_S

from . import access
from .copies import Copies
from .ledger import Ledger
from .progress import Progress
from .projection import SqlProjection
from .sessions import Sessions
from .storage import Storage

log = logging.getLogger(__name__)

JsonDict = dict[str, Any]
_GIGABYTE = 1024**3


class Catalog:
    def __init__(
        self,
        eventlog: EventLog,
        projection: SqlProjection,
        storage: Storage,
        blobs: BlobStore,
        *,
        url_ttl_s: int,
    ) -> None:
        self.log = eventlog
        self.projection = projection
        self.storage = storage
        self.blobs = blobs
        self.url_ttl_s = url_ttl_s
        self.progress = Progress(eventlog, projection, blobs, url_ttl_s=url_ttl_s)
        self.copies = Copies(eventlog, projection, blobs)
        self.projects = Sessions(eventlog, projection)  # projects and search
        self.ledger = Ledger(projection)

    def operations(self) -> dict[str, Callable[[bytes], Awaitable[bytes]]]:
        """Each catalog operation (tinsmith/subjects.CATALOG_OPS) and its bus handler."""
        ops: dict[str, Callable[[bus.CatalogQuery], Awaitable[Any]]] = {
            "training_run": self.training_run,
            "training_runs": self.training_runs,
            "checkpoints": self.checkpoints,
            "user_checkpoints": self.user_checkpoints,
            "weights_info": self.weights_info,
            "sessions": self.sessions,
            "session": self.session,
            "delete_checkpoint": self.delete_checkpoint,
            "publish_checkpoint": self.publish_checkpoint,
            "set_checkpoint_ttl": self.set_checkpoint_ttl,
            "external_weights_urls": self.external_weights_urls,
            "checkpoint_archive_url": self.checkpoint_archive_url,
            "storage_usage": self.storage_usage,
            "gc": self.gc,
            "run_metrics": self.progress.run_metrics,
            "run_requests": self.progress.run_requests,
            "report_metrics": self.progress.report_metrics,
            "console_runs": self.progress.console_runs,
            "sweep": self.progress.sweep,
            "trace_export": self.progress.trace_export,
            "copy_weights": self.copy_weights,
            "assign_session_project": self.projects.assign_project,
            "search_sessions": self.projects.search,
            "audit_log": self.ledger.audit_log,
            "billing_usage": self.ledger.billing_usage,
        }
        return {name: _answer(name, fn) for name, fn in ops.items()}

    # -- reads ---------------------------------------------------------------------------------

    async def training_run(self, query: bus.CatalogQuery) -> JsonDict:
        await self.projection.catch_up()
        async with self.projection.session() as session:
            run = await access.find_run(session, query, query.training_run_id)
            return await _training_run(session, run, owned=access.owns(query, run.owner))

    async def training_runs(self, query: bus.CatalogQuery) -> JsonDict:
        limit, offset = access.page(query, default_limit=20)
        await self.projection.catch_up()
        async with self.projection.session() as session:
            rows, total = await catalog.runs(
                session,
                owner=query.owner,
                accessible=access.accessible(query),
                project_id=query.project_id,
                limit=limit,
                offset=offset,
            )
            return {
                "training_runs": [
                    await _training_run(session, row, owned=access.owns(query, row.owner))
                    for row in rows
                ],
                "cursor": {"offset": offset, "limit": limit, "total_count": total},
            }

    async def checkpoints(self, query: bus.CatalogQuery) -> JsonDict:
        await self.projection.catch_up()
        async with self.projection.session() as session:
            run = await access.find_run(session, query, query.training_run_id)
            owned = access.owns(query, run.owner)
            rows = await catalog.checkpoints_of(session, run.model_id, published_only=not owned)
        return {
            "checkpoints": [_checkpoint(row, owned=owned) for row in rows],
            "cursor": {"offset": 0, "limit": len(rows), "total_count": len(rows)},
        }

    async def user_checkpoints(self, query: bus.CatalogQuery) -> JsonDict:
        limit, offset = access.page(query, default_limit=100)
        await self.projection.catch_up()
        async with self.projection.session() as session:
            rows, total = await catalog.user_checkpoints(
                session, owner=query.owner, limit=limit, offset=offset
            )
        return {
            "checkpoints": [_checkpoint(row, owned=True) for row in rows],
            "cursor": {"offset": offset, "limit": limit, "total_count": total},
        }

    async def weights_info(self, query: bus.CatalogQuery) -> JsonDict:
        row = await self._checkpoint(query, mine=False)
        return {
            "base_model": row.base_model,
            "is_lora": True,
            "lora_rank": row.lora_rank,
            "optimizer_config": {"type": "adamw"},
            "train_unembed": row.train_unembed,
            "train_mlp": row.train_mlp,
            "train_attn": row.train_attn,
        }

    async def sessions(self, query: bus.CatalogQuery) -> JsonDict:
        limit, offset = access.page(query, default_limit=20)
        await self.projection.catch_up()
        async with self.projection.session() as session:
            rows = await catalog.sessions(session, owner=query.owner, limit=limit, offset=offset)
        return {"sessions": [row.session_id for row in rows]}

    async def session(self, query: bus.CatalogQuery) -> JsonDict:
        await self.projection.catch_up()
        async with self.projection.session() as session:
            row = await access.find_session(session, query, query.session_id)
            run_ids, sampler_ids = await catalog.session_members(session, row.session_id)
        body: JsonDict = {
            "training_run_ids": run_ids,
            "sampler_ids": sampler_ids,
            "user_metadata": row.user_metadata,
        }
        if row.display_name:
            body["display_name"] = row.display_name
        return body

    async def storage_usage(self, query: bus.CatalogQuery) -> JsonDict:
        """Live checkpoints and their bytes, per tenant and project (``billing/usage/checkpoints/
        current``): the caller's own, or every tenant's for an admin."""
        await self.projection.catch_up()
        async with self.projection.session() as session:
            rows = await catalog.storage_usage(
                session, query.project_id, owner=None if query.admin else query.owner
            )
        return {
            "data": [
                {
                    "project_id": project or None,
                    "org_user_urn": owner or None,
                    "checkpoint_count": count,
                    "size_bytes": size,
                    "size_gigabytes": size / _GIGABYTE,
                }
                for owner, project, count, size in rows
            ]
        }

    async def external_weights_urls(self, query: bus.CatalogQuery) -> JsonDict:
        """A URL per file of the checkpoint that a plain HTTP GET downloads: presigned by the
        object store where it can (s3://, gs://), else served and checked by the gateway, signed
        for the calling tenant."""
        row = await self._checkpoint(query, mine=False)
        expires = int(time.time()) + self.url_ttl_s
        try:
            files = await self.blobs.files(row.blob_key)
        except FileNotFoundError:
            raise NotFound(f"the files of {row.tinker_path} are no longer in storage") from None
        if self.blobs.presigns:
            urls = {
                name: self.blobs.presigned_url(row.blob_key, name, self.url_ttl_s)
                for name in sorted(files)
            }
        else:
            if not query.base_url:
                raise InvalidRequest("download URLs need the gateway's base URL")
            urls = {
                name: f"{query.base_url}/api/v1/blobs/"
                + self.blobs.signed_query(row.blob_key, name, expires=expires, tenant=query.owner)
                for name in sorted(files)
            }
        return {"urls": urls, "expires": access.iso(expires)}

    async def checkpoint_archive_url(self, query: bus.CatalogQuery) -> JsonDict:
        """The URL of the checkpoint as one tar archive (``get_checkpoint_archive_url`` of tinker
        0.34.0 and before): the gateway streams it from the store, whichever store it is, so the
        URL is always the gateway's, signed for the calling tenant."""
        row = await self._checkpoint(query, mine=False)
        if not await self.blobs.exists(row.blob_key):
            raise NotFound(f"the files of {row.tinker_path} are no longer in storage")
        if not query.base_url:
            raise InvalidRequest("an archive's URL needs the gateway's base URL")
        expires = int(time.time()) + self.url_ttl_s
        signed = self.blobs.signed_archive_query(row.blob_key, expires=expires, tenant=query.owner)
        return {"url": f"{query.base_url}/api/v1/archives/{signed}", "expires": access.iso(expires)}

    # -- changes -------------------------------------------------------------------------------

    async def delete_checkpoint(self, query: bus.CatalogQuery) -> JsonDict:
        row = await self._checkpoint(query, mine=True)
        await self.storage.delete(row, "deleted")
        return {}

    async def publish_checkpoint(self, query: bus.CatalogQuery) -> JsonDict:
        row = await self._checkpoint(query, mine=True)
        if row.public != query.public:
            published = bus.CheckpointPublished(
                model_id=row.model_id, tinker_path=row.tinker_path, public=query.public
            )
            await self._append(events.make(checkpoint_published=published))
        return {}

    async def set_checkpoint_ttl(self, query: bus.CatalogQuery) -> JsonDict:
        row = await self._checkpoint(query, mine=True)
        ttl_set = bus.CheckpointTtlSet(model_id=row.model_id, tinker_path=row.tinker_path)
        if query.HasField("ttl_seconds"):
            if not TTL_MIN_S <= query.ttl_seconds <= TTL_MAX_S:
                raise InvalidRequest(
                    f"ttl_seconds {query.ttl_seconds} is out of range: use {TTL_MIN_S} (an hour) "
                    f"to {TTL_MAX_S} (ten years), or null to remove the expiry"
                )
            ttl_set.ttl_seconds = query.ttl_seconds
            ttl_set.expires_at = time.time() + query.ttl_seconds
        await self._append(events.make(checkpoint_ttl_set=ttl_set))
        return {}

    async def copy_weights(self, query: bus.CatalogQuery) -> JsonDict:
        """Copy a checkpoint the caller may read (its own, or a published one) into a new run of
        its own (copies.py)."""
        source = await self._checkpoint(query, mine=False)
        return await self.copies.copy_weights(query, source)

    async def gc(self, query: bus.CatalogQuery) -> JsonDict:
        grace = query.grace_s if query.grace_s > 0 else self.storage.gc_grace_s
        return {"removed": await self.storage.collect(grace)}

    async def _checkpoint(self, query: bus.CatalogQuery, *, mine: bool) -> catalog.CheckpointRow:
        """The checkpoint a query names. Changing it (``mine``) needs its owner; reading it, its
        owner or its publication. Anything else is NotFound, worded the same whether the
        checkpoint exists or not."""
        path = artifacts.parse(query.tinker_path)
        await self.projection.catch_up()
        async with self.projection.session() as session:
            row = await session.get(catalog.CheckpointRow, str(path))
        if row is not None and access.owns(query, row.owner):
            return row
        if row is not None and not mine and query.owner and row.owner and row.public:
            return row
        if mine:
            raise NotFound(f"no checkpoint {path} of this tenant (only its owner may change it)")
        raise NotFound(f"no checkpoint {path} of this tenant, nor a published one")

    async def _append(self, event: bus.Event) -> None:
        seq, _ = await self.log.append(event)
        await self.projection.wait_for(seq)


async def _training_run(session: AsyncSession, run: catalog.RunRow, *, owned: bool) -> JsonDict:
    """A ``TrainingRun`` as the SDK's REST types spell it: for its owner, ``user_metadata``
    exactly as sent; for another tenant, only what its published checkpoints tell (the module
    docstring, field by field)."""
    public = not owned
    training = await catalog.latest_checkpoint(
        session, run.model_id, "training", published_only=public
    )
    sampler = await catalog.latest_checkpoint(
        session, run.model_id, "sampler", published_only=public
    )
    last_request_time = run.last_request_time
    if public:
        newest = await catalog.latest_checkpoint(session, run.model_id, None, published_only=True)
        # No published checkpoint only if it was unpublished since the run was found.
        last_request_time = newest.created_at if newest else run.created_at
    return {
        "training_run_id": run.model_id,
        "base_model": run.base_model,
        "model_owner": run.owner if owned else "",
        "is_lora": True,
        "corrupted": False,
        "lora_rank": run.lora_rank,
        "last_request_time": access.iso(last_request_time),
        "last_checkpoint": _checkpoint(training, owned=owned) if training else None,
        "last_sampler_checkpoint": _checkpoint(sampler, owned=owned) if sampler else None,
        "user_metadata": dict(run.user_metadata) if owned else None,
    }


def _checkpoint(row: catalog.CheckpointRow, *, owned: bool) -> JsonDict:
    """A ``Checkpoint`` as the SDK's REST types spell it; another tenant (who is shown published
    checkpoints only) does not get its ``user_metadata``."""
    body: JsonDict = {
        "checkpoint_id": row.checkpoint_id,
        "checkpoint_type": row.checkpoint_type,
        "time": access.iso(row.created_at),
        "tinker_path": row.tinker_path,
        "size_bytes": row.size_bytes,
        "public": row.public,
        "user_metadata": (dict(row.user_metadata) or None) if owned else None,
        "expires_at": access.iso(row.expires_at) if row.expires_at is not None else None,
    }
    return body


def _answer(
    name: str, fn: Callable[[bus.CatalogQuery], Awaitable[JsonDict]]
) -> Callable[[bytes], Awaitable[bytes]]:
    """A bus handler: a CatalogQuery in, a CatalogReply out, an error as its kind and detail."""

    async def handle(payload: bytes) -> bytes:
        try:
            body = await fn(bus.CatalogQuery.FromString(payload))
        except TinsmithError as error:
            return bus.CatalogReply(
                error_kind=error.kind, error_detail=error.detail
            ).SerializeToString()
        except Exception as exc:
            log.exception("catalog operation %s failed", name)
            return bus.CatalogReply(
                error_kind="internal", error_detail=f"the catalog's {name} failed: {exc}"
            ).SerializeToString()
        return bus.CatalogReply(json=json.dumps(body).encode()).SerializeToString()

    return handle
