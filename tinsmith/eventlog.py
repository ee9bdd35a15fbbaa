"""Append to and replay the event log, and keep request results, over JetStream.

Owns: the mapping of events to subjects and streams, de-duplication of appends, the results
stream, and ``FollowedProjection``, which keeps a ``jobs.Projection`` current and lets a caller wait
until it reflects a given log position (read-your-writes). Does not own: what events mean.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable

from opentelemetry import trace

from tinsmith import events, jobs, subjects, telemetry
from tinsmith._proto import bus_pb2 as bus
from tinsmith.bus import MAX_BODY_BYTES, Bus
from tinsmith.failures import Cancelled, InternalError, InvalidRequest, TinsmithError

log = logging.getLogger(__name__)

JSON = "application/json"
PROTOBUF = "application/x-protobuf"
_MEDIA_TYPES = {JSON: b"j", PROTOBUF: b"p"}
_MEDIA_BY_TAG = {tag: media for media, tag in _MEDIA_TYPES.items()}


class ResultTooLarge(InvalidRequest):
    """A request's result does not fit the results stream's one message."""


class EventLog:
    def __init__(self, bus_: Bus) -> None:
        self.bus = bus_

    async def append(
        self, event: bus.Event, *, msg_id: str | None = None, request_aggregate: str = "run"
    ) -> tuple[int, bool]:
        """Append ``event`` on its aggregate's subject; return ``(log position, duplicate)``.
        ``msg_id`` makes a retried append within the duplicate window a no-op."""
        aggregate, agg_id = events.aggregate_of(event, request_aggregate=request_aggregate)
        subject = subjects.event_subject(aggregate, agg_id, events.kind_of(event))
        ack = await self.bus.publish(subject, events.encode(event), msg_id=msg_id)
        return int(ack.seq), bool(ack.duplicate)

    async def put_result(
        self, request_id: str, body: bytes, media_type: str, *, epoch: int = 0
    ) -> int:
        """Store a result, tagged with its media type; return its sequence in the results stream.
        A result over ``MAX_BODY_BYTES`` is refused (``ResultTooLarge``) before it is sent."""
        if len(body) > MAX_BODY_BYTES:
            raise ResultTooLarge(
                f"the result of request {request_id} is {len(body) / 2**20:.1f} MiB; a result is "
                f"stored as one message of at most {MAX_BODY_BYTES / 2**20:.1f} MiB: ask for "
                "less in one request (fewer samples or datums, fewer tokens, a smaller top-k)"
            )
        ack = await self.bus.publish(
            subjects.result_subject(request_id),
            _MEDIA_TYPES[media_type] + body,
            msg_id=_once("result", request_id, epoch),
        )
        return int(ack.seq)

    async def get_result(self, result_seq: int) -> tuple[bytes, str]:
        data = await self.bus.get(subjects.RESULTS_STREAM, result_seq)
        return data[1:], _MEDIA_BY_TAG[data[:1]]

    async def complete(
        self,
        request_id: str,
        aggregate_id: str,
        body: bytes,
        media_type: str,
        *,
        request_aggregate: str,
        compute_seconds: float = 0.0,
        epoch: int = 0,
    ) -> None:
        """Store a result, then record the completion that points at it. ``epoch``: the
        recording trainer's hold on the run (``bus.RunPlaced``); outcomes of an older one are
        ignored by the folds."""
        seq = await self.put_result(request_id, body, media_type, epoch=epoch)
        done = bus.RequestCompleted(
            request_id=request_id,
            aggregate_id=aggregate_id,
            result_seq=seq,
            media_type=media_type,
            compute_seconds=compute_seconds,
            replica=self.bus.replica,
            epoch=epoch,
        )
        await self.append(
            events.make(request_completed=done),
            msg_id=_once("done", request_id, epoch),
            request_aggregate=request_aggregate,
        )

    async def fail(
        self,
        request_id: str,
        aggregate_id: str,
        kind: str,
        detail: str,
        *,
        request_aggregate: str,
        epoch: int = 0,
    ) -> None:
        failed = bus.RequestFailed(
            request_id=request_id, aggregate_id=aggregate_id, kind=kind, detail=detail, epoch=epoch
        )
        await self.append(
            events.make(request_failed=failed),
            msg_id=_once("done", request_id, epoch),
            request_aggregate=request_aggregate,
        )

    async def cancel(
        self, request_id: str, aggregate_id: str, detail: str, *, request_aggregate: str
    ) -> bool:
        """Record that a request's caller went away: it settles as cancelled unless an outcome
        was recorded first (same msg_id: whichever comes second is de-duplicated, and the fold
        keeps the first outcome anyway). Returns whether the cancellation was recorded."""
        cancelled = bus.RequestCancelled(
            request_id=request_id, aggregate_id=aggregate_id, detail=detail
        )
        _, duplicate = await self.append(
            events.make(request_cancelled=cancelled),
            msg_id=f"done:{request_id}",
            request_aggregate=request_aggregate,
        )
        return not duplicate

    async def settle(
        self,
        accepted: bus.RequestAccepted,
        work: Callable[[], Awaitable[tuple[bytes, str]]],
        *,
        request_aggregate: str,
        worker: str,
        epoch: int = 0,
        confirm: Callable[[], Awaitable[bool]] | None = None,
    ) -> None:
        """Run a request's work and record its outcome: the result, or a failure whose kind
        says whose fault it was (a result too large to store is the request's: it fails with
        ``ResultTooLarge``). An unexpected exception is a server fault, logged in full.
        ``confirm``, asked before recording: whether the worker may still record for the
        aggregate (a trainer that lost its hold on the run records nothing)."""
        started = time.perf_counter()
        command = events.command_of(accepted)
        try:
            body, media_type = await work()
            if confirm is not None and not await confirm():
                log.warning(
                    "request %s ran, but its run is held elsewhere now", accepted.request_id
                )
                return
            await self.complete(
                accepted.request_id,
                accepted.aggregate_id,
                body,
                media_type,
                request_aggregate=request_aggregate,
                compute_seconds=time.perf_counter() - started,
                epoch=epoch,
            )
        except Cancelled as cancelled:
            # Its outcome, the cancellation, is in the log already: nothing to record.
            telemetry.record_error(trace.get_current_span(), cancelled.kind, cancelled.detail)
            telemetry.work_done(command, time.perf_counter() - started, cancelled.kind)
            return
        except TinsmithError as error:
            failure = error
        except Exception as exc:
            log.exception("request %s failed in the %s", accepted.request_id, worker)
            failure = InternalError(f"{command} failed in the {worker}: {exc}")
        else:
            telemetry.work_done(command, time.perf_counter() - started)
            return
        telemetry.record_error(trace.get_current_span(), failure.kind, failure.detail)
        if confirm is not None and not await confirm():
            return
        await self.fail(
            accepted.request_id,
            accepted.aggregate_id,
            failure.kind,
            failure.detail,
            request_aggregate=request_aggregate,
            epoch=epoch,
        )
        telemetry.work_done(command, time.perf_counter() - started, failure.kind)


def _once(what: str, request_id: str, epoch: int) -> str:
    """The de-duplication id of a request's outcome or result. Within one epoch a retried append
    is recorded once; a later epoch's must not be taken for a repeat of a fenced one."""
    return f"{what}:{request_id}" if not epoch else f"{what}:{request_id}:{epoch}"


