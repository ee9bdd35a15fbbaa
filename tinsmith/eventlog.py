"""Append to and replay the event log, and keep request results, over JetStream.

Owns: the mapping of events to subjects and streams, de-duplication of appends, the results
stream, and ``FollowedProjection``, which keeps a ``jobs.Projection`` current and lets a caller wait
until it reflects a given log position (read-your-writes). Does not own: what events mean.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field

from nats import errors as nats_errors
from nats.js.errors import NoStreamResponseError
from opentelemetry import trace

from tinsmith import events, jobs, snapshots, subjects, telemetry
from tinsmith._proto import bus_pb2 as bus
from tinsmith.bus import MAX_BODY_BYTES, Bus
from tinsmith.failures import (
    Cancelled,
    InternalError,
    InvalidRequest,
    TinsmithError,
    Unavailable,
)
from tinsmith.follower import Follower

log = logging.getLogger(__name__)

JSON = "application/json"
PROTOBUF = "application/x-protobuf"
_MEDIA_TYPES = {JSON: b"j", PROTOBUF: b"p"}
_MEDIA_BY_TAG = {tag: media for media, tag in _MEDIA_TYPES.items()}
# An outcome the bus did not take (a timeout, a lost connection) is sent again after this long,
# doubling up to the most: the work is done, and its outcome is recorded, not turned into a
# failure. Each retry carries the same message id, so it is stored once.
_RECORD_RETRY_S = 0.2
_RECORD_RETRY_MAX_S = 2.0
# What a bus that is away for a while raises (a timeout, a connection closed or being made
# again, a stream that does not answer yet): an outcome is sent again. Anything else is a fault
# of the outcome itself, recorded as the request's failure.
_TRANSIENT = (
    TimeoutError,
    nats_errors.TimeoutError,
    nats_errors.ConnectionClosedError,
    nats_errors.ConnectionReconnectingError,
    nats_errors.NoRespondersError,
    nats_errors.OutboundBufferLimitError,
    nats_errors.StaleConnectionError,
    NoStreamResponseError,
    Unavailable,
)


@dataclass(frozen=True)
class Outcome:
    """What a request's work produced: its result, and the scalars of it that the catalog keeps
    per run and step (``RequestCompleted.metrics``)."""

    body: bytes
    media_type: str
    metrics: Mapping[str, float] = field(default_factory=dict)


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
        metrics: Mapping[str, float] | None = None,
        started: float = 0.0,
    ) -> None:
        """Store a result, then record the completion that points at it. ``epoch``: the
        recording trainer's hold on the run (``bus.RunPlaced``); outcomes of an older one are
        ignored by the folds. ``metrics`` and ``started``: as ``bus.RequestCompleted`` says."""
        seq = await self.put_result(request_id, body, media_type, epoch=epoch)
        done = bus.RequestCompleted(
            request_id=request_id,
            aggregate_id=aggregate_id,
            result_seq=seq,
            media_type=media_type,
            compute_seconds=compute_seconds,
            replica=self.bus.replica,
            epoch=epoch,
            metrics=metrics or {},
            started=started,
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
        started: float = 0.0,
    ) -> None:
        failed = bus.RequestFailed(
            request_id=request_id,
            aggregate_id=aggregate_id,
            kind=kind,
            detail=detail,
            epoch=epoch,
            started=started,
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
        work: Callable[[], Awaitable[Outcome]],
        *,
        request_aggregate: str,
        worker: str,
        epoch: int = 0,
        confirm: Callable[[], Awaitable[bool]] | None = None,
        before_recording: Callable[[], Awaitable[None]] | None = None,
    ) -> bool:
        """Run a request's work and record its outcome: the result, or a failure whose kind
        says whose fault it was (a result too large to store is the request's: it fails with
        ``ResultTooLarge``). An unexpected exception is a server fault, logged in full.
        Returns whether the work's result was recorded: False when the work failed, and also
        when it succeeded but its result could not be stored (a failure is recorded instead) or
        nothing was recorded (a worker whose state the work changed then holds what the log
        does not say).
        ``before_recording``, awaited once the work is done and before anything is recorded
        (a trainer waits there for the outcome of the run's previous request to be recorded;
        what it raises propagates, and nothing is recorded). ``confirm``, asked before
        recording: whether the worker may still record for the aggregate (a trainer that lost
        its hold on the run records nothing)."""
        started = time.perf_counter()
        began = time.time()
        command = events.command_of(accepted)
        try:
            outcome = await work()
        except Cancelled as cancelled:
            # Its outcome, the cancellation, is in the log already: nothing to record.
            telemetry.record_error(trace.get_current_span(), cancelled.kind, cancelled.detail)
            telemetry.work_done(command, time.perf_counter() - started, cancelled.kind)
            return False
        except TinsmithError as error:
            failure = error
        except Exception as exc:
            log.exception("request %s failed in the %s", accepted.request_id, worker)
            failure = InternalError(f"{command} failed in the {worker}: {exc}")
        else:
            compute_seconds = time.perf_counter() - started
            if before_recording is not None:
                await before_recording()
            if confirm is not None and not await confirm():
                log.warning(
                    "request %s ran, but its run is held elsewhere now", accepted.request_id
                )
                return False
            try:
                await self._durably(
                    accepted.request_id,
                    lambda: self.complete(
                        accepted.request_id,
                        accepted.aggregate_id,
                        outcome.body,
                        outcome.media_type,
                        request_aggregate=request_aggregate,
                        compute_seconds=compute_seconds,
                        epoch=epoch,
                        metrics=outcome.metrics,
                        started=began,
                    ),
                )
            except TinsmithError as error:  # a result too large to store
                failure = error
            except Exception as exc:
                log.exception(
                    "the outcome of request %s could not be recorded", accepted.request_id
                )
                failure = InternalError(f"the outcome of {command} could not be recorded: {exc}")
            else:
                telemetry.work_done(command, time.perf_counter() - started)
                return True
        telemetry.record_error(trace.get_current_span(), failure.kind, failure.detail)
        if before_recording is not None:
            await before_recording()
        if confirm is not None and not await confirm():
            return False
        await self._durably(
            accepted.request_id,
            lambda: self.fail(
                accepted.request_id,
                accepted.aggregate_id,
                failure.kind,
                failure.detail,
                request_aggregate=request_aggregate,
                epoch=epoch,
                started=began,
            ),
        )
        telemetry.work_done(command, time.perf_counter() - started, failure.kind)
        return False

    async def _durably(self, request_id: str, record: Callable[[], Awaitable[None]]) -> None:
        """``await record()`` until the bus takes it: an outcome is never lost to a transient
        fault of the bus, nor turned into a failure of work that succeeded. Gives up only when
        this process closes its connection (the request is then another worker's to finish)."""
        delay = _RECORD_RETRY_S
        while True:
            try:
                await record()
                return
            except _TRANSIENT as exc:
                if self.bus.closing:
                    raise
                log.warning(
                    "could not record the outcome of request %s (%r); again in %.1f s",
                    request_id,
                    exc,
                    delay,
                )
            await asyncio.sleep(delay)
            delay = min(_RECORD_RETRY_MAX_S, delay * 2)


def _once(what: str, request_id: str, epoch: int) -> str:
    """The de-duplication id of a request's outcome or result. Within one epoch a retried append
    is recorded once; a later epoch's must not be taken for a repeat of a fenced one."""
    return f"{what}:{request_id}" if not epoch else f"{what}:{request_id}:{epoch}"


class FollowedProjection:
    """A ``jobs.Projection`` kept current by following the log: from the newest snapshot of it
    that this version can read (tinsmith/snapshots.py: the gateway's or the trainer's), else from
    the log's start. With ``keep_snapshots`` it writes its own now and then, after forgetting
    the requests nothing can ask about any more (``jobs.Projection.prune``), so that a start
    replays a bounded tail of the log and memory follows what is live, not the whole history.

    Events purged from the log (tinsmith/retention.py drops only what every kind's snapshot
    covers) are never silently skipped: a start whose snapshot (or lack of one) does not reach
    the log's first event fails with ``LogTruncated``, and a projection that finds a gap while it
    follows (a purge overtook it) starts over from the newest snapshot."""

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
        self.snapshots = snapshots.Store(eventlog.bus)
        self.kind = ""  # the kind of snapshot it writes (keep_snapshots); "": none
        self.policy = snapshots.Policy()
        self.started_from = 0  # the position of the snapshot it started from; 0: the log's start
        self._reader: Follower | None = None
        self._log = ""  # the event log's identity (snapshots.log_identity)
        self._started = False
        self._since = 0  # events applied since the last snapshot
        self._first_since = 0.0  # when the first of them was (monotonic)
        self._writing = False
        self._failed_at = -_RETRY_S  # when the last write failed: the next waits _RETRY_S
        self._resyncing = False

    def keep_snapshots(self, kind: str, policy: snapshots.Policy | None = None) -> None:
        """Write this projection's snapshot as ``kind`` (one of ``snapshots.KINDS``) whenever
        ``policy`` says (None: ``snapshots.Policy.from_env()``). Call it before ``start``."""
        assert kind in snapshots.KINDS, kind
        self.kind = kind
        self.policy = policy or snapshots.Policy.from_env()

    async def start(self) -> None:
        """Load the newest snapshot this version reads, replay the log after it, then keep
        following it."""
        target = await self.eventlog.bus.last_seq(subjects.EVENTS_STREAM)
        self._log = await snapshots.log_identity(self.eventlog.bus)
        loaded = await self._load()
        await self._follow_from(loaded)
        await self.wait_for(target)
        self._started = True
        self._maybe_write()

    async def _load(self) -> jobs.Projection | None:
        return await newest_projection(self.snapshots, self._log)

    async def _follow_from(self, loaded: jobs.Projection | None) -> None:
        bus_ = self.eventlog.bus
        info = await bus_.js.stream_info(subjects.EVENTS_STREAM)
        # Where the log is whole from: the retention keeps the key events below it.
        first = max(int(info.state.first_seq), await self.snapshots.purged())
        start = loaded.position + 1 if loaded is not None else 1
        if first > start:
            raise LogTruncated(
                f"the event log starts at position {first}, after {start - 1}, where "
                + (
                    f"the newest snapshot this version reads ends (log position {start - 1})"
                    if loaded is not None
                    else "this version would have to start: no snapshot it reads is kept"
                )
                + ". Events the snapshots covered were dropped (tinsmith/retention.py); "
                "snapshots written by another version are not read by this one (see the "
                "warnings above): start the version that wrote them, which reads them"
            )
        if loaded is None:
            log.info("no snapshot of the log to start from: replaying it from its start")
        self.state = loaded if loaded is not None else jobs.Projection()
        self.started_from = self.state.position
        self._since, self._first_since = 0, time.monotonic()
        self._reader = await bus_.follow(
            subjects.EVENTS_STREAM, subjects.EVENTS_ALL, self._on_event, start_seq=start
        )

    async def _on_event(self, seq: int, data: bytes) -> None:
        if self._resyncing:
            return
        if seq > self.state.position + 1:
            # Events before this one were purged before this projection read them.
            self._resyncing = True
            self.eventlog.bus.spawn(self._resync(seq))
            return
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
        self._since += 1
        if self._since == 1:
            self._first_since = time.monotonic()
            if self.kind:  # a slow trickle of events is written after policy.every_s too
                asyncio.get_running_loop().call_later(self.policy.every_s, self._maybe_write)
        if self._since >= self.policy.every_events:
            self._maybe_write()
        async with self._changed:
            self._changed.notify_all()

    async def _resync(self, seq: int) -> None:
        """Start over from the newest snapshot: the log no longer holds the events between this
        projection's position and ``seq``."""
        missing = (self.state.position + 1, seq - 1)
        log.warning("events %d to %d left the log before this projection read them", *missing)
        try:
            if self._reader is not None:
                await self._reader.stop()
            loaded = await self._load()
            if loaded is None or loaded.position < missing[1]:
                log.error(
                    "no snapshot covers events %d to %d: this projection goes on without them",
                    *missing,
                )
                self._reader = await self.eventlog.bus.follow(
                    subjects.EVENTS_STREAM, subjects.EVENTS_ALL, self._on_event, start_seq=seq
                )
                self.state.position = seq - 1
            else:
                await self._follow_from(loaded)
        except Exception:
            log.exception("the projection could not start over from a snapshot")
        finally:
            self._resyncing = False
        async with self._changed:
            self._changed.notify_all()

    def _maybe_write(self) -> None:
        """Write a snapshot in the background if one is due and none is being written."""
        if not self.kind or not self._started or self._writing:
            return
        if time.monotonic() - self._failed_at < _RETRY_S:
            return
        if self.policy.due(self._since, self._first_since, time.monotonic()):
            self._writing = True
            self.eventlog.bus.spawn(self._write())

    async def write_snapshot(self) -> bool:
        """Forget what nothing asks about any more, then store the projection as it is now (its
        encoding runs on a worker thread). False when a newer one was stored meanwhile."""
        bus_ = self.eventlog.bus
        results = await bus_.js.stream_info(subjects.RESULTS_STREAM)
        max_age = results.config.max_age or 0.0
        pruned = self.state.prune(
            int(results.state.first_seq), idle_before=time.time() - max_age if max_age else 0.0
        )
        copy = _CODEC.copy(self.state)  # no await since the prune: one consistent state
        self._since = 0
        header = snapshots.Header(
            kind=self.kind,
            position=copy.position,
            fingerprint=_CODEC.fingerprint,
            log=self._log,
            written_at=time.time(),
        )
        started = time.perf_counter()
        data = await asyncio.to_thread(_encode_snapshot, copy, header)
        saved = await self.snapshots.save(header, data)
        log.info(
            "%s snapshot at log position %d: %d requests (%d forgotten), %.1f MB, %.2f s%s",
            self.kind,
            header.position,
            len(copy.requests),
            pruned,
            len(data) / 1e6,
            time.perf_counter() - started,
            "" if saved else "; not stored, a newer one is there",
        )
        return saved

    async def _write(self) -> None:
        try:
            await self.write_snapshot()
        except Exception:
            if not self.eventlog.bus.closing:
                log.exception("writing the %s snapshot failed; trying again later", self.kind)
            self._writing = False
            self._failed_at = time.monotonic()
            return
        self._writing = False
        self._maybe_write()  # what was applied meanwhile may be due already

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
        info = await self.eventlog.bus.js.stream_info(subjects.EVENTS_STREAM)
        first = int(info.state.first_seq)
        if self.state.position < int(info.state.last_seq):  # behind: was it purged past?
            first = max(first, await self.snapshots.purged())
        if first > self.state.position + 1 and self._reader is not None and not self._resyncing:
            # The log was purged past this projection: no event it waits for will come.
            self._resyncing = True
            self.eventlog.bus.spawn(self._resync(first))
        await self.wait_for(int(info.state.last_seq))


# -- projection snapshots (FollowedProjection) -------------------------------------------------

# The kinds of snapshot that hold a jobs.Projection, and how they are written.
_JOBS_KINDS = ("gateway", "trainer")
_RETRY_S = 30.0  # after a snapshot failed to be written, the next try waits this long
_CODEC = snapshots.Codec(jobs.Projection)


class LogTruncated(RuntimeError):
    """The log no longer holds events a projection needs, and no snapshot it reads covers them."""


def _encode_snapshot(state: jobs.Projection, header: snapshots.Header) -> bytes:
    return snapshots.pack(header, _CODEC.encode(state))


def _decode_snapshot(data: bytes, log_id: str) -> jobs.Projection:
    header, body = snapshots.unpack(data)
    if header.fingerprint != _CODEC.fingerprint or header.log != log_id:
        raise ValueError("the snapshot's fingerprint or log changed while it was read")
    state = _CODEC.decode(body)
    if state.position != header.position:
        raise ValueError(f"the snapshot says {header.position}, its state {state.position}")
    return state


async def newest_projection(store: snapshots.Store, log_id: str) -> jobs.Projection | None:
    """The newest ``jobs.Projection`` snapshot of the log ``log_id`` that this version reads,
    or None (each one passed over says why in the log)."""
    headers = []
    for kind in _JOBS_KINDS:
        try:
            header = await store.latest(kind)
        except Exception:
            log.exception("the %s snapshot's header could not be read", kind)
            continue
        if header is None:
            continue
        if header.log != log_id:
            log.info("the %s snapshot is of another event log; not used", kind)
        elif header.fingerprint != _CODEC.fingerprint:
            log.warning(
                "the %s snapshot at %d was written by a version whose projection differs "
                "(fingerprint %s, this version's %s); not used, the log is replayed instead",
                kind,
                header.position,
                header.fingerprint,
                _CODEC.fingerprint,
            )
        else:
            headers.append(header)
    for header in sorted(headers, key=lambda h: h.position, reverse=True):
        started = time.perf_counter()
        try:
            data = await store.read(header.kind)
            if data is None:
                continue
            state = await asyncio.to_thread(_decode_snapshot, data, log_id)
        except Exception:
            log.exception("the %s snapshot at %d could not be read", header.kind, header.position)
            continue
        log.info(
            "projection from the %s snapshot at log position %d (%.1f MB, read in %.2f s)",
            header.kind,
            state.position,
            header.size / 1e6,
            time.perf_counter() - started,
        )
        return state
    return None
