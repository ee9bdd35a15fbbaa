"""State is a fold over events: replaying a log gives each aggregate's state."""

from __future__ import annotations

from tinsmith import events, jobs
from tinsmith._proto import bus_pb2 as bus

RUN = "S:train:0"


def _accepted(seq: int, **command: object) -> bus.Event:
    return events.make(
        request_accepted=bus.RequestAccepted(
            request_id=events.request_id(RUN, seq), aggregate_id=RUN, seq_id=seq, **command
        )
    )


def _replay(log: list[bus.Event]) -> jobs.Projection:
    projection = jobs.Projection()
    for seq, event in enumerate(log, start=1):
        projection.apply(seq, event)
    return projection


LOG = [
    events.make(session_created=bus.SessionCreated(session_id="S", tags=["a"])),
    _accepted(
        0,
        create_model=bus.CreateModel(
            session_id="S", base_model="tinsmith/tiny", lora=bus.LoraConfig(rank=8, train_mlp=True)
        ),
    ),
    events.make(run_created=bus.RunCreated(model_id=RUN, tokenizer_id="/tok")),
    events.make(
        request_completed=bus.RequestCompleted(
            request_id=f"{RUN}:0", aggregate_id=RUN, result_seq=5, media_type="application/json"
        )
    ),
    _accepted(1, optim_step=bus.OptimStep()),
    events.make(
        request_failed=bus.RequestFailed(
            request_id=f"{RUN}:1", aggregate_id=RUN, kind="invalid_request", detail="bad"
        )
    ),
    _accepted(2, optim_step=bus.OptimStep()),
    events.make(
        sampler_created=bus.SamplerCreated(
            sampler_id="S:sample:0", session_id="S", base_model="tinsmith/tiny", adapter_key="k"
        )
    ),
]


def test_replaying_the_log_rebuilds_every_aggregate() -> None:
    state = _replay(LOG)
    run = state.runs[RUN]
    assert (run.base_model, run.lora_rank, run.ready, run.tokenizer_id) == (
        "tinsmith/tiny",
        8,
        True,
        "/tok",
    )
    assert run.last_seq_id == 2
    assert state.sessions["S"].run_ids == (RUN,)
    assert state.sessions["S"].sampler_ids == ("S:sample:0",)
    assert state.samplers["S:sample:0"].adapter_key == "k"
    assert state.requests[f"{RUN}:0"].status is jobs.Status.COMPLETED
    assert state.requests[f"{RUN}:0"].result_seq == 5
    assert state.requests[f"{RUN}:1"].status is jobs.Status.FAILED
    assert state.requests[f"{RUN}:1"].error_detail == "bad"
    assert state.requests[f"{RUN}:2"].status is jobs.Status.PENDING


def test_the_first_outcome_of_a_request_wins() -> None:
    """A redelivered worker may complete a request twice; the first outcome stands."""
    state = _replay(
        [
            *LOG,
            events.make(
                request_completed=bus.RequestCompleted(
                    request_id=f"{RUN}:1", aggregate_id=RUN, result_seq=99
                )
            ),
        ]
    )
    assert state.requests[f"{RUN}:1"].status is jobs.Status.FAILED


def test_events_at_or_below_the_position_are_not_applied_twice() -> None:
    state = _replay(LOG)
    state.apply(2, LOG[1])  # a redelivery of an old position
    assert state.sessions["S"].run_ids == (RUN,)


def test_a_fold_is_pure() -> None:
    before = jobs.evolve_request(None, LOG[4])
    after = jobs.evolve_request(before, LOG[5])
    assert before is not None and before.status is jobs.Status.PENDING
    assert after is not None and after.status is jobs.Status.FAILED


def _sample_log(*outcomes: bus.Event) -> jobs.Projection:
    accepted = events.make(
        request_accepted=bus.RequestAccepted(
            request_id="S:sample:0:0", aggregate_id="S:sample:0", seq_id=0, sample=bus.Sample()
        )
    )
    return _replay([accepted, *outcomes])


def _cancelled() -> bus.Event:
    return events.make(
        request_cancelled=bus.RequestCancelled(
            request_id="S:sample:0:0", aggregate_id="S:sample:0", detail="the client went away"
        )
    )


def test_a_cancelled_request_fails_as_cancelled_and_leaves_the_queue() -> None:
    assert _sample_log().pending_samples == 1
    state = _sample_log(_cancelled())
    request = state.requests["S:sample:0:0"]
    assert (request.status, request.error_kind) == (jobs.Status.FAILED, "cancelled")
    assert request.error_detail == "the client went away"
    assert state.pending_samples == 0