class FollowedProjection:
    """A ``jobs.Projection`` kept current by following the whole log from its start."""

    def __init__(
        self,
        eventlog: EventLog,
        on_event: Callable[[int, bus.Event, bytes], None] | None = None,
    ) -> None:
        self.eventlog = eventlog
        self.state = jobs.Projection()
        # Called with each event just after it is folded in (its log position, the event, its
        # bytes), on the event loop: how the trainer takes the requests of the runs it holds.
        self.on_event = on_event
        self._changed = asyncio.Condition()

    async def start(self) -> None:
        """Replay the log so far, then keep following it."""
        target = await self.eventlog.bus.last_seq(subjects.EVENTS_STREAM)
        await self.eventlog.bus.follow(subjects.EVENTS_STREAM, subjects.EVENTS_ALL, self._on_event)
        await self.wait_for(target)

    async def _on_event(self, seq: int, data: bytes) -> None:
        try:
            event = events.decode(data)
            self.state.apply(seq, event)
        except Exception:
            log.exception("event %d could not be applied; skipped", seq)
            self.state.position = max(self.state.position, seq)
        else:
            if self.on_event is not None:
                try:
                    self.on_event(seq, event, data)
                except Exception:
                    log.exception("event %d: its observer failed", seq)
        async with self._changed:
            self._changed.notify_all()

    async def wait_for(self, position: int, timeout: float | None = None) -> bool:
        """Wait until the projection reflects the log up to ``position``; False on timeout."""
        async with self._changed:
            try:
                await asyncio.wait_for(
                    self._changed.wait_for(lambda: self.state.position >= position), timeout
                )
            except TimeoutError:
                return False
        return True

    async def wait_until(self, predicate: object, timeout: float | None) -> bool:
        """Wait until ``predicate()`` holds after some event, or ``timeout`` seconds pass
        (``None``: no bound)."""
        assert callable(predicate)
        async with self._changed:
            try:
                await asyncio.wait_for(self._changed.wait_for(predicate), timeout)
            except TimeoutError:
                return False
        return True

    async def catch_up(self) -> None:
        """Wait until every event appended so far, by any process, is reflected."""
        await self.wait_for(await self.eventlog.bus.last_seq(subjects.EVENTS_STREAM))
