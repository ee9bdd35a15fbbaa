"""Copies of weights (``copy_weights``): a checkpoint the caller may read, copied into a new run
of the caller's that holds the copy alone.

Owns: where a copy goes (a new session for it, or a run slot of a session of the caller's), what
makes a retry find the first copy (the client's idempotency key), copying the bytes, and the
``WeightsCopied`` event. Does not own: who may read the source (access.py's rules, through
``Catalog._checkpoint``), the tables (tinsmith/catalog.py), or the gateway's refusal to train on
a copy's run (services/gateway/operations.py).

How a copy shares storage: it does not. The copy's files are copied, within the object store
(S3 and GCS copy server-side), to the copy's own key under its run (``runs/<run>/...``), before
the event records it. So a copy is a checkpoint like any other, for the TTL clock, deletes,
overwrites and garbage collection alike: deleting the source or the copy never touches the
other, and a copy that failed half way is an unrecorded artifact that garbage collection removes.
A LoRA adapter is small beside its base model; references shared between checkpoints would need
a count that every delete, overwrite and expiry consults, for little saved.

Idempotency. The SDK sends one ``X-Idempotency-Key`` with every retry of a copy. A copy into a
new session takes its session id from the tenant and that key (a UUID5), so a retry finds the
run the first attempt made and answers its path, whatever the checkpoint became since; the
event is appended with the run id as its message id, so two attempts record it once. A copy into
a given run slot (``session_id`` and ``model_seq_id``) is idempotent by the slot: a slot holding
a copy of the same source answers that copy. Attempts of the same copy wait for each other in
this process, so one copies while the other waits for its answer.
"""

from __future__ import annotations

import asyncio
import uuid
from typing import Any

from tinsmith import artifacts, catalog, events, subjects
from tinsmith._proto import bus_pb2 as bus
from tinsmith.blobs import BlobStore
from tinsmith.eventlog import EventLog
from tinsmith.failures import InvalidRequest, NotFound
from tinsmith.limits import INT32_MAX, TTL_MAX_S, TTL_MIN_S

from . import access
from .projection import SqlProjection

JsonDict = dict[str, Any]
# The namespace of the session ids of copies: uuid5(namespace, tenant + key).
_SESSIONS = uuid.UUID("6b0c2f0e-5a43-4f4e-9d0e-2f3c1c7a9b11")
MAX_PROJECT_ID = 200


class Copies:
    def __init__(self, eventlog: EventLog, projection: SqlProjection, blobs: BlobStore) -> None:
        self.log = eventlog
        self.projection = projection
        self.blobs = blobs
        self._running: dict[str, asyncio.Lock] = {}

    async def copy_weights(
        self, query: bus.CatalogQuery, source: catalog.CheckpointRow
    ) -> JsonDict:
        """Copy ``source`` (a checkpoint the caller may read: the catalog checked) as the query
        asks; answer ``{"tinker_path": <the copy>}``."""
        ttl = query.ttl_seconds if query.HasField("ttl_seconds") else None
        if ttl is not None and not TTL_MIN_S <= ttl <= TTL_MAX_S:
            raise InvalidRequest(
                f"ttl_seconds {ttl} is out of range: use {TTL_MIN_S} (an hour) to {TTL_MAX_S} "
                "(ten years), or leave it out for a copy that never expires"
            )
        session_id, model_seq_id = await self._destination(query)
        model_id = subjects.check_id("model_id", f"{session_id}:train:{model_seq_id}")
        lock = self._running.setdefault(model_id, asyncio.Lock())
        try:
            async with lock:
                return await self._copy(query, source, session_id, model_id, ttl)
        finally:
            if not lock.locked() and self._running.get(model_id) is lock:
                del self._running[model_id]

    async def _destination(self, query: bus.CatalogQuery) -> tuple[str, int]:
        """The session and run slot of the copy: the caller's session it names, or a session
        of its own for it, whose id the idempotency key makes the same for every retry."""
        if query.session_id:
            if not query.HasField("model_seq_id") or not 0 <= query.model_seq_id <= INT32_MAX:
                raise InvalidRequest(
                    "copy_weights into a session needs 'model_seq_id', the run slot of the copy "
                    f"in it (0 to {INT32_MAX}), as create_model takes it"
                )
            await self.projection.catch_up()
            async with self.projection.session() as session:
                await access.find_session(session, query, query.session_id)
            return query.session_id, int(query.model_seq_id)
        if not query.project_id:
            raise InvalidRequest(
                "copy_weights needs 'destination_project_id' (the project of the copy's new "
                "session), or 'session_id' and 'model_seq_id' (a run slot in a session of yours)"
            )
        key = query.idempotency_key or str(uuid.uuid4())  # none: every call is a new copy
        return str(uuid.uuid5(_SESSIONS, f"{query.owner}\n{key}")), 0

    async def _copy(
        self,
        query: bus.CatalogQuery,
        source: catalog.CheckpointRow,
        session_id: str,
        model_id: str,
        ttl: int | None,
    ) -> JsonDict:
        origin = artifacts.parse(source.tinker_path)
        target = artifacts.TinkerPath(model_id, origin.kind, origin.name)
        await self.projection.catch_up()
        async with self.projection.session() as session:
            taken = await session.get(catalog.RunRow, model_id)
        if taken is not None:
            if taken.owner == query.owner and taken.loaded_from == source.tinker_path:
                return {"tinker_path": str(target)}  # a retry: the first copy's answer
            if query.idempotency_key and not query.session_id:
                raise InvalidRequest(
                    f"the X-Idempotency-Key {query.idempotency_key[:80]!r} was used for another "
                    "copy; send each copy with a key of its own"
                )
            raise InvalidRequest(
                f"model_seq_id {model_id.rpartition(':')[2]} of session {session_id} is taken "
                f"by run {model_id}; copy into a model_seq_id no run of the session has"
            )
        try:
            size = await self.blobs.copy_dir(source.blob_key, target.key)
        except FileNotFoundError:
            raise NotFound(f"the files of {source.tinker_path} are no longer in storage") from None
        saved = bus.WeightsSaved(
            model_id=model_id,
            tinker_path=str(target),
            blob_key=target.key,
            kind=origin.kind,
            base_model=source.base_model,
            lora_rank=source.lora_rank,
            size_bytes=size,
            # The notes go along to the source's owner's copy only: publishing shares weights.
            user_metadata=source.user_metadata if access.owns(query, source.owner) else {},
            lora=bus.LoraConfig(
                rank=source.lora_rank,
                train_mlp=source.train_mlp,
                train_attn=source.train_attn,
                train_unembed=source.train_unembed,
            ),
        )
        if ttl is not None:
            saved.ttl_seconds = ttl
        copied = bus.WeightsCopied(
            model_id=model_id,
            session_id=session_id,
            owner=query.owner,
            project_id=query.project_id,
            source_path=source.tinker_path,
            idempotency_key=query.idempotency_key,
            saved=saved,
        )
        seq, _ = await self.log.append(
            events.make(weights_copied=copied), msg_id=f"copy:{model_id}"
        )
        await self.projection.wait_for(seq)
        return {"tinker_path": str(target)}
