"""Projection snapshots: the codec reads back exactly what it wrote, for a projection replayed
from a realistic log, and refuses types it cannot hold; snapshots kept in the JetStream object
store, never replaced by older ones; a FollowedProjection that starts from the newest snapshot it
reads and refuses one of another version, of another log, or one the log no longer reaches."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import os
from dataclasses import dataclass, field
from enum import StrEnum

import pytest
from nats.js.errors import NotFoundError

from bench.log_scale import History
from tinsmith import events, jobs, snapshots, subjects
from tinsmith._proto import bus_pb2 as bus
from tinsmith.eventlog import EventLog, FollowedProjection, LogTruncated

FAST = snapshots.Policy(every_events=100, every_s=3600)


def _replayed(log: list[bus.Event]) -> jobs.Projection:
    projection = jobs.Projection()
    for seq, event in enumerate(log, start=1):
        projection.apply(seq, event)
    return projection


def _realistic() -> jobs.Projection:
    """A projection of RL jobs' log, plus what that log lacks: a seq_id spent ahead of its run,
    a pending request, an unloaded run (a protobuf message in a run), a key revoked."""
    log = list(History(3000, seed=1))
    state = _replayed(log)
    run = next(iter(state.runs))
    ahead = bus.RequestAccepted(
        request_id=events.request_id(run, 10_000),
        aggregate_id=run,
        seq_id=10_000,
        optim_step=bus.OptimStep(),
    )
    unloaded = bus.RunUnloaded(model_id=run, snapshot_key="runs/x/snapshots/1", next_seq_id=7)
    for event in (events.make(request_accepted=ahead), events.make(run_unloaded=unloaded)):
        state.apply(state.position + 1, event)
    return state


def test_a_realistic_projection_reads_back_equal_and_fingerprints_do_not_drift() -> None:
    state = _realistic()
    run = state.runs[next(iter(state.runs))]
    assert run.spent_ahead and run.snapshot is not None and state.checkpoints and state.keys
    assert any(r.status is jobs.Status.PENDING for r in state.requests.values())
    assert any(not k.revoked for k in state.keys.values()) and state.tenants and state.published
    codec = snapshots.Codec(jobs.Projection)
    back = codec.decode(codec.encode(state))
    assert back == state
    assert isinstance(back.published, set) and isinstance(run.spent_ahead, frozenset)
    assert type(back.requests[next(iter(back.requests))].status) is jobs.Status
    assert codec.fingerprint == snapshots.Codec(jobs.Projection).fingerprint


def test_a_copy_is_independent_of_the_projection_that_goes_on() -> None:
    state = _realistic()
    codec = snapshots.Codec(jobs.Projection)
    copy = codec.copy(state)
    before = codec.encode(copy)
    for seq, event in enumerate(History(200, seed=9), start=state.position + 1):
        state.apply(seq, event)
    state.published.add("tinker://x/weights/y")
    next(iter(state.tenants.values())).inflight += 5
    assert codec.encode(copy) == before
    assert codec.encode(state) != before


@dataclass(frozen=True)
class _Inner:
    name: str
    ids: frozenset[int] = frozenset()


class _Colour(StrEnum):
    RED = "red"


@dataclass
class _Outer:
    by_id: dict[int, _Inner] = field(default_factory=dict)
    pairs: tuple[tuple[str, float], ...] = ()
    maybe: bus.KeyRevoked | None = None
    colours: list[_Colour] = field(default_factory=list)
    blob: bytes = b""


def test_the_codec_is_generic_over_fields_and_refuses_what_it_cannot_hold() -> None:
    codec = snapshots.Codec(_Outer)
    value = _Outer(
        by_id={3: _Inner("a", frozenset({1, 2}))},
        pairs=(("x", 0.1),),
        maybe=bus.KeyRevoked(key_id="k"),
        colours=[_Colour.RED],
        blob=b"\x00\xff",
    )
    assert codec.decode(codec.encode(value)) == value

    @dataclass
    class Loose:
        anything: object = None

    with pytest.raises(TypeError, match="cannot hold"):
        snapshots.Codec(Loose)

    @dataclass
    class Grown(_Outer):
        added: int = 0

    assert snapshots.Codec(Grown).fingerprint != codec.fingerprint
    renamed = dataclasses.make_dataclass("_Outer", [("by_id", dict[int, _Inner])])
    assert snapshots.Codec(renamed).fingerprint != codec.fingerprint


async def test_the_store_keeps_each_kinds_newest_snapshot(eventlog: EventLog) -> None:
    store = snapshots.Store(eventlog.bus, bucket="TEST_SNAPSHOTS_STORE")
    with_log = await snapshots.log_identity(eventlog.bus)

    def header(position: int) -> snapshots.Header:
        return snapshots.Header("gateway", position, "f" * 32, with_log)

    big = os.urandom(2_500_000)  # three chunks, even compressed
    assert await store.save(header(10), snapshots.pack(header(10), big))
    assert not await store.save(header(9), snapshots.pack(header(9), b"older"))
    assert await store.save(header(12), snapshots.pack(header(12), big + b"!"))
    latest = await store.latest("gateway")
    assert latest is not None and latest.position == 12
    data = await store.read("gateway")
    assert data is not None
    read_header, body = snapshots.unpack(data)
    assert (read_header.position, body) == (12, big + b"!")
    assert await store.positions() == {"gateway": 12}
    chunks = await eventlog.bus.js.stream_info(store.stream)
    assert chunks.state.messages == 3 + 1  # the superseded object's chunks are gone


async def _fill(eventlog: EventLog, log: list[bus.Event]) -> None:
    for start in range(0, len(log), 300):
        await asyncio.gather(*(eventlog.append(e) for e in log[start : start + 300]))


async def _fresh_snapshots(eventlog: EventLog) -> None:
    """Each test's log is new; so is its snapshot bucket."""
    with contextlib.suppress(NotFoundError):
        await eventlog.bus.js.delete_stream(f"OBJ_{subjects.SNAPSHOTS_BUCKET}")


