"""Trainer replicas sharing one log on a real nats-server with tinsmith/tiny: runs are spread
over the replicas with one holder each; a replica that dies has its runs rebuilt on another from
the latest snapshot plus the log, bit for bit; one that stops hands its runs over without a
failed request; one paused past its lease records nothing for the runs it lost (fencing)."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import pytest
import torch
from nats.js.errors import NoKeysError

from services.trainer.engine import Passes
from services.trainer.fusion import Fuser
from services.trainer.handlers import Trainer
from tests.calls import record_calls
from tests.trainer.test_work_loop import ADAM, Harness, _batch, _weights
from tinsmith import events, jobs, models, subjects
from tinsmith._proto import bus_pb2 as bus
from tinsmith.eventlog import EventLog

LEASE_S = 1.0


@pytest.fixture
async def harness(eventlog: EventLog, nats_url: str, tmp_path: Path) -> Harness:
    harness = Harness(eventlog, nats_url, tmp_path / "blobs")
    await harness.projection.start()
    return harness


async def _log(harness: Harness) -> list[tuple[int, bus.Event]]:
    bus_ = harness.eventlog.bus
    last = await bus_.last_seq(subjects.EVENTS_STREAM)
    return [
        (seq, events.decode(await bus_.get(subjects.EVENTS_STREAM, seq)))
        for seq in range(1, last + 1)
    ]


async def _outcomes(harness: Harness, model_id: str) -> list[bus.Event]:
    return [
        event
        for _, event in await _log(harness)
        if events.kind_of(event) in ("request_completed", "request_failed")
        and getattr(event, events.kind_of(event)).aggregate_id == model_id
    ]


async def _placements(harness: Harness, model_id: str) -> list[bus.RunPlaced]:
    return [
        event.run_placed
        for _, event in await _log(harness)
        if events.kind_of(event) == "run_placed" and event.run_placed.model_id == model_id
    ]


async def _steps(harness: Harness, model_id: str, first: int, count: int) -> list[str]:
    """``count`` training steps (forward_backward, optim_step) from seq_id ``first`` on."""
    ids = []
    for step in range(count):
        seq_id = first + 2 * step
        ids.append(await harness.accept(model_id, seq_id, forward_backward=_batch(seq_id)))
        ids.append(await harness.accept(model_id, seq_id + 1, optim_step=bus.OptimStep(adam=ADAM)))
    return ids


async def _crash(trainer: Trainer) -> None:
    """What a SIGKILL leaves: the connection gone at once, nothing recorded, nothing released,
    no lease renewed."""
    for task in list(trainer.bus._tasks):
        task.cancel()
    await trainer.bus.nc.close()
    trainer.compute.shutdown()


async def test_runs_are_spread_over_the_replicas_with_one_holder_each(harness: Harness) -> None:
    async with (
        harness.trainer(replica="spread-a", lease_s=LEASE_S) as a,
        harness.trainer(replica="spread-b", lease_s=LEASE_S) as b,
    ):
        for n in range(4):
            await harness.settled(await harness.create(f"spread-{n}"))
        held = {name: set(trainer.queues) for name, trainer in (("a", a), ("b", b))}
        assert held["a"] and held["b"], held
        assert not held["a"] & held["b"]
        for n in range(4):
            placements = await _placements(harness, f"spread-{n}")
            assert len(placements) == 1 and not placements[0].takeover


async def test_a_dead_replica_s_run_is_rebuilt_from_its_snapshot_and_the_log_bit_for_bit(
    harness: Harness, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Replica a holds the run for 7 steps (a snapshot every 3 optimizer steps), then dies with
    step 8 sent; replica b takes the run over after a's lease, restores the snapshot after step
    6, re-executes step 7 without recording it again, and runs steps 8 to 10. The weights equal
    those of a run trained undisturbed, bit for bit, and each request has one outcome. Step 7's
    forward_backward and optim_step are re-executed through b's fuser, in line with the other
    runs' requests (a slice at a time), like the steps after them."""
    delivered = record_calls(monkeypatch, Fuser, "_deliver")
    async with harness.trainer(replica="rebuild-ref", lease_s=LEASE_S) as ref:
        await harness.settled(await harness.create("reference"))
        await harness.settled(*await _steps(harness, "reference", 1, 10))
        reference = _weights(ref, "reference")

    trainer_a = harness.trainer(replica="rebuild-a", lease_s=LEASE_S, snapshot_every=3)
    a = await trainer_a.__aenter__()
    # a is the only replica: the new run is its own (with another one up, which replica takes
    # it first depends on how quickly each answers).
    await harness.settled(await harness.create("rebuilt"))
    assert "rebuilt" in a.queues
    async with harness.trainer(replica="rebuild-b", lease_s=LEASE_S) as b:
        await harness.settled(*await _steps(harness, "rebuilt", 1, 7))
        runs = harness.projection.state.runs
        await harness.until(
            lambda: (
                runs["rebuilt"].last_snapshot is not None
                and runs["rebuilt"].last_snapshot.next_seq_id == 13
            )
        )
        in_flight = await _steps(harness, "rebuilt", 15, 1)
        killed = time.monotonic()
        await _crash(a)
        later = await _steps(harness, "rebuilt", 17, 2)
        await harness.settled(in_flight[0], timeout=30)
        recovered_in = time.monotonic() - killed
        await harness.settled(*in_flight, *later, timeout=60)
        print(f"first step after the crash settled {recovered_in:.2f} s after it")

        assert "rebuilt" in b.queues
        served = [ask.model_id for fuser, ask, _ in delivered if fuser is b.fuser]
        assert served.count("rebuilt") == 2 + 3 * 2  # step 7 again, then steps 8 to 10
        rebuilt = _weights(b, "rebuilt")
        assert all(torch.equal(x, y) for x, y in zip(rebuilt, reference, strict=True))

    placements = await _placements(harness, "rebuilt")
    assert [p.replica for p in placements] == ["rebuild-a", "rebuild-b"]
    assert placements[1].takeover and placements[1].epoch > placements[0].epoch
    outcomes = Counter(
        getattr(e, events.kind_of(e)).request_id for e in await _outcomes(harness, "rebuilt")
    )
    assert set(outcomes.values()) == {1}, outcomes  # none recorded twice
    states = [harness.projection.state.requests[rid] for rid in outcomes]
    assert all(state.status is jobs.Status.COMPLETED for state in states)
    assert recovered_in < 15


