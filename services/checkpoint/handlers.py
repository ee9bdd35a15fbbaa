"""The checkpoint catalog's queries, answered from a projection of the event log.

Owns: resolving a tinker:// path to the checkpoint behind it (and checking its bytes are really
in the object store). Does not own: writing checkpoints (the trainer does).
"""

from __future__ import annotations

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
