"""The event log's retention rule, on projections folded from hand-written logs: the floor is the
lowest position any snapshot, any run's rebuild, any pending request or any consumer still
needs."""

from __future__ import annotations

from tinsmith import events, jobs
from tinsmith._proto import bus_pb2 as bus
from tinsmith.retention import Consumer, floor

RUN, SAMPLER = "S:train:0", "S:sample:1"
KINDS = ("gateway", "trainer", "checkpoint")
ALL_AT_100 = {"gateway": 100, "trainer": 120, "checkpoint": 110}


def _accepted(aggregate: str, seq_id: int, **command: object) -> bus.Event:
    accepted = bus.RequestAccepted(
        request_id=events.request_id(aggregate, seq_id),
        aggregate_id=aggregate,
        seq_id=seq_id,
        **command,  # type: ignore[arg-type]
    )
    return events.make(request_accepted=accepted)


def _done(aggregate: str, seq_id: int) -> bus.Event:
    done = bus.RequestCompleted(
        request_id=events.request_id(aggregate, seq_id), aggregate_id=aggregate, result_seq=1
    )
    return events.make(request_completed=done)


def _fold(log: list[tuple[int, bus.Event]]) -> jobs.Projection:
    state = jobs.Projection()
    for seq, event in log:
        state.apply(seq, event)
    return state


def _created() -> list[tuple[int, bus.Event]]:
    create = bus.CreateModel(session_id="S", base_model="tinsmith/tiny")
    return [
        (1, events.make(session_created=bus.SessionCreated(session_id="S", owner="t"))),
        (2, _accepted(RUN, 0, create_model=create)),
        (3, _done(RUN, 0)),
        (4, _accepted(RUN, 1, optim_step=bus.OptimStep())),
        (5, _done(RUN, 1)),
    ]


def _unloaded(at: int, next_seq_id: int) -> tuple[int, bus.Event]:
    unloaded = bus.RunUnloaded(model_id=RUN, snapshot_key="k", next_seq_id=next_seq_id)
    return at, events.make(run_unloaded=unloaded)


def test_a_kind_without_a_snapshot_keeps_the_whole_log() -> None:
    state = _fold([*_created(), _unloaded(6, 2)])
    kept = floor(state, snapshots={"gateway": 100, "checkpoint": 100}, kinds=KINDS, consumers=[])
    assert (kept.position, kept.reason) == (1, "the trainer projection has no snapshot yet")


def test_a_run_without_a_snapshot_keeps_its_creation() -> None:
    kept = floor(_fold(_created()), snapshots=ALL_AT_100, kinds=KINDS, consumers=[])
    assert kept.position == 2
    assert f"run {RUN}" in kept.reason


def test_a_run_whose_snapshot_covers_its_requests_holds_nothing_back() -> None:
    """An idle run unloaded long ago does not pin the log at its unload, as its replay_from
    (the unload's position) would."""
    state = _fold([*_created(), _unloaded(6, 2)])
    assert state.runs[RUN].replay_from == 6
    kept = floor(state, snapshots=ALL_AT_100, kinds=KINDS, consumers=[])
    assert (kept.position, kept.reason) == (101, "the gateway snapshot is at 100")


def test_requests_after_a_runs_snapshot_are_kept_for_its_rebuild() -> None:
    """Accepted before the snapshot event and after its seq_id (queued while it was taken), or
    after it: both are executed again by a rebuild, so both stay, completed or not."""
    log = [
        *_created(),
        (6, _accepted(RUN, 2, optim_step=bus.OptimStep())),
        (7, events.make(run_snapshotted=bus.RunSnapshotted(model_id=RUN, next_seq_id=2))),
        (8, _done(RUN, 2)),
        (9, _accepted(RUN, 3, optim_step=bus.OptimStep())),
        (10, _done(RUN, 3)),
    ]
    kept = floor(_fold(log), snapshots=ALL_AT_100, kinds=KINDS, consumers=[])
    assert kept.position == 6
    assert f"request {RUN}:2" in kept.reason


def test_a_pending_sample_request_is_kept() -> None:
    log = [*_created(), _unloaded(6, 2), (7, _accepted(SAMPLER, 0, sample=bus.Sample()))]
    kept = floor(_fold(log), snapshots=ALL_AT_100, kinds=KINDS, consumers=[])
    assert (kept.position, kept.reason) == (7, f"request {SAMPLER}:0 is pending")
    log.append((8, _done(SAMPLER, 0)))
    assert floor(_fold(log), snapshots=ALL_AT_100, kinds=KINDS, consumers=[]).position == 101


def test_a_consumer_that_has_not_seen_everything_keeps_what_it_has_not() -> None:
    state = _fold([*_created(), _unloaded(6, 2)])
    behind = Consumer("sampler", ack_floor=40, pending=0, ack_pending=3)
    caught_up = Consumer("reader", ack_floor=7, pending=0, ack_pending=0)
    kept = floor(state, snapshots=ALL_AT_100, kinds=KINDS, consumers=[behind, caught_up])
    assert (kept.position, kept.reason) == (41, "consumer sampler reads from it")
    reading = Consumer("catching-up", ack_floor=12, pending=500, ack_pending=0)
    assert floor(state, snapshots=ALL_AT_100, kinds=KINDS, consumers=[reading]).position == 13
