"""The checkpoint service's SQL catalog, run in this process against a real nats-server, on SQLite
and on PostgreSQL: folded from the log, rebuilt identically after the database is dropped, TTLs
that delete from storage, overwrites that release their old blob, and garbage collection."""

from __future__ import annotations

import asyncio
import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from services.checkpoint.config import CheckpointConfig
from services.checkpoint.handlers import Catalog
from services.checkpoint.projection import SqlProjection
from services.checkpoint.storage import Storage
from tinsmith import catalog, events
from tinsmith._proto import bus_pb2 as bus
from tinsmith.blobs import BlobStore
from tinsmith.bus import Bus
from tinsmith.eventlog import EventLog

RUN = "S1:train:0"
OTHER_RUN = "S2:train:0"


@dataclass
class Service:
    bus: Bus
    projection: SqlProjection
    storage: Storage
    catalog: Catalog

    async def ask(self, op: str, **fields: Any) -> dict[str, Any]:
        handler = self.catalog.operations()[op]
        reply = bus.CatalogReply.FromString(
            await handler(bus.CatalogQuery(**fields).SerializeToString())
        )
        assert not reply.error_kind, reply.error_detail
        body: dict[str, Any] = json.loads(reply.json)
        return body

    async def dump(self) -> dict[str, list[dict[str, Any]]]:
        await self.projection.catch_up()
        async with self.projection.session() as session:
            return await catalog.dump(session)

    async def stop(self) -> None:
        await self.bus.close()
        await self.projection.engine.dispose()


async def start_service(
    nats_url: str,
    catalog_url: str,
    blobs: BlobStore,
    *,
    start_storage: bool = False,
    gather_s: float = 0.0,
) -> Service:
    connection = await Bus.connect(nats_url, name="checkpoint-test")
    eventlog = EventLog(connection)
    projection = SqlProjection(eventlog, catalog.create_engine(catalog_url), gather_s=gather_s)
    storage = Storage(eventlog, projection, blobs, gc_grace_s=3600, gc_interval_s=3600)
    service = Catalog(eventlog, projection, storage, blobs, url_ttl_s=600)
    await projection.start()
    if start_storage:
        storage.start()
    return Service(connection, projection, storage, service)


async def write_blob(blobs: BlobStore, key: str, tmp_path: Path, size: int = 64) -> int:
    local = tmp_path / "artifact"
    local.mkdir(exist_ok=True)
    (local / "adapter_model.safetensors").write_bytes(b"\x01" * size)
    return await blobs.put_dir(key, local)


async def append(eventlog: EventLog, **kind: Any) -> int:
    aggregate = "sampler" if "sampler_created" in kind else "run"
    if "session_created" in kind or "session_finished" in kind:
        aggregate = "session"
    seq, _ = await eventlog.append(events.make(**kind), request_aggregate=aggregate)
    return seq


def saved(model_id: str, segment: str, name: str, key: str, size: int, **extra: Any) -> Any:
    kinds = {"weights": 1, "sampler_weights": 2, "external_weights": 3}
    return bus.WeightsSaved(
        model_id=model_id,
        tinker_path=f"tinker://{model_id}/{segment}/{name}",
        blob_key=key,
        kind=kinds[segment],  # type: ignore[arg-type]
        base_model="tinsmith/tiny",
        lora_rank=4,
        size_bytes=size,
        lora=bus.LoraConfig(rank=4, train_mlp=True, train_attn=True, train_unembed=False),
        **extra,
    )


