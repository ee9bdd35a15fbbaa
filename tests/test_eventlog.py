"""The event log on a real nats-server: durable appends, de-duplication, results, projections."""

from __future__ import annotations

import asyncio

from tinsmith import events, jobs, subjects
from tinsmith._proto import bus_pb2 as bus
from tinsmith.bus import MAX_BODY_BYTES
from tinsmith.eventlog import JSON, PROTOBUF, EventLog, FollowedProjection, Outcome


def _session(session_id: str) -> bus.Event:
    return events.make(session_created=bus.SessionCreated(session_id=session_id))


async def test_an_append_with_the_same_message_id_is_stored_once(eventlog: EventLog) -> None:
    first, duplicate = await eventlog.append(_session("a"), msg_id="m1")
    again, repeated = await eventlog.append(_session("a"), msg_id="m1")
    assert (duplicate, repeated) == (False, True)
    assert again == first


async def test_results_keep_their_bytes_and_media_type(eventlog: EventLog) -> None:
    seq = await eventlog.put_result("S:train:0:1", b"\x00\x01proto", PROTOBUF)
    assert await eventlog.get_result(seq) == (b"\x00\x01proto", PROTOBUF)
    seq = await eventlog.put_result("S:train:0:2", b'{"a": 1}', JSON)
    assert await eventlog.get_result(seq) == (b'{"a": 1}', JSON)


async def test_a_new_projection_replays_the_log_and_then_follows_it(eventlog: EventLog) -> None:
    await eventlog.append(_session("before"))
    projection = FollowedProjection(eventlog)
    await projection.start()
    assert "before" in projection.state.sessions
    seq, _ = await eventlog.append(_session("after"))
    assert await projection.wait_for(seq, timeout=5)
    assert "after" in projection.state.sessions
    assert projection.state.position == seq


async def test_a_completion_points_at_its_result(eventlog: EventLog) -> None:
    projection = FollowedProjection(eventlog)
    await projection.start()
    accepted = bus.RequestAccepted(
        request_id="S:train:0:1", aggregate_id="S:train:0", seq_id=1, optim_step=bus.OptimStep()
    )
    await eventlog.append(events.make(request_accepted=accepted))
    await eventlog.complete("S:train:0:1", "S:train:0", b"{}", JSON, request_aggregate="run")
    await projection.catch_up()
    request = projection.state.requests["S:train:0:1"]
    assert await eventlog.get_result(request.result_seq) == (b"{}", JSON)


async def test_a_result_too_large_to_store_fails_its_request_with_the_limit(
    eventlog: EventLog,
) -> None:
    """Before, such a result was never stored nor failed: its request came back after every ack
    wait, was computed again, and survived restarts."""
    projection = FollowedProjection(eventlog)
    await projection.start()
    accepted = bus.RequestAccepted(
        request_id="S:sample:0:7", aggregate_id="S:sample:0", seq_id=7, sample=bus.Sample()
    )
    await eventlog.append(events.make(request_accepted=accepted), request_aggregate="sampler")

    async def work() -> Outcome:
        return Outcome(b"\x00" * (9 * 2**20), PROTOBUF)

    await eventlog.settle(accepted, work, request_aggregate="sampler", worker="sampler")
    await projection.catch_up()
    request = projection.state.requests["S:sample:0:7"]
    assert request.status is jobs.Status.FAILED
    assert request.error_kind == "invalid_request"
    assert "9.0 MiB" in request.error_detail
    assert f"{MAX_BODY_BYTES / 2**20:.1f} MiB" in request.error_detail


async def test_an_outcome_the_bus_does_not_take_at_once_is_recorded_once_it_does(
    eventlog: EventLog,
) -> None:
    """The results stream is away while the work finishes (its publishes go unanswered): the
    outcome is sent again until the stream is back, and recorded as the result, not turned into
    a failure of work that succeeded."""
    projection = FollowedProjection(eventlog)
    await projection.start()
    accepted = bus.RequestAccepted(
        request_id="S:sample:0:3", aggregate_id="S:sample:0", seq_id=3, sample=bus.Sample()
    )
    await eventlog.append(events.make(request_accepted=accepted), request_aggregate="sampler")
    await eventlog.bus.js.delete_stream(subjects.RESULTS_STREAM)

    async def work() -> Outcome:
        return Outcome(b'{"ok": 1}', JSON)

    async def restore() -> None:
        await asyncio.sleep(1.0)
        await eventlog.bus.ensure_streams(results_max_age_s=60)

    await asyncio.gather(
        eventlog.settle(accepted, work, request_aggregate="sampler", worker="sampler"), restore()
    )
    await projection.catch_up()
    request = projection.state.requests["S:sample:0:3"]
    assert request.status is jobs.Status.COMPLETED
    assert await eventlog.get_result(request.result_seq) == (b'{"ok": 1}', JSON)