def test_a_cancellation_and_a_completion_the_first_wins() -> None:
    done = events.make(
        request_completed=bus.RequestCompleted(
            request_id="S:sample:0:0", aggregate_id="S:sample:0", result_seq=7
        )
    )
    late_completion = _sample_log(_cancelled(), done).requests["S:sample:0:0"]
    assert late_completion.error_kind == "cancelled"
    late_cancel = _sample_log(done, _cancelled()).requests["S:sample:0:0"]
    assert (late_cancel.status, late_cancel.result_seq) == (jobs.Status.COMPLETED, 7)


def test_a_runs_next_seq_id_moves_past_accepted_and_rejected_ones_in_a_row() -> None:
    """The gateway refuses requests too far ahead of it: the SDK's chunks arrive out of order,
    and a rejected seq_id is spent like an accepted one."""
    rejected = events.make(
        request_rejected=bus.RequestRejected(aggregate_id=RUN, seq_id=3, kind="k", detail="d")
    )
    state = _replay([*LOG[:3], _accepted(5, optim_step=bus.OptimStep()), rejected])
    run = state.runs[RUN]
    assert (run.next_seq_id, run.spent_ahead) == (1, frozenset({3, 5}))
    state.apply(10, _accepted(1, optim_step=bus.OptimStep()))
    state.apply(11, _accepted(2, optim_step=bus.OptimStep()))
    run = state.runs[RUN]
    assert (run.next_seq_id, run.spent_ahead) == (4, frozenset({5}))
    assert state.rejections[f"{RUN}:3"].detail == "d"


def _placed(epoch: int, takeover: bool = False) -> bus.Event:
    return events.make(
        run_placed=bus.RunPlaced(model_id=RUN, replica=f"r{epoch}", epoch=epoch, takeover=takeover)
    )


def _done(seq: int, epoch: int) -> bus.Event:
    return events.make(
        request_completed=bus.RequestCompleted(
            request_id=events.request_id(RUN, seq), aggregate_id=RUN, result_seq=epoch, epoch=epoch
        )
    )


def test_what_a_cut_off_holder_records_after_a_takeover_changes_nothing() -> None:
    """Holder 7 recorded request 0; holder 12 took the run over while 7 ran request 1; what 7
    records after that (an outcome, a snapshot) is ignored; 12's counts, as does an outcome
    recorded without an epoch (another service's)."""
    projection = _replay(
        [
            *LOG[:2],
            _placed(7),
            _done(0, 7),
            _accepted(1, optim_step=bus.OptimStep()),
            _placed(12, takeover=True),
            _done(1, 7),
            events.make(
                run_snapshotted=bus.RunSnapshotted(
                    model_id=RUN, snapshot_key="stale", next_seq_id=2, epoch=7
                )
            ),
            _done(1, 12),
        ]
    )
    run = projection.runs[RUN]
    assert (run.epoch, run.placed, run.last_snapshot) == (12, True, None)
    assert run.takeovers == 0  # an outcome after the takeover resets the count
    assert projection.requests[events.request_id(RUN, 0)].result_seq == 7
    assert projection.requests[events.request_id(RUN, 1)].result_seq == 12
    assert projection.pending_runs == {}
    assert jobs.fenced(run, _done(1, 7)) and not jobs.fenced(run, _done(1, 0))


def test_a_run_knows_where_its_rebuild_starts_and_what_it_waits_for() -> None:
    created = _replay(LOG[:2])
    assert created.runs[RUN].replay_from == 2  # its creation
    assert created.pending_runs == {RUN: 1}
    snapshotted = _replay(
        [
            *LOG[:2],
            _placed(3),
            _accepted(1, optim_step=bus.OptimStep()),
            events.make(
                run_snapshotted=bus.RunSnapshotted(
                    model_id=RUN, snapshot_key="k", next_seq_id=2, epoch=3
                )
            ),
            _placed(9, takeover=True),
        ]
    )
    run = snapshotted.runs[RUN]
    assert run.replay_from == 5 and run.last_snapshot is not None
    assert run.last_snapshot.snapshot_key == "k" and run.takeovers == 1
    assert snapshotted.pending_runs == {RUN: 2}
    assert snapshotted.requests[events.request_id(RUN, 1)].log_seq == 4
