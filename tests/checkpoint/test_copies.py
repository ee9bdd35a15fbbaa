"""Copies of weights and projects in the checkpoint service, against a real nats-server: a copy
has bytes of its own and survives its source, a retry with the same idempotency key finds the
first copy, a session moves into a project with its runs and checkpoints, and all of it (the
audit log included) comes back identically when the catalog is rebuilt from the log, and in a
``jobs.Projection`` replayed from it (what the gateway decides loads and samples on)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from tests.checkpoint.test_catalog import RUN, append, saved, start_service, write_blob
from tinsmith import catalog
from tinsmith._proto import bus_pb2 as bus
from tinsmith.blobs import BlobStore
from tinsmith.eventlog import EventLog, FollowedProjection

SOURCE = f"tinker://{RUN}/weights/one"


async def _story(eventlog: EventLog, blobs: BlobStore, tmp_path: Path) -> None:
    """Alice's run with a checkpoint, and Bob's session."""
    for session_id, owner in (("S1", "key-alice"), ("S2", "key-bob")):
        created = bus.SessionCreated(session_id=session_id, owner=owner, project_id="first")
        await append(eventlog, session_created=created)
    create = bus.CreateModel(
        session_id="S1", base_model="tinsmith/tiny", lora=bus.LoraConfig(rank=4, train_mlp=True)
    )
    await append(
        eventlog,
        request_accepted=bus.RequestAccepted(
            request_id=f"{RUN}:0", aggregate_id=RUN, seq_id=0, create_model=create
        ),
    )
    size = await write_blob(blobs, f"runs/{RUN}/weights/one", tmp_path, 100)
    note = {"user_metadata": {"step": "7"}}
    await append(
        eventlog,
        weights_saved=saved(RUN, "weights", "one", f"runs/{RUN}/weights/one", size, **note),
    )


async def _ask(service: Any, op: str, **fields: Any) -> tuple[str, dict[str, Any]]:
    """The kind of error a catalog operation answers ("" for none), and its JSON."""
    handler = service.catalog.operations()[op]
    reply = bus.CatalogReply.FromString(
        await handler(bus.CatalogQuery(**fields).SerializeToString())
    )
    return reply.error_kind, json.loads(reply.json or b"{}")


async def test_a_copy_is_its_own_checkpoint_and_the_log_rebuilds_it(
    nats_url: str, eventlog: EventLog, blobs: BlobStore, catalog_url: str, tmp_path: Path
) -> None:
    await _story(eventlog, blobs, tmp_path)
    service = await start_service(nats_url, catalog_url, blobs)
    ask = {"owner": "key-alice", "tinker_path": SOURCE, "project_id": "archive"}
    error, first = await _ask(service, "copy_weights", **ask, idempotency_key="k-1")
    assert not error, first
    copy = first["tinker_path"]
    run = copy.removeprefix("tinker://").split("/")[0]
    assert copy == f"tinker://{run}/weights/one" and run.endswith(":train:0")
    assert await _ask(service, "copy_weights", **ask, idempotency_key="k-1") == ("", first)
    error, other = await _ask(service, "copy_weights", **ask, idempotency_key="k-2")
    assert not error and other["tinker_path"] != copy
    # Bob may not read Alice's checkpoint, nor copy into her session.
    assert (await _ask(service, "copy_weights", **{**ask, "owner": "key-bob"}))[0] == "not_found"
    into = {"session_id": "S1", "model_seq_id": 5, "owner": "key-bob", "tinker_path": SOURCE}
    assert (await _ask(service, "copy_weights", **into))[0] == "not_found"

    listed = await service.ask("checkpoints", owner="key-alice", training_run_id=run)
    (checkpoint,) = listed["checkpoints"]
    assert (checkpoint["size_bytes"], checkpoint["user_metadata"]) == (100, {"step": "7"})
    archived = await service.ask("training_runs", owner="key-alice", project_id="archive")
    assert {r["training_run_id"] for r in archived["training_runs"]} == {
        run,
        other["tinker_path"].removeprefix("tinker://").split("/")[0],
    }

    # The source goes; the copy's bytes stay.
    assert await _ask(service, "delete_checkpoint", owner="key-alice", tinker_path=SOURCE) == (
        "",
        {},
    )
    assert not await blobs.exists(f"runs/{RUN}/weights/one")
    assert await blobs.exists(f"runs/{run}/weights/one")

    # Alice's session moves into a project, with its run and what it saved.
    assert await _ask(
        service, "assign_session_project", owner="key-bob", session_id="S1", project_id="x"
    ) == ("not_found", {})
    await service.ask(
        "assign_session_project", owner="key-alice", session_id="S1", project_id="moved"
    )
    moved = await service.ask("training_runs", owner="key-alice", project_id="moved")
    assert [r["training_run_id"] for r in moved["training_runs"]] == [RUN]

    before = await service.dump()
    assert sorted(row["event"] for row in before["audit"]) == sorted(
        [
            "checkpoint_created",
            "checkpoint_copied",
            "checkpoint_copied",
            "checkpoint_deleted",
            "project_session_assigned",
        ]
    )
    await catalog.drop(service.projection.engine)
    await service.stop()
    rebuilt = await start_service(nats_url, catalog_url, blobs)
    assert await rebuilt.dump() == before
    await rebuilt.stop()

    # What the gateway folds from the same log: the copy is Alice's, loadable, never trained.
    replayed = FollowedProjection(eventlog)
    await replayed.start()
    state = replayed.state
    held = state.runs[run]
    assert (held.owner, held.copied_from, held.ready) == ("key-alice", SOURCE, True)
    assert state.sessions[held.session_id].finished
    assert state.checkpoints[copy].blob_key == f"runs/{run}/weights/one"
    assert SOURCE not in state.checkpoints
    assert state.usage("key-alice").checkpoint_bytes == 200  # the two copies
