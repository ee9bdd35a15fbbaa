"""The checkpoint events in the pure folds: a deleted checkpoint leaves the projection (so its
name can be saved again), and only the save it names."""

from __future__ import annotations

from tinsmith import events, jobs
from tinsmith._proto import bus_pb2 as bus

PATH = "tinker://S:train:0/weights/a"


def _saved(key: str) -> bus.Event:
    return events.make(
        weights_saved=bus.WeightsSaved(
            model_id="S:train:0", tinker_path=PATH, blob_key=key, kind=bus.CHECKPOINT_KIND_TRAINING
        )
    )


def _deleted(key: str) -> bus.Event:
    return events.make(
        checkpoint_deleted=bus.CheckpointDeleted(
            model_id="S:train:0", tinker_path=PATH, blob_key=key
        )
    )


def test_checkpoint_events_belong_to_their_run() -> None:
    for kind in ("checkpoint_deleted", "checkpoint_published", "checkpoint_ttl_set"):
        body = {"model_id": "S:train:0", "tinker_path": PATH}
        message = {
            "checkpoint_deleted": bus.CheckpointDeleted,
            "checkpoint_published": bus.CheckpointPublished,
            "checkpoint_ttl_set": bus.CheckpointTtlSet,
        }[kind](**body)
        assert events.aggregate_of(events.make(**{kind: message})) == ("run", "S:train:0")


def test_a_deleted_checkpoint_leaves_the_projection() -> None:
    projection = jobs.Projection()
    projection.apply(1, _saved("runs/S:train:0/weights/a"))
    projection.apply(2, _saved("runs/S:train:0/weights/a@00000009"))  # overwritten
    projection.apply(3, _deleted("runs/S:train:0/weights/a"))  # the old save: nothing changes
    assert PATH in projection.checkpoints
    projection.apply(4, _deleted("runs/S:train:0/weights/a@00000009"))
    assert PATH not in projection.checkpoints and PATH not in projection.saved_at