async def tell_a_story(eventlog: EventLog, blobs: BlobStore, tmp_path: Path) -> None:
    """Two users; a run with checkpoints saved, overwritten, published, given a TTL, deleted;
    a sampler; an unloaded run; finished sessions."""
    for session_id, owner in (("S1", "key-alice"), ("S2", "key-bob")):
        await append(
            eventlog,
            session_created=bus.SessionCreated(
                session_id=session_id,
                owner=owner,
                project_id="proj",
                display_name=f"{owner}'s",
                user_metadata={"k": "v"},
                tags=["t"],
            ),
        )
    for model_id, session_id in ((RUN, "S1"), (OTHER_RUN, "S2")):
        create = bus.CreateModel(
            session_id=session_id,
            base_model="tinsmith/tiny",
            lora=bus.LoraConfig(rank=4, train_mlp=True, train_attn=True),
            user_metadata={"renderer_name": "role_colon", "note": "ünïcode, spaces & {json}"},
        )
        await append(
            eventlog,
            request_accepted=bus.RequestAccepted(
                request_id=f"{model_id}:0", aggregate_id=model_id, seq_id=0, create_model=create
            ),
        )
        await append(eventlog, run_created=bus.RunCreated(model_id=model_id, tokenizer_id="tok"))
    base = f"runs/{RUN}"
    one = await write_blob(blobs, f"{base}/weights/one", tmp_path, 100)
    await append(eventlog, weights_saved=saved(RUN, "weights", "one", f"{base}/weights/one", one))
    s_one = await write_blob(blobs, f"{base}/sampler_weights/s-one", tmp_path, 50)
    await append(
        eventlog,
        weights_saved=saved(
            RUN, "sampler_weights", "s-one", f"{base}/sampler_weights/s-one", s_one
        ),
    )
    again = await write_blob(blobs, f"{base}/weights/one@00000005", tmp_path, 120)
    await append(
        eventlog,
        weights_saved=saved(RUN, "weights", "one", f"{base}/weights/one@00000005", again),
    )
    gone = await write_blob(blobs, f"{base}/weights/gone", tmp_path, 10)
    await append(
        eventlog, weights_saved=saved(RUN, "weights", "gone", f"{base}/weights/gone", gone)
    )
    await blobs.delete(f"{base}/weights/gone")  # as the service deletes: bytes, then the event
    await append(
        eventlog,
        checkpoint_deleted=bus.CheckpointDeleted(
            model_id=RUN,
            tinker_path=f"tinker://{RUN}/weights/gone",
            blob_key=f"{base}/weights/gone",
            reason="deleted",
        ),
    )
    await append(
        eventlog,
        checkpoint_ttl_set=bus.CheckpointTtlSet(
            model_id=RUN,
            tinker_path=f"tinker://{RUN}/sampler_weights/s-one",
            ttl_seconds=7200,
            expires_at=2_000_000_000.0,
        ),
    )
    await append(
        eventlog,
        checkpoint_published=bus.CheckpointPublished(
            model_id=OTHER_RUN, tinker_path=f"tinker://{OTHER_RUN}/weights/b", public=True
        ),
    )
    theirs = await write_blob(blobs, f"runs/{OTHER_RUN}/weights/b", tmp_path, 30)
    await append(
        eventlog,
        weights_saved=saved(OTHER_RUN, "weights", "b", f"runs/{OTHER_RUN}/weights/b", theirs),
    )
    await append(
        eventlog,
        checkpoint_published=bus.CheckpointPublished(
            model_id=OTHER_RUN, tinker_path=f"tinker://{OTHER_RUN}/weights/b", public=True
        ),
    )
    await append(
        eventlog,
        sampler_created=bus.SamplerCreated(
            sampler_id="S1:sample:0",
            session_id="S1",
            base_model="tinsmith/tiny",
            adapter_key=f"{base}/ephemeral/S1:sample:0",
        ),
    )
    await append(
        eventlog,
        run_unloaded=bus.RunUnloaded(
            model_id=RUN, snapshot_key=f"{base}/snapshots/00000009", next_seq_id=9
        ),
    )
    await append(eventlog, session_finished=bus.SessionFinished(session_id="S2", reason="success"))


async def test_dropping_the_database_rebuilds_an_identical_catalog(
    nats_url: str, eventlog: EventLog, blobs: BlobStore, catalog_url: str, tmp_path: Path
) -> None:
    await tell_a_story(eventlog, blobs, tmp_path)
    first = await start_service(nats_url, catalog_url, blobs)
    before = await first.dump()
    runs = await first.ask("training_runs", owner="key-alice")
    assert [r["training_run_id"] for r in runs["training_runs"]] == [RUN]
    assert runs["training_runs"][0]["user_metadata"] == {
        "renderer_name": "role_colon",
        "note": "ünïcode, spaces & {json}",
    }
    listed = await first.ask("checkpoints", owner="key-alice", training_run_id=RUN)
    assert [c["checkpoint_id"] for c in listed["checkpoints"]] == [
        "weights/one",
        "sampler_weights/s-one",
    ]  # newest first; the overwrite is one checkpoint, the deleted one is gone
    assert listed["checkpoints"][0]["size_bytes"] == 120
    await catalog.drop(first.projection.engine)
    await first.stop()

    rebuilt = await start_service(nats_url, catalog_url, blobs)
    assert await rebuilt.dump() == before
    # More events while it runs, then a restart on the same database: it continues from its
    # position, and matches a catalog rebuilt from nothing.
    await append(eventlog, session_finished=bus.SessionFinished(session_id="S1", reason="success"))
    continued = await rebuilt.dump()
    await rebuilt.stop()
    restarted = await start_service(nats_url, catalog_url, blobs)
    assert await restarted.dump() == continued
    await catalog.drop(restarted.projection.engine)
    await restarted.stop()
    again = await start_service(nats_url, catalog_url, blobs)
    assert await again.dump() == continued
    await again.stop()


