"""The checkpoint catalog's queries, answered from a projection of the event log.

Owns: resolving a tinker:// path to the checkpoint behind it (and checking its bytes are really
in the object store). Does not own: writing checkpoints (the trainer does).
"""

from __future__ import annotations

import json
from datetime import UTC, datetime

from tinsmith import artifacts
from tinsmith._proto import bus_pb2 as bus
from tinsmith.blobs import BlobStore
from tinsmith.eventlog import EventLog, FollowedProjection
from tinsmith.failures import NotFound, TinsmithError


class Catalog:
    def __init__(self, eventlog: EventLog, blobs: BlobStore) -> None:
        self.projection = FollowedProjection(eventlog)
        self.blobs = blobs

    async def start(self) -> None:
        await self.projection.start()

    async def resolve(self, payload: bytes) -> bytes:
        query = bus.ResolveCheckpoint()
        query.ParseFromString(payload)
        try:
            checkpoint = await self._resolve(query.tinker_path)
        except TinsmithError as error:
            return bus.ResolvedCheckpoint(
                error_kind=error.kind, error_detail=error.detail
            ).SerializeToString()
        return bus.ResolvedCheckpoint(checkpoint=checkpoint).SerializeToString()

    async def training_run(self, payload: bytes) -> bytes:
        """``GET /training_runs/{id}``: the run as the SDK's ``TrainingRun``."""
        query = bus.CatalogQuery.FromString(payload)
        state = self.projection.state
        run = state.runs.get(query.training_run_id)
        if run is None:
            await self.projection.catch_up()
            run = state.runs.get(query.training_run_id)
        if run is None:
            error = NotFound(f"no training run {query.training_run_id!r}")
            return bus.CatalogReply(
                error_kind=error.kind, error_detail=error.detail
            ).SerializeToString()
        body = {
            "training_run_id": run.model_id,
            "base_model": run.base_model,
            "model_owner": "local",
            "is_lora": True,
            "corrupted": False,
            "lora_rank": run.lora_rank,
            "last_request_time": _iso(run.last_request_time),
            "last_checkpoint": self._checkpoint(run.last_checkpoint),
            "last_sampler_checkpoint": self._checkpoint(run.last_sampler_checkpoint),
            "user_metadata": dict(run.user_metadata),
        }
        return bus.CatalogReply(json=json.dumps(body).encode()).SerializeToString()

    def _checkpoint(self, tinker_path: str) -> dict[str, object] | None:
        """A ``Checkpoint`` as the SDK's REST types spell it."""
        saved = self.projection.state.checkpoints.get(tinker_path)
        if saved is None:
            return None
        path = artifacts.parse(tinker_path)
        saved_at = self.projection.state.saved_at[tinker_path]
        body: dict[str, object] = {
            "checkpoint_id": f"{artifacts.SEGMENTS[path.kind]}/{path.name}",
            "checkpoint_type": "training"
            if path.kind == bus.CHECKPOINT_KIND_TRAINING
            else "sampler",
            "time": _iso(saved_at),
            "tinker_path": tinker_path,
            "size_bytes": saved.size_bytes,
            "public": False,
        }
        if saved.HasField("ttl_seconds"):
            body["expires_at"] = _iso(saved_at + saved.ttl_seconds)
        return body

    async def _resolve(self, tinker_path: str) -> bus.WeightsSaved:
        artifacts.parse(tinker_path)
        checkpoint = self.projection.state.checkpoints.get(tinker_path)
        if checkpoint is None:
            await self.projection.catch_up()  # saved a moment ago, perhaps
            checkpoint = self.projection.state.checkpoints.get(tinker_path)
        if checkpoint is None:
            raise NotFound(f"no checkpoint at {tinker_path}")
        if not await self.blobs.exists(checkpoint.blob_key):
            raise NotFound(f"the weights of {tinker_path} are no longer in the object store")
        return checkpoint


def _iso(timestamp: float) -> str:
    return datetime.fromtimestamp(timestamp, UTC).isoformat()
