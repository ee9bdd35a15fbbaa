"""The catalog's record of how runs go, folded from a log written here: metrics combined across a
step's requests as the SDK combines chunks, outcomes of a trainer that lost its run fenced off,
samples charted only for their own tenant's run, a step's non-finite loss kept as such, and all
of it rebuilt identically from the log."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tinsmith import catalog, events
from tinsmith._proto import bus_pb2 as bus
from tinsmith._proto import tinker_public_pb2 as tp
from tinsmith.blobs import BlobStore
from tinsmith.eventlog import EventLog

from .test_catalog import append, start_service

RUN = "S1:train:0"
ALICE, BOB = "key-alice", "key-bob"


async def _accept(eventlog: EventLog, request_id: str, aggregate: str, **command: Any) -> None:
    seq_id = int(request_id.rsplit(":", 1)[1])
    accepted = bus.RequestAccepted(
        request_id=request_id, aggregate_id=aggregate, seq_id=seq_id, **command
    )
    kind = "sampler" if "sample" in command else "run"
    await eventlog.append(events.make(request_accepted=accepted), request_aggregate=kind)


async def _complete(
    eventlog: EventLog,
    request_id: str,
    aggregate: str,
    epoch: int = 0,
    metrics: dict[str, float] | None = None,
) -> None:
    done = bus.RequestCompleted(
        request_id=request_id,
        aggregate_id=aggregate,
        compute_seconds=0.5,
        started=1.0,
        epoch=epoch,
        metrics=metrics or {},
    )
    await eventlog.append(
        events.make(request_completed=done),
        request_aggregate="sampler" if ":sample:" in aggregate else "run",
    )


def _fb(datums: int) -> dict[str, Any]:
    data = [tp.Datum() for _ in range(datums)]
    return {"forward_backward": tp.ForwardBackwardRequest(loss_fn="cross_entropy", data=data)}


async def _story(eventlog: EventLog) -> None:
    for session_id, owner in (("S1", ALICE), ("S2", BOB)):
        await append(
            eventlog, session_created=bus.SessionCreated(session_id=session_id, owner=owner)
        )
    create = bus.CreateModel(
        session_id="S1", base_model="tinsmith/tiny", lora=bus.LoraConfig(rank=4)
    )
    await _accept(eventlog, f"{RUN}:0", RUN, create_model=create)
    await _complete(eventlog, f"{RUN}:0", RUN)
    await append(eventlog, run_placed=bus.RunPlaced(model_id=RUN, replica="a", epoch=1))
    # Step 0: a batch in two chunks (3 and 1 datums), then the optim_step.
    await _accept(eventlog, f"{RUN}:1", RUN, **_fb(3))
    await _accept(eventlog, f"{RUN}:2", RUN, **_fb(1))
    await _complete(
        eventlog, f"{RUN}:1", RUN, 1, {"loss:sum": 3.0, "acc:mean": 0.5, "top:max": 2.0}
    )
    await _complete(
        eventlog, f"{RUN}:2", RUN, 1, {"loss:sum": 1.0, "acc:mean": 1.0, "top:max": 1.0}
    )
    await _accept(eventlog, f"{RUN}:3", RUN, optim_step=bus.OptimStep())
    await _complete(eventlog, f"{RUN}:3", RUN, 1, {"grad_norm:mean": 0.7})
    # Another replica takes the run over; the old one's late outcome is fenced off.
    await append(
        eventlog, run_placed=bus.RunPlaced(model_id=RUN, replica="b", epoch=2, takeover=True)
    )
    await _accept(eventlog, f"{RUN}:4", RUN, **_fb(2))
    await _complete(eventlog, f"{RUN}:4", RUN, 1, {"loss:sum": 99.0})
    await _complete(eventlog, f"{RUN}:4", RUN, 2, {"loss:sum": float("nan")})
    await _complete(eventlog, f"{RUN}:4", RUN, 2, {"loss:sum": 5.0})  # a repeat: the first wins
    # Samples of the run's weights: its tenant's count toward it, another tenant's do not.
    key = f"runs/{RUN}/sampler_weights/s"
    for sampler, session_id in (("S1:sample:0", "S1"), ("S2:sample:0", "S2")):
        await append(
            eventlog,
            sampler_created=bus.SamplerCreated(
                sampler_id=sampler, session_id=session_id, base_model="tinsmith/tiny"
            ),
        )
        await _accept(
            eventlog, f"{sampler}:1", sampler, sample=bus.Sample(adapter_key=key, prompt=[1, 2])
        )
        await _complete(eventlog, f"{sampler}:1", sampler, 0, {"sample/sampled_tokens:sum": 4})


async def test_a_runs_metrics_by_step_fold_as_the_sdk_combines_them(
    nats_url: str, eventlog: EventLog, blobs: BlobStore, catalog_url: str
) -> None:
    await _story(eventlog)
    service = await start_service(nats_url, catalog_url, blobs)
    try:
        kept = await service.ask("run_metrics", owner=ALICE, training_run_id=RUN)
        assert kept["steps"] == 1
        metrics = kept["metrics"]
        assert metrics["loss:sum"] == [[0, 4.0], [1, None]]  # step 1's loss was not finite
        assert metrics["acc:mean"] == [[0, pytest.approx(0.625)]]  # weighted by datums 3:1
        assert metrics["top:max"] == [[0, 2.0]]
        assert metrics["grad_norm:mean"] == [[0, 0.7]]
        assert metrics["sample/sampled_tokens:sum"] == [[1, 4.0]]  # Alice's sample alone

        requests = await service.ask("run_requests", owner=ALICE, training_run_id=RUN)
        ids = [r["request_id"] for r in requests["requests"]]
        assert ids == ["S1:sample:0:1", f"{RUN}:4", f"{RUN}:3", f"{RUN}:2", f"{RUN}:1", f"{RUN}:0"]
        assert requests["requests"][1]["step"] == 1 and requests["requests"][2]["step"] == 0

        runs = await service.ask("console_runs", owner=ALICE)
        (run,) = runs["runs"]
        assert run["last_loss"] is None and run["sparkline"] == [4.0, None]
        assert run["status"] == "idle" and run["loss_fn"] == "cross_entropy"
        assert (await service.ask("console_runs", owner=BOB))["runs"] == []

        before = await service.dump()
        await catalog.drop(service.projection.engine)
    finally:
        await service.stop()
    await _assert_rebuilt(before, nats_url, catalog_url, blobs)


async def _assert_rebuilt(
    before: dict[str, list[dict[str, Any]]], nats_url: str, catalog_url: str, blobs: BlobStore
) -> None:
    """A checkpoint service started on the dropped catalog replays the log into ``before``."""
    rebuilt = await start_service(nats_url, catalog_url, blobs)
    try:
        assert await rebuilt.dump() == before
    finally:
        await rebuilt.stop()


async def test_a_run_s_progress_is_its_tenant_s_alone(
    nats_url: str, eventlog: EventLog, blobs: BlobStore, tmp_path: Path
) -> None:
    await _story(eventlog)
    service = await start_service(nats_url, f"sqlite+aiosqlite:///{tmp_path / 'c.db'}", blobs)
    try:
        for op in ("run_metrics", "run_requests"):
            reply = await _raw(service, op, owner=BOB, training_run_id=RUN)
            assert reply.error_kind == "not_found", op
        reply = await _raw(
            service, "report_metrics", owner=BOB, training_run_id=RUN, metrics={"x": 1.0}
        )
        assert reply.error_kind == "not_found"
        reply = await _raw(service, "trace_export", owner=BOB, session_id="S1", base_url="http://x")
        assert reply.error_kind == "not_found"
    finally:
        await service.stop()


async def _raw(service: Any, op: str, **fields: Any) -> bus.CatalogReply:
    handler = service.catalog.operations()[op]
    return bus.CatalogReply.FromString(
        await handler(bus.CatalogQuery(**fields).SerializeToString())
    )


async def test_metrics_folded_event_by_event_equal_those_of_one_replay(
    nats_url: str, eventlog: EventLog, blobs: BlobStore, catalog_url: str
) -> None:
    """Folded live (each event in a transaction of its own, the step's rows already stored) and
    replayed at once (the rows of a step not stored yet), the tables are the same: the metric
    rows read ahead from a run's reached step cover every row a batch adds to."""
    service = await start_service(nats_url, catalog_url, blobs)
    try:
        await _story(eventlog)
        await service.projection.catch_up()
        kept = await service.ask("run_metrics", owner=ALICE, training_run_id=RUN)
        assert kept["metrics"]["loss:sum"] == [[0, 4.0], [1, None]]
        assert kept["metrics"]["acc:mean"] == [[0, pytest.approx(0.625)]]
        before = await service.dump()
        await catalog.drop(service.projection.engine)
    finally:
        await service.stop()
    await _assert_rebuilt(before, nats_url, catalog_url, blobs)