async def test_live_events_are_folded_together_unless_a_reader_waits(
    nats_url: str, eventlog: EventLog, blobs: BlobStore, tmp_path: Path
) -> None:
    # A gathering that only a reader ends: events that arrive alone wait for company, and a
    # read that waits for the tables has them folded at once, all in one transaction.
    url = f"sqlite+aiosqlite:///{tmp_path / 'c.db'}"
    service = await start_service(nats_url, url, blobs, gather_s=3600.0)
    batches: list[set[str]] = []

    async def folded(released: list[str], kinds: set[str]) -> None:
        batches.append(kinds)

    service.projection.on_folded(folded)
    try:
        for n in range(12):
            await append(
                eventlog,
                session_created=bus.SessionCreated(session_id=f"S{n}", owner="key-alice"),
            )
        await asyncio.sleep(0.5)
        assert batches == []  # no reader: still gathering
        await asyncio.wait_for(service.projection.catch_up(), 30)
        assert batches == [{"session_created"}]
        assert len((await service.ask("sessions", owner="key-alice"))["sessions"]) == 12
    finally:
        await service.stop()


async def test_reads_are_scoped_to_the_caller_and_storage_is_accounted_per_user(
    nats_url: str, eventlog: EventLog, blobs: BlobStore, tmp_path: Path
) -> None:
    await tell_a_story(eventlog, blobs, tmp_path)
    service = await start_service(nats_url, f"sqlite+aiosqlite:///{tmp_path / 'c.db'}", blobs)
    try:
        mine = await service.ask("user_checkpoints", owner="key-alice")
        assert mine["cursor"]["total_count"] == 2
        page = await service.ask("training_runs", owner="key-alice", access_scope="accessible")
        assert {r["training_run_id"] for r in page["training_runs"]} == {RUN, OTHER_RUN}
        assert (await service.ask("sessions", owner="key-bob"))["sessions"] == ["S2"]
        usage = await service.ask("storage_usage", owner="key-bob", admin=True)
        totals = {row["org_user_urn"]: row for row in usage["data"]}
        assert totals["key-alice"]["checkpoint_count"] == 2
        assert totals["key-alice"]["size_bytes"] == 120 + 50
        assert totals["key-bob"]["size_bytes"] == 30
    finally:
        await service.stop()


async def test_an_expired_checkpoint_is_deleted_from_storage(
    nats_url: str, eventlog: EventLog, blobs: BlobStore, tmp_path: Path
) -> None:
    service = await start_service(
        nats_url, f"sqlite+aiosqlite:///{tmp_path / 'c.db'}", blobs, start_storage=True
    )
    try:
        key = f"runs/{RUN}/weights/brief"
        size = await write_blob(blobs, key, tmp_path)
        await append(
            eventlog, weights_saved=saved(RUN, "weights", "brief", key, size, ttl_seconds=1)
        )
        for _ in range(100):
            if not await blobs.exists(key):
                break
            await asyncio.sleep(0.1)
        assert not await blobs.exists(key)
        dump = await service.dump()
        assert dump["checkpoints"] == [] and dump["blobs"] == []
    finally:
        await service.stop()


async def test_an_overwrite_releases_the_blob_it_replaced(
    nats_url: str, eventlog: EventLog, blobs: BlobStore, tmp_path: Path
) -> None:
    service = await start_service(nats_url, f"sqlite+aiosqlite:///{tmp_path / 'c.db'}", blobs)
    try:
        old, new = f"runs/{RUN}/weights/x", f"runs/{RUN}/weights/x@00000007"
        await append(
            eventlog,
            weights_saved=saved(RUN, "weights", "x", old, await write_blob(blobs, old, tmp_path)),
        )
        await append(
            eventlog,
            weights_saved=saved(RUN, "weights", "x", new, await write_blob(blobs, new, tmp_path)),
        )
        await service.projection.catch_up()
        assert not await blobs.exists(old)
        assert await blobs.exists(new)
    finally:
        await service.stop()


async def test_a_run_keeps_its_two_newest_snapshots_and_the_older_ones_are_removed(
    nats_url: str, eventlog: EventLog, blobs: BlobStore, tmp_path: Path
) -> None:
    """Background snapshots (RunSnapshotted) and an unload's (RunUnloaded) are live artifacts,
    never garbage; each new one releases those older than the newest two."""
    service = await start_service(nats_url, f"sqlite+aiosqlite:///{tmp_path / 'c.db'}", blobs)
    try:
        keys = [f"runs/{RUN}/snapshots/{n:08d}" for n in (5, 9, 13)]
        for n, key in zip((5, 9, 13), keys, strict=True):
            await write_blob(blobs, key, tmp_path)
            snapshot = {"model_id": RUN, "snapshot_key": key, "next_seq_id": n, "epoch": 3}
            if n < 13:
                await append(eventlog, run_snapshotted=bus.RunSnapshotted(**snapshot))
            else:
                await append(eventlog, run_unloaded=bus.RunUnloaded(**snapshot))
        await service.projection.catch_up()
        assert [await blobs.exists(key) for key in keys] == [False, True, True]
        snapshots = [row for row in (await service.dump())["blobs"] if row["role"] == "snapshot"]
        assert sorted(row["key"] for row in snapshots) == keys[1:]
    finally:
        await service.stop()