async def test_a_projection_starts_from_the_newest_snapshot_it_reads(eventlog: EventLog) -> None:
    await _fresh_snapshots(eventlog)
    log = list(History(400, seed=2))
    await _fill(eventlog, log[:600])
    writer = FollowedProjection(eventlog)
    writer.keep_snapshots("gateway", snapshots.Policy(every_events=10**6, every_s=3600))
    await writer.start()
    assert writer.started_from == 0
    assert await writer.write_snapshot()
    await _fill(eventlog, log[600:])
    await writer.catch_up()
    reader = FollowedProjection(eventlog)
    await reader.start()
    assert reader.started_from == 600
    assert reader.state == writer.state == _replayed(log)


async def test_a_snapshot_of_another_version_is_refused_and_the_log_replayed(
    eventlog: EventLog, caplog: pytest.LogCaptureFixture
) -> None:
    await _fresh_snapshots(eventlog)
    log = list(History(100, seed=4))
    await _fill(eventlog, log)
    other = snapshots.Header(
        "trainer", len(log), "0" * 32, await snapshots.log_identity(eventlog.bus)
    )
    await snapshots.Store(eventlog.bus).save(other, snapshots.pack(other, b"[]"))
    reader = FollowedProjection(eventlog)
    with caplog.at_level(logging.INFO, logger="tinsmith.eventlog"):
        await reader.start()
    assert reader.started_from == 0 and reader.state == _replayed(log)
    assert "written by a version whose projection differs" in caplog.text
    assert "replaying it from its start" in caplog.text


async def test_a_start_the_purged_log_no_longer_reaches_fails(eventlog: EventLog) -> None:
    await _fresh_snapshots(eventlog)
    await _fill(eventlog, list(History(50, seed=5)))
    await eventlog.bus.js.purge_stream(subjects.EVENTS_STREAM, seq=20)
    with pytest.raises(LogTruncated, match="starts at position 20"):
        await FollowedProjection(eventlog).start()