async def test_a_run_being_rebuilt_takes_turns_with_the_runs_served_meanwhile(
    harness: Harness,
) -> None:
    """Replica a trains a run one step of 8 datums (8 passes of a slice of 11 tokens) and dies
    with nothing snapshotted since. Replica b rebuilds it when its next request comes,
    re-executing that step's passes (slowed here to 0.2 s each); a run on b that asks for a
    forward_backward meanwhile is served between them, not after the whole step."""
    settings = {"lease_s": LEASE_S, "slice_tokens": 11, "fuse_tokens": 0, "snapshot_every": 100}
    trainer_a = harness.trainer(replica="turns-a", **settings)
    a = await trainer_a.__aenter__()
    await harness.settled(await harness.create("turns-rebuilt"))
    assert "turns-rebuilt" in a.queues
    await harness.settled(
        await harness.accept("turns-rebuilt", 1, forward_backward=_batch(1, datums=8)),
        await harness.accept("turns-rebuilt", 2, optim_step=bus.OptimStep(adam=ADAM)),
    )
    async with harness.trainer(replica="turns-b", **settings) as b:
        await _crash(a)
        await harness.settled(await harness.create("turns-live"))  # b's: a is gone
        passes: list[str] = []
        advance = b.engine.advance

        def slowed(request: Passes) -> bytes | None:
            rebuilt = request.run is b.engine.runs.get("turns-rebuilt")
            passes.append("rebuilt" if rebuilt else "live")
            if rebuilt:
                time.sleep(0.2)
            return advance(request)

        b.engine.advance = slowed  # type: ignore[method-assign]
        later = await harness.accept("turns-rebuilt", 3, forward_backward=_batch(3))
        await harness.until(lambda: "rebuilt" in passes, timeout=30)
        live = await harness.accept("turns-live", 1, forward_backward=_batch(4))
        await harness.settled(live, later, timeout=60)
    # The rebuilt step's 8 passes with the live request's 2 among them (each pass of a request
    # goes back in line behind what waits), then the later request's 2.
    rebuilt_passes = [n for n, which in enumerate(passes) if which == "rebuilt"]
    live_passes = [n for n, which in enumerate(passes) if which == "live"]
    assert len(rebuilt_passes) == 8 + 2 and len(live_passes) == 2
    assert live_passes[0] > 0 and live_passes[1] < rebuilt_passes[7], passes