async def test_what_a_trainer_that_lost_the_run_saved_is_not_the_run_s(
    nats_url: str, eventlog: EventLog, blobs: BlobStore, tmp_path: Path
) -> None:
    """A trainer paused or cut off past its lease, whose run another replica took over, may
    still record a checkpoint or a snapshot under its old hold (epoch): the run's own fold
    ignores it (``jobs.fenced``), and so does the catalog, which listed such a checkpoint and
    kept such a snapshot as the run's."""
    run = "S9:train:0"
    service = await start_service(nats_url, f"sqlite+aiosqlite:///{tmp_path / 'c.db'}", blobs)
    try:
        create = bus.CreateModel(session_id="S9", base_model="tinsmith/tiny")
        await append(
            eventlog,
            request_accepted=bus.RequestAccepted(
                request_id=f"{run}:0", aggregate_id=run, seq_id=0, create_model=create
            ),
        )
        for replica, epoch in (("a", 1), ("b", 2)):
            placed = bus.RunPlaced(model_id=run, replica=replica, epoch=epoch, takeover=epoch > 1)
            await append(eventlog, run_placed=placed)
        for name, epoch in (("late", 1), ("own", 2)):  # the old holder's, the new holder's
            key = f"runs/{run}/weights/{name}"
            size = await write_blob(blobs, key, tmp_path)
            await append(
                eventlog, weights_saved=saved(run, "weights", name, key, size, epoch=epoch)
            )
            snapshot = bus.RunSnapshotted(
                model_id=run, snapshot_key=f"runs/{run}/snapshots/{name}", epoch=epoch
            )
            await append(eventlog, run_snapshotted=snapshot)
        tables = await service.dump()
        checkpoints = [
            row["tinker_path"] for row in tables["checkpoints"] if run in row["model_id"]
        ]
        assert checkpoints == [f"tinker://{run}/weights/own"]
        referenced = {row["key"] for row in tables["blobs"] if run in row["key"]}
        assert referenced == {f"runs/{run}/weights/own", f"runs/{run}/snapshots/own"}
    finally:
        await service.stop()


async def test_garbage_collection_removes_unrecorded_blobs_and_logs_them(
    nats_url: str,
    eventlog: EventLog,
    blobs: BlobStore,
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
) -> None:
    await tell_a_story(eventlog, blobs, tmp_path)
    # The blob that "one" was overwritten over is left to garbage collection when the overwrite
    # is replayed (only a live overwrite removes it at once).
    replaced = f"runs/{RUN}/weights/one"
    recorded = [a.key for a in await blobs.artifacts("runs", 4) if a.key != replaced]
    crashed = f"runs/{RUN}/weights/crashed-before-recording"
    await write_blob(blobs, crashed, tmp_path)
    half = Path(blobs.root) / "runs" / RUN / "snapshots" / "00000003"
    half.mkdir(parents=True)
    (half / "adapter_model.safetensors").write_bytes(b"partial")  # never sealed
    service = await start_service(nats_url, f"sqlite+aiosqlite:///{tmp_path / 'c.db'}", blobs)
    try:
        assert await service.storage.collect(grace_s=3600) == []  # too young to be judged
        with caplog.at_level(logging.INFO, logger="services.checkpoint.storage"):
            removed = await service.ask("gc", grace_s=1e-9)
        assert sorted(r["key"] for r in removed["removed"]) == sorted(
            [crashed, replaced, f"runs/{RUN}/snapshots/00000003"]
        )
        assert f"gc: removed orphaned artifact {crashed}" in caplog.text
        left = [a.key for a in await blobs.artifacts("runs", 4)]
        assert sorted(left) == sorted(recorded)
    finally:
        await service.stop()


def test_the_catalog_gathers_for_50_ms_unless_told_otherwise(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("TINSMITH_CATALOG_GATHER_MS", raising=False)
    assert CheckpointConfig.from_env().catalog_gather_s == 0.05
    monkeypatch.setenv("TINSMITH_CATALOG_GATHER_MS", "0")
    assert CheckpointConfig.from_env().catalog_gather_s == 0.0
    monkeypatch.setenv("TINSMITH_CATALOG_GATHER_MS", "12.5")
    assert CheckpointConfig.from_env().catalog_gather_s == 0.0125
    for wrong in ("-1", "soon", "nan"):
        monkeypatch.setenv("TINSMITH_CATALOG_GATHER_MS", wrong)
        with pytest.raises(SystemExit, match="TINSMITH_CATALOG_GATHER_MS="):
            CheckpointConfig.from_env()