async def test_snapshots_are_written_as_the_policy_says_and_a_purge_is_caught_up_from_them(
    eventlog: EventLog,
) -> None:
    """A projection that follows the log past a purge it did not see coming (its events were
    covered by a newer snapshot than it started from) starts over from that snapshot."""
    await _fresh_snapshots(eventlog)
    log = list(History(300, seed=6))
    await _fill(eventlog, log[:50])
    writer = FollowedProjection(eventlog)
    writer.keep_snapshots("gateway", FAST)
    await writer.start()
    lagging = FollowedProjection(eventlog)
    await lagging.start()
    await lagging._reader.stop()  # type: ignore[union-attr]  # it reads nothing meanwhile
    await _fill(eventlog, log[50:])
    await writer.catch_up()
    stored = await writer.snapshots.latest("gateway")
    for _ in range(100):  # written in the background, every 100 events
        if stored is not None and stored.position >= 100 and not writer._writing:
            break
        await asyncio.sleep(0.05)
        stored = await writer.snapshots.latest("gateway")
    assert stored is not None and stored.position >= 100
    await writer.write_snapshot()  # the newest (unless the background wrote it already)
    stored = await writer.snapshots.latest("gateway")
    assert stored is not None and stored.position == len(log)
    await eventlog.bus.js.purge_stream(subjects.EVENTS_STREAM, seq=stored.position + 1)
    later = events.make(session_created=bus.SessionCreated(session_id="later"))
    await eventlog.append(later)
    # Its reader goes on where it was (its consumer made before the purge, as in a race with
    # it): the next event it gets is far past its position.
    lagging._reader = await eventlog.bus.follow(
        subjects.EVENTS_STREAM,
        subjects.EVENTS_ALL,
        lagging._on_event,
        start_seq=lagging.state.position + 1,
    )
    for _ in range(100):
        if lagging.state.position == len(log) + 1:
            break
        await asyncio.sleep(0.05)
    assert lagging.state.position == len(log) + 1
    assert lagging.started_from == stored.position
    assert lagging.state == _replayed([*log, later])


async def test_a_projection_past_which_the_log_was_purged_catches_up_from_a_snapshot(
    eventlog: EventLog,
) -> None:
    """No event comes to tell it: ``catch_up`` sees the log's first position past its own."""
    await _fresh_snapshots(eventlog)
    log = list(History(100, seed=8))
    await _fill(eventlog, log[:20])
    lagging = FollowedProjection(eventlog)
    await lagging.start()
    await lagging._reader.stop()  # type: ignore[union-attr]
    await _fill(eventlog, log[20:])
    writer = FollowedProjection(eventlog)
    writer.keep_snapshots("trainer", snapshots.Policy(every_events=10**6, every_s=3600))
    await writer.start()
    assert await writer.write_snapshot()
    await eventlog.bus.js.purge_stream(subjects.EVENTS_STREAM, seq=len(log) + 1)
    await asyncio.wait_for(lagging.catch_up(), 10)
    assert lagging.state == _replayed(log)


def test_pruning_forgets_only_what_nothing_can_ask_about() -> None:
    log = list(History(8000, seed=7))  # long enough for sessions to finish
    state = _replayed(log)
    before = dict(state.requests)
    samplers = dict(state.samplers)
    results_from = 1 + max(r.result_seq for r in before.values()) // 2
    idle_before = (log[0].time + log[-1].time) / 2
    expired = [
        r
        for r in before.values()
        if r.status is jobs.Status.COMPLETED and 0 < r.result_seq < results_from
    ]
    horizon = max(r.log_seq for r in expired)
    pruned = state.prune(results_from, idle_before=idle_before)
    assert 0 < pruned < len(before)
    failed_gone = 0
    for request_id, request in before.items():
        kept = request_id in state.requests
        old = (request.status is jobs.Status.COMPLETED and request.result_seq < results_from) or (
            request.status is jobs.Status.FAILED and request.log_seq < horizon
        )
        run = state.runs.get(request.aggregate_id)
        rebuild = run is not None and request.seq_id >= state.rebuilt_from(run)
        assert kept == (not old or request.command == "create_model" or rebuild), request
        failed_gone += request.status is jobs.Status.FAILED and not kept
    assert failed_gone > 0
    asked = {r.aggregate_id for r in state.requests.values()}
    for sampler_id, sampler in samplers.items():
        session = state.sessions[sampler.session_id]
        idle = session.finished and session.last_active < idle_before and sampler_id not in asked
        assert (sampler_id in state.samplers) == (not idle), sampler
    assert 0 < len(state.samplers) < len(samplers)
    assert state.prune(results_from, idle_before=idle_before) == 0