async def test_a_replica_that_stops_hands_its_runs_over_without_a_failed_request(
    harness: Harness,
) -> None:
    async with harness.trainer(replica="handover-b", lease_s=LEASE_S) as b:
        await harness.settled(await harness.create("handover-busy"))  # b holds a run already
        async with harness.trainer(replica="handover-a", lease_s=LEASE_S) as a:
            await harness.settled(await harness.create("handover"))
            assert "handover" in a.queues
            await harness.settled(*await _steps(harness, "handover", 1, 2))
            waiting = await _steps(harness, "handover", 7, 1)  # waits for seq_ids 5 and 6
            began = time.monotonic()
            await a.stop()
            stopped_in = time.monotonic() - began
        gap = await _steps(harness, "handover", 5, 1)
        outcomes = await harness.settled(*gap, *waiting, timeout=30)
        assert "handover" in b.queues
    assert all(outcome.status is jobs.Status.COMPLETED for outcome in outcomes)
    assert stopped_in < 5
    placements = await _placements(harness, "handover")
    assert [p.replica for p in placements] == ["handover-a", "handover-b"]
    assert not placements[1].takeover  # a snapshot it: nothing to re-execute


async def test_a_replica_paused_past_its_lease_records_nothing_for_the_run_it_lost(
    harness: Harness, nats_url: str, tmp_path: Path
) -> None:
    """A trainer process holds a run; it is stopped with SIGSTOP past its lease, and a request
    for the run comes meanwhile: another replica takes the run over and runs it. Resumed, the
    paused trainer sees the request (it was in the log before the takeover) and may run it, but
    records nothing: the request's one outcome is the new holder's."""
    env = {
        **os.environ,
        "TINSMITH_NATS_URL": nats_url,
        "TINSMITH_BLOB_URL": harness.blob_url,
        "TINSMITH_CACHE_DIR": str(models.default_cache_dir()),
        "TINSMITH_DEVICE": "cpu",
        "TINSMITH_REPLICA": "paused",
        "TINSMITH_TRAINER_LEASE_S": str(LEASE_S),
        "TINSMITH_BASE_MODELS": models.TINY,
    }
    env.pop("TINSMITH_HEALTH_PORT", None)
    log_path = tmp_path / "paused.log"
    with log_path.open("wb") as out:
        process = subprocess.Popen(
            [sys.executable, "-m", "services.trainer"], env=env, stdout=out, stderr=out
        )
    try:
        await _until_replica(harness, "paused", timeout=120)
        await harness.settled(await harness.create("fenced"), timeout=60)
        assert [p.replica for p in await _placements(harness, "fenced")] == ["paused"]
        await harness.settled(*await _steps(harness, "fenced", 1, 1))

        async with harness.trainer(replica="fencing", lease_s=LEASE_S) as other:
            process.send_signal(signal.SIGSTOP)
            request = await harness.accept("fenced", 3, forward_backward=_batch(3))
            (outcome,) = await harness.settled(request, timeout=30)
            assert outcome.status is jobs.Status.COMPLETED
            assert "fenced" in other.queues
            process.send_signal(signal.SIGCONT)
            await asyncio.sleep(3 * LEASE_S)  # the resumed trainer's turn to (not) record
            recorded = [getattr(e, events.kind_of(e)) for e in await _outcomes(harness, "fenced")]
            assert [r.request_id for r in recorded if r.request_id == request] == [request]
            placements = await _placements(harness, "fenced")
            assert [p.replica for p in placements] == ["paused", "fencing"]
            assert all(r.epoch == placements[1].epoch for r in recorded if r.request_id == request)
    finally:
        process.send_signal(signal.SIGCONT)
        process.terminate()
        process.wait(timeout=30)
    assert "lost its lease" in log_path.read_text() or "another trainer holds it" in (
        log_path.read_text()
    )


async def _until_replica(harness: Harness, name: str, timeout: float) -> None:
    kv = await harness.eventlog.bus.js.key_value(subjects.TRAINERS_BUCKET)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with contextlib.suppress(NoKeysError):
            if name in await kv.keys():
                return
        await asyncio.sleep(0.2)
    raise AssertionError(f"trainer {name} did not join the fleet")
