"""The trainer's work loop: the runs this replica holds, their requests taken from the log in
each run's seq_id order, executed on the compute thread, with results and events appended back.

Owns:
- holding runs among the fleet's replicas (tinsmith/leases.py): a run with requests and no live
  holder is taken by the replica first in the placement order (placement.py), the others stepping
  in after it if it does not; taking it appends ``RunPlaced`` with the hold's epoch, and every
  outcome this replica records for the run carries that epoch, so that once another replica took
  the run over, what this one still records is ignored by every fold (fencing). A run lost (taken
  over) is dropped from memory without recording anything; a replica that lost its own lease
  drops every run;
- rebuilding a run it takes: from the run's latest snapshot (or its creation), the requests the
  log holds after it are executed again in seq_id order; those whose outcome is already recorded
  only to rebuild the state (their results are not recorded twice; a failed one changed nothing
  and is skipped), those without one normally;
- fusing: forward_backward requests of several runs on one base model that are ready together
  run as one pass (fusion.py);
- ordering: the SDK may send a forward_backward's chunks out of order, chunk 1 last, and a
  request the gateway rejected leaves its seq_id to be skipped. Requests come from the log as
  this replica's projection folds them (``FollowedProjection.on_event``), and are read back
  from the log by position when their turn comes (the next one while the one before it
  computes): nothing waits in memory but their positions;
- overlapping: a run's next request runs while the outcome before it is recorded (three round
  trips to the bus); outcomes are recorded in seq_id order all the same, at most one while the
  next request runs, and a request followed by a snapshot settles before the next one starts;
- failing alone: whatever goes wrong around one request (reading it, restoring its run, executing
  it, recording its outcome) ends that request failed (an unexpected exception as an
  ``InternalError``, logged once with its traceback), spends its seq_id and lets the run's later
  requests run; a failure the log refuses to record is retried until it is recorded (or, if the
  trainer stops first, the request is left to the run's next holder);
- memory no further than the log: a request that changed the run (create, load, a
  forward_backward, an optim_step) but whose result the log does not hold (the bus refused it,
  and a failure is recorded instead; or nothing could be recorded before a stop) leaves the run
  ahead of its log. Such a run goes no further and is never snapshotted: it is let go and
  rebuilt from its latest recorded snapshot and the log, as after a crash (``_let_go``), so a
  failed request changed nothing and an unrecorded one runs again at its next holder;
- poison: a request that takes down every replica that runs it ends failed, not looping: once a
  run was taken over ``MAX_TAKEOVERS`` times from holders that died without recording any
  outcome, its next request is failed instead of run;
- snapshots: every ``TrainerConfig.snapshot_every`` optimizer steps and after every save_state, a
  run's state is written to the object store in the background (``RunSnapshotted``), so a
  rebuild re-executes a bounded tail of the log;
- letting go of idle runs: a run whose session stopped heart-beating is snapshotted, unloaded and
  released (``RunUnloaded``); its next request places it again, here or on another replica;
- making room on the device: when the engine says that a run, a base model or a step does not
  fit what is free of its memory budget (``OutOfBudget``), the runs with nothing to do are
  unloaded the same way, least recently used first, until it fits;
- stopping: the replica says it is draining, the request running now finishes, and every run it
  holds is snapshotted, unloaded and released, so the other replicas take the runs and their
  waiting requests at once (or the next trainer, after a restart).

Does not own: the torch math (engine.py), where runs go (placement.py), or the leases.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import logging
import tempfile
import time
from collections.abc import Awaitable, Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import nats.errors
import nats.js.errors
from opentelemetry.context import Context
from opentelemetry.trace import SpanKind

from services import gpu
from tinsmith import artifacts, events, jobs, models, subjects, telemetry
from tinsmith._proto import bus_pb2 as bus
from tinsmith._proto import tinker_public_pb2 as tp
from tinsmith.blobs import BlobStore
from tinsmith.bus import Bus
from tinsmith.compute import ComputeThread
from tinsmith.eventlog import JSON, PROTOBUF, EventLog, FollowedProjection, Outcome
from tinsmith.failures import InternalError, NotFound, TinsmithError
from tinsmith.leases import Fleet, Replica
from tinsmith.tensors import model_input_tokens

from . import placement
from .config import TrainerConfig
from .engine import OutOfBudget, TrainerEngine
from .fusion import Ask, Fuser, default_limits

log = logging.getLogger(__name__)
_T = TypeVar("_T")

# Waits between attempts to record a failure that the log refused (it is down, say).
_RECORD_RETRY_S = (0.5, 1.0, 2.0, 5.0, 10.0, 30.0)
# A failure's detail is cut to this many characters, so that recording it cannot fail for size.
_MAX_DETAIL = 4000
# Takeovers of a run from holders that died without recording an outcome, after which the run's
# next request is failed rather than run (it is the likely cause).
MAX_TAKEOVERS = 4
# What the bus raises while it is unreachable for a moment (a nats-server restarting).
_TRANSIENT = (
    nats.errors.TimeoutError,
    nats.errors.ConnectionClosedError,
    nats.errors.ConnectionReconnectingError,
    nats.errors.NoRespondersError,
    nats.errors.StaleConnectionError,
    nats.js.errors.ServiceUnavailableError,
)
# The commands the fuser takes (fusion.py); a forward is a forward_backward request.
_FUSED = frozenset({"forward_backward", "optim_step"})
# The commands whose execution changes a run's state: re-executed when a run is rebuilt.
_STATEFUL = frozenset({"create_model", "load_weights", "forward_backward", "optim_step"})


def _changes_run(accepted: bus.RequestAccepted) -> bool:
    """Whether the request's work changes the run's state (a forward-only pass does not)."""
    command = events.command_of(accepted)
    forward_only = command == "forward_backward" and accepted.forward_backward.forward_only
    return command in _STATEFUL and not forward_only


class _Unrecorded(Exception):
    """A request of the run ran but its result is not what the log holds (it could not be
    recorded: the trainer is stopping, or lost the run; or the bus refused the result, and a
    failure was recorded instead), or the run's previous request is such a one: nothing after it
    is recorded either."""


@dataclass
class _Work:
    """A request of a run, held until its seq_id's turn: where it is in the log."""

    seq_id: int
    request_id: str  # "" for a seq_id the gateway rejected: nothing runs, it is only spent
    log_seq: int


@dataclass
class _RunQueue:
    create: bus.CreateModel
    epoch: int  # this replica's hold on the run
    next_seq: int = 0
    pending: dict[int, _Work] = field(default_factory=dict)
    busy: bool = False
    restore_from: str = ""  # a snapshot to restore before the next request ("" once in memory)
    unloaded: bool = False  # the snapshot is an unloaded run's: its restore is recorded
    broken: TinsmithError | None = None  # why the run could not be rebuilt
    lost: bool = False  # another replica holds the run now
    steps: int = 0  # optimizer steps since the latest snapshot
    snapshots: asyncio.Lock = field(default_factory=asyncio.Lock)  # one snapshot at a time
    used: float = field(default_factory=time.monotonic)  # when its latest request began
    # The message of the run's next request, being read while the request before it runs.
    read_ahead: tuple[int, asyncio.Future[tuple[bytes, Context, int]]] | None = None
    # When the run's step began waiting for the compute thread: its first forward_backward since
    # its last optim_step (None: no forward_backward since). The optim_step keeps that place.
    step_since: float | None = None
    # What memory holds of the run is ahead of its log: a request ran whose result the log does
    # not hold (``_Unrecorded``). Such a run is never snapshotted: it is let go (``_let_go``) and
    # rebuilt from its latest recorded snapshot and the log, as after a crash.
    diverged: bool = False


class Trainer:
    def __init__(
        self,
        bus_: Bus,
        engine: TrainerEngine,
        blobs: BlobStore,
        config: TrainerConfig,
    ) -> None:
        self.bus = bus_
        self.log = EventLog(bus_)
        self.projection = FollowedProjection(self.log, on_event=self._on_event)
        self.engine = engine
        self.blobs = blobs
        self.config = config
        self.compute = ComputeThread(
            "trainer-compute",
            engine.init_compute_thread,
            device=engine.device,
            gpu_clock=gpu.cuda_clock(engine.device()),
        )
        pass_limit, request_limit = default_limits(engine.placement.device)
        if config.fuse_tokens is not None:
            pass_limit = config.fuse_tokens
        if config.fuse_request_tokens is not None:
            request_limit = config.fuse_request_tokens
        self.fuser = Fuser(
            self.compute, engine, self._alone, pass_limit, request_limit, self._follows
        )
        self.fleet = Fleet(
            bus_,
            config.replica or bus_.replica,
            config.lease_s,
            self._describe,
            on_lost=self._on_lost,
            on_fenced=self._on_fenced,
            on_orphaned=self._on_orphaned,
        )
        self.queues: dict[str, _RunQueue] = {}  # the runs this replica holds
        self.last_seen: dict[str, float] = {}  # session id -> monotonic time of last sign of life
        self._placing: set[str] = set()  # runs this replica considers taking now
        self._reaper_wake = asyncio.Event()
        self._quiet = asyncio.Event()  # set whenever a run's queue stops being busy
        self._stop = asyncio.Event()  # set when the trainer begins to stop
        self._started = False

    async def start(self) -> None:
        telemetry.observe_models(self.engine.loaded)
        gpu.observe_memory(self.engine.device())
        telemetry.observe(
            "tinsmith.queue.depth",
            lambda: {
                (("tinsmith.queue", "trainer.local"),): float(
                    sum(len(q.pending) for q in list(self.queues.values()))
                )
            },
            unit="{request}",
            description="Requests this trainer holds, waiting for their run's turn",
        )
        with contextlib.suppress(Exception):  # the work queue of versions before leases
            await self.bus.js.delete_consumer(subjects.EVENTS_STREAM, subjects.TRAINER_CONSUMER)
        await self.projection.start()
        await self.fleet.start()
        await self.bus.listen(subjects.SESSION_HEARTBEATS, self._on_heartbeat)
        self._started = True
        self.bus.spawn(self._reap_idle_runs())
        await self._on_orphaned(self._waiting_runs())

    async def stop(self) -> None:
        """On a graceful stop: take no more runs and let the requests running now finish, then
        snapshot, unload and release every run held, so that another replica (or the next
        trainer) takes each one with its waiting requests at once: stopping loses nothing."""
        self._stop.set()
        await self.fleet.drain()
        for model_id, queue in list(self.queues.items()):
            while queue.busy:  # a running step (or an unload) finishes first
                self._quiet.clear()
                await self._quiet.wait()
            if self.queues.get(model_id) is queue and not queue.lost:
                try:
                    await self._unload(model_id, queue, why="stop")
                except Exception:
                    log.exception("could not snapshot run %s while stopping", model_id)
        await self.fleet.leave()
        self.compute.shutdown()

    @property
    def stopping(self) -> bool:
        return self._stop.is_set()

    def _describe(self) -> Replica:
        return Replica(
            name=self.fleet.name,
            instance=self.fleet.instance,
            base_models=tuple(self.engine.loaded()),
            free_bytes=max(0, self.engine.free_bytes()),
            budget_bytes=self.engine.placement.memory_bytes,
            draining=self.stopping,
        )

    async def _on_heartbeat(self, payload: bytes) -> None:
        self.last_seen[payload.decode()] = time.monotonic()

    # -- placement -----------------------------------------------------------------------------

    def _on_event(self, seq: int, event: bus.Event, data: bytes) -> None:
        """Each event as this replica's projection folds it: a request for a run held here joins
        its queue; one for a run nobody live holds may be taken; a later hold on a run held here
        means it was lost."""
        kind = events.kind_of(event)
        if kind in ("request_accepted", "request_rejected"):
            body = getattr(event, kind)
            model_id = body.aggregate_id
            if model_id not in self.projection.state.runs:
                return  # a sampler's
            queue = self.queues.get(model_id)
            if queue is None:
                if self._started:
                    self.bus.spawn(self._consider(model_id))
                return
            request_id = body.request_id if kind == "request_accepted" else ""
            self._hold(model_id, queue, _Work(body.seq_id, request_id, seq))
        elif kind == "run_placed":
            placed = event.run_placed
            queue = self.queues.get(placed.model_id)
            if queue is not None and placed.epoch > queue.epoch:
                self.bus.spawn(self._on_lost(placed.model_id))

    def _hold(self, model_id: str, queue: _RunQueue, work: _Work) -> None:
        """Keep ``work`` until its turn (the first message in the log for a seq_id wins)."""
        if work.seq_id < queue.next_seq or work.seq_id in queue.pending:
            return
        queue.pending[work.seq_id] = work
        self.last_seen[queue.create.session_id] = time.monotonic()
        self._kick(model_id, queue)

    def _kick(self, model_id: str, queue: _RunQueue) -> None:
        if not queue.busy and not queue.lost and not queue.diverged and not self.stopping:
            queue.busy = True
            self.bus.spawn(self._advance(model_id, queue))

    def _follows(self, model_id: str) -> bool:
        """Whether the run's next request is here, in its order right after the one running
        now, and is one the fuser takes."""
        queue = self.queues.get(model_id)
        if queue is None or queue.lost or queue.diverged or self.stopping:
            return False
        work = queue.pending.get(queue.next_seq + 1)
        state = self.projection.state.requests.get(work.request_id) if work else None
        return state is not None and state.command in _FUSED

    def _waiting_runs(self) -> list[str]:
        """The runs with requests not yet settled."""
        return [m for m, n in self.projection.state.pending_runs.items() if n > 0]

    async def _on_orphaned(self, model_ids: Iterable[str]) -> None:
        for model_id in model_ids:
            self.bus.spawn(self._consider(model_id))

    async def _consider(self, model_id: str) -> None:
        """Take the run if it has work, nobody live holds it, and this replica comes first in
        the placement order (or those before it let it be)."""
        if model_id in self.queues or model_id in self._placing or self.stopping:
            return
        self._placing.add(model_id)
        try:
            wait = self._placement_delay(model_id)
            if wait is None:
                return
            if wait:
                await asyncio.sleep(wait)
            if self._placement_delay(model_id) is None or self.stopping:
                return
            await self.projection.catch_up()
            run = self.projection.state.runs[model_id]
            epoch = await self.fleet.take(model_id)
            if epoch is None:
                return
            try:
                await self._adopt(model_id, epoch, takeover=run.placed)
            except Exception:
                log.exception("could not take run %s; letting it go", model_id)
                self.queues.pop(model_id, None)
                await self.fleet.release(model_id)
        except Exception:
            log.exception("could not place run %s", model_id)
        finally:
            self._placing.discard(model_id)

    def _placement_delay(self, model_id: str) -> float | None:
        """How long to wait before taking the run; None: not this replica's to take (no work,
        or held by a live replica)."""
        run = self.projection.state.runs.get(model_id)
        if run is None or not self.projection.state.pending_runs.get(model_id):
            return None
        if self.fleet.holder(model_id) is not None:
            return None
        names = placement.order(self.fleet.replicas.values(), run.base_model)
        if self.fleet.name not in names:
            return None
        return placement.delay(names, self.fleet.name)

    async def _adopt(self, model_id: str, epoch: int, *, takeover: bool) -> None:
        """Record the hold, then queue what the log holds for the run from its latest snapshot
        (or its creation) on."""
        placed = bus.RunPlaced(
            model_id=model_id, replica=self.fleet.name, epoch=epoch, takeover=takeover
        )
        position, _ = await self.log.append(events.make(run_placed=placed))
        await self.projection.wait_for(position)
        state = self.projection.state
        run = state.runs[model_id]
        snapshot = run.snapshot or run.last_snapshot
        if snapshot is not None:
            create, next_seq = snapshot.create, int(snapshot.next_seq_id)
        else:
            create, next_seq = await self._creation(model_id), 0
        # From here on no await: what the projection holds now is queued, and each later
        # request joins through ``_on_event``.
        run = state.runs[model_id]
        queue = _RunQueue(
            create=create,
            epoch=epoch,
            next_seq=next_seq,
            restore_from=snapshot.snapshot_key if snapshot is not None else "",
            unloaded=run.snapshot is not None,
        )
        for seq_id in itertools.chain(range(next_seq, run.next_seq_id), sorted(run.spent_ahead)):
            request_id = events.request_id(model_id, seq_id)
            if request_id in state.rejections:
                queue.pending[seq_id] = _Work(seq_id, "", 0)
            elif request_id in state.requests:
                queue.pending[seq_id] = _Work(
                    seq_id, request_id, state.requests[request_id].log_seq
                )
        self.queues[model_id] = queue
        self.last_seen[create.session_id] = time.monotonic()
        log.info(
            "holds run %s (epoch %d%s) from seq_id %d, %d requests to go",
            model_id,
            epoch,
            ", taken over" if takeover else "",
            next_seq,
            len(queue.pending),
        )
        self._kick(model_id, queue)
        self._reaper_wake.set()

    async def _creation(self, model_id: str) -> bus.CreateModel:
        """The command that created the run (its seq_id 0), read back from the log."""
        created = self.projection.state.requests[events.request_id(model_id, 0)]
        data, _, _ = await self.bus.get_message(subjects.EVENTS_STREAM, created.log_seq)
        return events.decode(data).request_accepted.create_model

    async def _on_lost(self, model_id: str) -> None:
        """Another replica holds the run now: drop it without recording anything."""
        queue = self.queues.pop(model_id, None)
        self.fleet.forget(model_id)
        if queue is None or queue.lost:
            return
        queue.lost = True
        queue.pending.clear()
        while queue.busy:
            self._quiet.clear()
            await self._quiet.wait()
        await self.compute.run(self.engine.unload, model_id)
        log.warning("dropped run %s: another trainer holds it now", model_id)

    async def _on_fenced(self) -> None:
        for model_id in list(self.queues):
            await self._on_lost(model_id)

    # -- ordering ------------------------------------------------------------------------------

    async def _advance(self, model_id: str, queue: _RunQueue) -> None:
        """Take the run's requests while the next seq_id is here; later ones wait for it. Each
        one that comes to its turn ends with an outcome and spends its seq_id, whatever
        happens to it. A request's outcome is recorded while the run's next request runs
        (``_begin``); the outcomes are recorded in seq_id order all the same."""
        # The settlings of the latest request and of the one before it. At most one outcome is
        # being recorded while the next request runs.
        earlier: asyncio.Task[bool] | None = None
        behind: asyncio.Task[bool] | None = None
        try:
            if queue.restore_from and not queue.lost:
                await self._restore(model_id, queue)
            while not self.stopping and not queue.lost:
                work = queue.pending.pop(queue.next_seq, None)
                if work is None:
                    # Nothing to run yet: the next request may come while the latest outcomes
                    # are recorded, and it runs here too.
                    if behind is None:
                        break
                    settled = [await task for task in (earlier, behind) if task is not None]
                    earlier = behind = None
                    if not all(settled):
                        break
                    continue
                if earlier is not None and not await earlier:
                    queue.pending[work.seq_id] = work
                    break  # stopping: the run's next holder takes it
                earlier, behind = behind, await self._begin(model_id, queue, work, behind)
                if behind.done() and not behind.result():
                    break
                queue.next_seq = work.seq_id + 1
        except asyncio.CancelledError:  # the connection closes: nothing more is recorded
            for task in (earlier, behind):
                if task is not None:
                    task.cancel()
            earlier = behind = None
            raise
        finally:
            for task in (earlier, behind):
                if task is not None:
                    await task
            queue.busy = False
            self.fuser.release(model_id)
            self._quiet.set()
            self._reaper_wake.set()
        if queue.diverged and not queue.lost and not self.stopping:
            await self._let_go(model_id, queue)

    async def _begin(
        self, model_id: str, queue: _RunQueue, work: _Work, behind: asyncio.Task[bool] | None
    ) -> asyncio.Task[bool]:
        """Start the request's turn after ``behind`` (the settling of the run's previous
        request, still recording its outcome, or None), and return its settling once its work
        is done: the run's next request can run while its outcome is recorded. A request
        whose work is followed by a snapshot (``_execute``) settles before this returns."""
        computed = asyncio.Event()
        turn = asyncio.ensure_future(self._turn(model_id, queue, work, behind, computed.set))
        settling = asyncio.ensure_future(self._settled(model_id, queue, work, turn, behind))
        done = asyncio.ensure_future(computed.wait())
        try:
            await asyncio.wait((settling, done), return_when=asyncio.FIRST_COMPLETED)
        except asyncio.CancelledError:
            settling.cancel()  # and the turn it awaits
            raise
        finally:
            done.cancel()
        return settling

    async def _settled(
        self,
        model_id: str,
        queue: _RunQueue,
        work: _Work,
        turn: Awaitable[None],
        behind: asyncio.Task[bool] | None,
    ) -> bool:
        """Wait for the request's turn to end with its outcome recorded; what went wrong around
        it is recorded as its failure (after ``behind``'s outcome). False when the trainer began
        to stop (or lost the run) before it could record it, or the request ran but the log
        holds a failure instead of its result: the run advances no further, and what memory
        holds of it is not to be trusted (``_RunQueue.diverged``)."""
        try:
            await turn
        except _Unrecorded:
            queue.diverged = True
            return False
        except Exception as exc:
            if (
                queue.lost
                or (behind is not None and not await behind)
                or not await self._record_failure(model_id, queue, work, exc)
            ):
                queue.diverged = True
                return False
        return not queue.diverged  # a failure recorded for a request that had changed the run

    async def _turn(
        self,
        model_id: str,
        queue: _RunQueue,
        work: _Work,
        behind: asyncio.Task[bool] | None,
        computed: Callable[[], None],
    ) -> None:
        """The request's turn: re-execute it to rebuild the state if its outcome is recorded,
        fail it if the run cannot be rebuilt or it is the likely poison, else run it."""
        if not work.request_id:
            return
        state = self.projection.state.requests.get(work.request_id)
        recorded = state is not None and state.status is not jobs.Status.PENDING
        if (
            state is not None
            and recorded
            and (state.status is not jobs.Status.COMPLETED or state.command not in _STATEFUL)
        ):
            return  # a failure changed nothing, nor did a forward or a save
        data, trace, stored_ns = await self._read(queue, work)
        accepted = events.decode(data).request_accepted
        if recorded:
            await self._replay(accepted, queue)
            return
        if queue.broken is not None:
            raise queue.broken
        run = self.projection.state.runs.get(model_id)
        if run is not None and run.takeovers >= MAX_TAKEOVERS:
            raise InternalError(
                f"training run {model_id} was taken over {run.takeovers} times from trainers "
                f"that died before recording an outcome; request {work.request_id} is failed so "
                "that it cannot take down more of them. If it did not cause that, send it again"
            )

        async def after_behind() -> None:
            if behind is not None and not await behind:
                raise _Unrecorded

        following = queue.pending.get(work.seq_id + 1)
        if following is not None and following.request_id:
            # Read while this one runs, so that it can start as soon as this one is done.
            ahead = asyncio.ensure_future(
                self.bus.get_message(subjects.EVENTS_STREAM, following.log_seq)
            )
            ahead.add_done_callback(lambda read: read.cancelled() or read.exception())
            queue.read_ahead = (following.log_seq, ahead)
        await self._execute(accepted, trace, stored_ns, queue, after_behind, computed)

    async def _read(self, queue: _RunQueue, work: _Work) -> tuple[bytes, Context, int]:
        """The request's message in the log (read ahead while the run's previous one ran, or
        now)."""
        ahead, queue.read_ahead = queue.read_ahead, None
        if ahead is not None:
            log_seq, read = ahead
            if log_seq == work.log_seq:
                with contextlib.suppress(Exception):  # read again below, patiently
                    return await read
            read.cancel()
        return await self._patiently(
            lambda: self.bus.get_message(subjects.EVENTS_STREAM, work.log_seq)
        )

    async def _record_failure(
        self, model_id: str, queue: _RunQueue, work: _Work, exc: Exception
    ) -> bool:
        """Record that a request failed outside its work's own settling (it could not be read,
        the run could not be rebuilt, or its outcome could not be recorded). Retried while the
        log refuses it; False if the trainer began to stop (or lost the run) first."""
        if not work.request_id:
            return True
        if isinstance(exc, TinsmithError):
            failure = exc
            log.warning("request %s failed in the trainer: %s", work.request_id, exc.detail)
        else:
            log.error("request %s failed in the trainer", work.request_id, exc_info=exc)
            failure = InternalError(f"the request failed in the trainer: {exc!r}")
        detail = failure.detail[:_MAX_DETAIL]
        for attempt in itertools.count():
            try:
                if not await self.fleet.confirm(model_id):
                    return False
                await self.log.fail(
                    work.request_id,
                    model_id,
                    failure.kind,
                    detail,
                    request_aggregate="run",
                    epoch=queue.epoch,
                )
                return True
            except Exception as refused:
                wait = _RECORD_RETRY_S[min(attempt, len(_RECORD_RETRY_S) - 1)]
                log.warning(
                    "could not record the failure of request %s (%r); again in %.1f s",
                    work.request_id,
                    refused,
                    wait,
                )
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._stop.wait(), wait)
                if self.stopping or queue.lost:
                    return False
        raise AssertionError("unreachable")

    async def _execute(
        self,
        accepted: bus.RequestAccepted,
        trace: Context,
        stored_ns: int,
        queue: _RunQueue,
        before_recording: Callable[[], Awaitable[None]],
        computed: Callable[[], None],
    ) -> None:
        """Run one request, now that its turn has come, in the trace that accepted it, and
        record its outcome once ``before_recording`` returns (unless another replica took the
        run meanwhile). ``computed()`` is called once its work is done, unless a snapshot of
        the run follows it: the snapshot is of the state right after it."""
        command = events.command_of(accepted)
        handler = getattr(self, f"_{command}", None)
        if handler is None:
            raise InternalError(f"the trainer does not know the command {command!r}")
        telemetry.queue_wait(command, stored_ns, trace)
        queue.used = time.monotonic()
        model_id = accepted.aggregate_id
        saved_state = (
            command == "save_weights" and accepted.save_weights.kind == bus.CHECKPOINT_KIND_TRAINING
        )
        if command == "optim_step":
            queue.steps += 1
        snapshot_now = saved_state or queue.steps >= self.config.snapshot_every > 0

        ran = False

        async def work() -> Outcome:
            nonlocal ran
            try:
                result: Outcome = await handler(accepted, queue)
                ran = True
            finally:
                if not snapshot_now:
                    computed()
            return result

        async def holding() -> bool:
            return not queue.lost and await self._patiently(lambda: self.fleet.confirm(model_id))

        with (
            telemetry.tracer.start_as_current_span(
                f"trainer {command}",
                context=trace,
                kind=SpanKind.CONSUMER,
                attributes=self._attributes(model_id, queue),
            ),
            telemetry.request_scope(accepted.request_id),
        ):
            recorded = False
            try:
                recorded = await self.log.settle(
                    accepted,
                    work,
                    request_aggregate="run",
                    worker="trainer",
                    epoch=queue.epoch,
                    confirm=holding,
                    before_recording=before_recording,
                )
            finally:
                if ran and not recorded and _changes_run(accepted):
                    # It changed the run, and the log says it did not (or says nothing yet).
                    queue.diverged = True
        if queue.diverged:
            raise _Unrecorded
        if snapshot_now and not queue.lost:
            queue.next_seq = accepted.seq_id + 1
            await self._snapshot(model_id, queue)

    async def _replay(self, accepted: bus.RequestAccepted, queue: _RunQueue) -> None:
        """Re-execute a request whose outcome is recorded, to rebuild the run's state: the same
        engine work, nothing recorded. Its forward_backwards and optim_steps wait in the
        fuser's line like new ones, so a run being rebuilt takes turns with the runs the
        trainer serves meanwhile, a slice at a time, rather than holding the compute thread
        for the whole of its log."""
        command = events.command_of(accepted)
        model_id = accepted.aggregate_id
        with telemetry.tracer.start_as_current_span(
            f"trainer replay {command}", attributes=self._attributes(model_id, queue)
        ):
            if command == "create_model":
                await self._make_run(model_id, accepted.create_model)
            elif command == "load_weights":
                await self._load_into(model_id, accepted.load_weights)
            elif command == "forward_backward" and not accepted.forward_backward.forward_only:
                await self.fuser.forward_backward(self._pass_ask(accepted, queue))
            elif command == "optim_step":
                await self.fuser.optim_step(self._step_ask(accepted, queue))

    async def _patiently(self, attempt: Callable[[], Awaitable[_T]]) -> _T:
        """``attempt()``, again after a pause while the bus is unreachable (a restarting
        nats-server), so that a request does not fail for a moment without its log."""
        for n in itertools.count():
            try:
                return await attempt()
            except _TRANSIENT as exc:
                if self.stopping or self.bus.closing:
                    raise
                wait = _RECORD_RETRY_S[min(n, len(_RECORD_RETRY_S) - 1)]
                log.warning("the bus did not answer (%r); again in %.1f s", exc, wait)
                await asyncio.sleep(wait)
        raise AssertionError("unreachable")

    def _attributes(self, model_id: str, queue: _RunQueue | None = None) -> dict[str, str | int]:
        """What a span of this run's work carries: the run, its base model and its adapter."""
        queue = queue or self.queues[model_id]
        return {
            "tinsmith.model_id": model_id,
            "tinsmith.base_model": queue.create.base_model,
            "tinsmith.adapter": model_id,
            "tinsmith.lora_rank": queue.create.lora.rank,
        }

    # -- snapshots and idle runs ---------------------------------------------------------------

    async def _snapshot(self, model_id: str, queue: _RunQueue) -> None:
        """Capture the run's state as it is now (after seq_id ``queue.next_seq - 1``) on the
        compute thread, then write it to a local directory, upload it and record
        ``RunSnapshotted`` in the background, while the run's next requests run."""
        queue.steps = 0
        next_seq = queue.next_seq
        try:
            captured = await self.compute.traced(
                "snapshot",
                self._attributes(model_id, queue),
                self.engine.capture,
                model_id,
                with_optimizer=True,
                with_gradients=True,
            )
        except Exception:
            log.exception("could not snapshot run %s", model_id)
            return
        tmp = tempfile.TemporaryDirectory(prefix="tinsmith-snapshot-")

        async def upload() -> None:
            try:
                async with queue.snapshots:
                    await asyncio.to_thread(captured.write, Path(tmp.name))
                    key = artifacts.snapshot_key(model_id, next_seq)
                    await self.blobs.put_dir(key, Path(tmp.name))
                    if queue.lost or not await self.fleet.confirm(model_id):
                        return
                    snapshotted = bus.RunSnapshotted(
                        model_id=model_id,
                        snapshot_key=key,
                        next_seq_id=next_seq,
                        create=queue.create,
                        epoch=queue.epoch,
                    )
                    await self.log.append(events.make(run_snapshotted=snapshotted))
            except Exception:
                log.exception("could not record a snapshot of run %s", model_id)
            finally:
                tmp.cleanup()

        self.bus.spawn(upload())

    async def _reap_idle_runs(self) -> None:
        """Sleep until the earliest moment a held run could be idle, then let go of those that
        are. Heartbeats only push deadlines later, so waking early is harmless."""
        while True:
            now = time.monotonic()
            idle = self.config.idle_unload_s
            deadlines = {
                model_id: self.last_seen.get(queue.create.session_id, now) + idle
                for model_id, queue in self.queues.items()
            }
            for model_id, deadline in deadlines.items():
                queue = self.queues.get(model_id)
                if queue is None or deadline > now or self.stopping:
                    continue
                if not queue.busy and not queue.pending and not queue.lost:
                    try:
                        await self._unload(model_id, queue)
                    except Exception:
                        # It stays loaded; the next try is one idle period later.
                        log.exception("could not unload idle run %s", model_id)
                        self.last_seen[queue.create.session_id] = time.monotonic()
            upcoming = [d for d in deadlines.values() if d > now]
            self._reaper_wake.clear()
            timeout = min(upcoming) - now if upcoming else None
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._reaper_wake.wait(), timeout)

    async def _unload(self, model_id: str, queue: _RunQueue, why: str = "idle") -> None:
        """Snapshot the run, record ``RunUnloaded``, drop it from memory and release it; its
        next request places it again. A run the log cannot record stays held and loaded. A
        diverged run is let go instead, unsnapshotted (``_let_go``)."""
        if queue.diverged:
            await self._let_go(model_id, queue)
            return
        queue.busy = True  # requests that arrive meanwhile wait, then go to its next holder
        try:
            with telemetry.tracer.start_as_current_span(
                f"trainer unload_{why}_run", attributes=self._attributes(model_id, queue)
            ):
                async with queue.snapshots:
                    key = artifacts.snapshot_key(model_id, queue.next_seq)
                    if queue.restore_from:  # never restored: its snapshot is its state
                        key = queue.restore_from
                    else:
                        await self._export(model_id, key, with_optimizer=True, with_gradients=True)
                    if not await self.fleet.confirm(model_id):
                        raise InternalError(f"run {model_id} is held by another trainer now")
                    unloaded = bus.RunUnloaded(
                        model_id=model_id,
                        snapshot_key=key,
                        next_seq_id=queue.next_seq,
                        create=queue.create,
                        epoch=queue.epoch,
                    )
                    await self.log.append(events.make(run_unloaded=unloaded))
                await self.compute.run(self.engine.unload, model_id)
                self.queues.pop(model_id, None)
                await self.fleet.release(model_id)
            log.info("unloaded run %s (%s) to %s", model_id, why, key)
        finally:
            queue.busy = False
            self._quiet.set()
        if queue.pending and not self.stopping and self.queues.get(model_id) is None:
            self.bus.spawn(self._consider(model_id))

    async def _let_go(self, model_id: str, queue: _RunQueue) -> None:
        """Drop a diverged run (``_RunQueue.diverged``) from memory and release it, recording
        nothing: its next holder (this replica, as likely as any other) rebuilds it from its
        latest recorded snapshot and the log, as after a crash, and runs what waits: the
        request whose result the log does not hold is failed there, or waits in it, unrun."""
        if self.queues.get(model_id) is not queue:
            return
        queue.lost = True  # nothing more of it runs or is recorded here
        self.queues.pop(model_id, None)
        if model_id in self.engine.runs:  # not, where its restore failed
            await self.compute.run(self.engine.unload, model_id)
        try:
            await self.fleet.release(model_id)
        except Exception:  # the hold names this process still: ``take`` takes it again
            log.warning("could not release run %s; it is taken again", model_id, exc_info=True)
        log.warning(
            "let go of run %s unsnapshotted: a request of it ran whose result the log does not "
            "hold, so it is rebuilt from its latest snapshot and the log",
            model_id,
        )
        self.bus.spawn(self._consider(model_id))  # a stopping trainer takes nothing

    async def _restore(self, model_id: str, queue: _RunQueue) -> None:
        """Load the run from the snapshot its queue starts at; a run that cannot be restored
        fails each of its requests that comes to its turn, with the reason."""
        key = queue.restore_from
        create = bus.CreateModel()
        create.CopyFrom(queue.create)
        create.load_key, create.load_optimizer = key, True
        try:
            await self._with_checkpoint(key, self.engine.create_run, model_id, create)
        except NotFound as exc:
            queue.broken = NotFound(
                f"training run {model_id} was unloaded, and its snapshot cannot be read back "
                f"({exc.detail}); load it from a checkpoint into a new run"
            )
            return
        except TinsmithError as exc:
            queue.broken = exc
            return
        queue.restore_from = ""
        if queue.unloaded:
            restored = bus.RunRestored(model_id=model_id, snapshot_key=key, epoch=queue.epoch)
            await self.log.append(events.make(run_restored=restored))
        log.info("restored run %s from %s", model_id, key)
        self.last_seen[create.session_id] = time.monotonic()

    async def _fitting(self, model_id: str, attempt: Callable[[], Awaitable[_T]]) -> _T:
        """``attempt()``; when the engine says it does not fit the device's memory budget
        (``OutOfBudget``), unload runs with nothing to do, least recently used first, and try
        again; the refusal stands once none is left to unload."""
        while True:
            try:
                return await attempt()
            except OutOfBudget as exc:
                if not await self._make_room(exc.short, keep=model_id):
                    raise

    async def _make_room(self, short: int, keep: str) -> bool:
        """Snapshot and unload held runs that are neither running nor waiting to run (other
        than ``keep``), least recently used first, until about ``short`` bytes are free. False
        if there was none to unload."""
        if self.stopping:
            return False
        candidates = sorted(
            (queue.used, model_id)
            for model_id, queue in self.queues.items()
            if model_id != keep and model_id in self.engine.runs
        )
        freed, unloaded = 0, 0
        for _, model_id in candidates:
            queue = self.queues.get(model_id)
            run = self.engine.runs.get(model_id)
            # Checked right before: it may have been given work, or unloaded, meanwhile.
            if queue is None or queue.busy or queue.pending or queue.lost or run is None:
                continue
            size = run.state_bytes
            try:
                await self._unload(model_id, queue, why="lru")
            except Exception:
                log.exception("could not unload run %s to make room on the device", model_id)
                continue
            log.info("unloaded run %s, the least recently used, for %s", model_id, keep)
            freed += size
            unloaded += 1
            if freed >= short:
                break
        return unloaded > 0

    # -- commands ------------------------------------------------------------------------------

    async def _create_model(self, accepted: bus.RequestAccepted, queue: _RunQueue) -> Outcome:
        command = accepted.create_model
        model_id = accepted.aggregate_id
        await self._make_run(model_id, command)
        created = bus.RunCreated(
            model_id=model_id,
            session_id=command.session_id,
            base_model=command.base_model,
            lora=command.lora,
            user_metadata=command.user_metadata,
            # The model's name, never the directory it was loaded from: get_info shows it.
            tokenizer_id=models.tokenizer_id(command.base_model),
            epoch=queue.epoch,
        )
        await self.log.append(events.make(run_created=created))
        self._reaper_wake.set()
        if command.load_key:
            return _json({"type": "load_weights", "path": command.load_path, "model_id": model_id})
        return _json({"type": "create_model", "model_id": model_id})

    async def _make_run(self, model_id: str, command: bus.CreateModel) -> None:
        if command.load_key:
            await self._with_checkpoint(command.load_key, self.engine.create_run, model_id, command)
            return
        await self._fitting(
            model_id,
            lambda: self.compute.traced(
                "create_run",
                self._attributes(model_id),
                self.engine.create_run,
                model_id,
                command,
            ),
        )

    async def _load_weights(self, accepted: bus.RequestAccepted, queue: _RunQueue) -> Outcome:
        command = accepted.load_weights
        await self._load_into(accepted.aggregate_id, command)
        return _json(
            {"type": "load_weights", "path": command.path, "model_id": accepted.aggregate_id}
        )

    async def _load_into(self, model_id: str, command: bus.LoadWeights) -> None:
        await self._with_checkpoint(
            command.blob_key,
            lambda model_id, directory: self.engine.load(
                model_id, directory, with_optimizer=command.optimizer
            ),
            model_id,
        )

    def _pass_ask(self, accepted: bus.RequestAccepted, queue: _RunQueue) -> Ask:
        """The fuser's ask for a forward_backward or forward. A forward_backward's place in line
        is kept for the run's optim_step after it (``_step_ask``)."""
        request = accepted.forward_backward
        tokens = sum(len(model_input_tokens(datum.model_input)) for datum in request.data)
        attributes: telemetry.Attributes = {
            **self._attributes(accepted.aggregate_id),
            "tinsmith.batch_size": len(request.data),
            "tinsmith.tokens": tokens,
        }
        ask = Ask(accepted.aggregate_id, queue.create.base_model, request, tokens, attributes)
        if not request.forward_only and queue.step_since is None:
            queue.step_since = ask.since
        return ask

    def _step_ask(self, accepted: bus.RequestAccepted, queue: _RunQueue) -> Ask:
        """The fuser's ask for an optim_step, in the place of the forward_backward before it."""
        model_id = accepted.aggregate_id
        ask = Ask(
            model_id,
            queue.create.base_model,
            accepted.optim_step.adam,
            0,
            self._attributes(model_id),
            since=queue.step_since if queue.step_since is not None else time.monotonic(),
        )
        queue.step_since = None
        return ask

    async def _forward_backward(self, accepted: bus.RequestAccepted, queue: _RunQueue) -> Outcome:
        request = accepted.forward_backward
        ask = self._pass_ask(accepted, queue)
        tokens = ask.tokens
        output = await self.fuser.forward_backward(ask)
        telemetry.TOKENS.add(tokens, {"tinsmith.service": "trainer", "tinsmith.tokens": "trained"})
        # What the catalog keeps of it per step: the loss's metrics, and what it trained on. A
        # forward alone (an evaluation) keeps them under its own names.
        prefix = "forward/" if request.forward_only else ""
        metrics = {
            f"{prefix}{name}": value
            for name, value in tp.ForwardBackwardOutput.FromString(output).metrics.items()
        }
        metrics[f"{prefix}tokens:sum"] = tokens
        metrics[f"{prefix}datums:sum"] = len(request.data)
        return Outcome(output, PROTOBUF, metrics)

    async def _alone(self, ask: Ask) -> Any:
        """A request by itself (the fuser's way for one that runs with no other). A
        forward_backward or forward runs one pass at a time (the engine's ``plan`` cuts a large
        one into slices): this runs its next pass, and returns None while passes are left, so
        that the fuser serves other runs' requests before the next."""
        if isinstance(ask.work, bus.AdamParams):
            return await self.compute.traced(
                ask.kind, ask.attributes, self.engine.optim_step, ask.model_id, ask.work
            )
        try:
            return await self._fitting(
                ask.model_id,
                lambda: self.compute.traced(ask.kind, ask.attributes, self._next_pass, ask),
            )
        except BaseException:
            # Refused for want of room with nothing left to unload, or cancelled: the run's
            # gradients go back to what they were (a pass that failed did that already).
            if ask.passes is not None:
                with contextlib.suppress(Exception):
                    await asyncio.shield(self.compute.run(self.engine.abandon, ask.passes))
            raise

    def _next_pass(self, ask: Ask) -> bytes | None:
        """On the compute thread: the next pass of ``ask``'s request, begun first if it was not
        (``TrainerEngine.begin``); its output after the last."""
        if ask.passes is None:
            assert isinstance(ask.work, tp.ForwardBackwardRequest)
            ask.passes = self.engine.begin(ask.model_id, ask.work)
        return self.engine.advance(ask.passes)

    async def _optim_step(self, accepted: bus.RequestAccepted, queue: _RunQueue) -> Outcome:
        metrics = await self.fuser.optim_step(self._step_ask(accepted, queue))
        return _json({"type": "optim_step", "metrics": metrics}, metrics)

    async def _save_weights(self, accepted: bus.RequestAccepted, queue: _RunQueue) -> Outcome:
        command = accepted.save_weights
        model_id = accepted.aggregate_id
        training = command.kind == bus.CHECKPOINT_KIND_TRAINING
        if command.name:
            path = artifacts.TinkerPath(model_id, command.kind, command.name)
            key, tinker_path = command.blob_key or path.key, str(path)
        else:
            key, tinker_path = artifacts.ephemeral_sampler_key(model_id, command.sampler_id), ""
        metadata, size = await self._export(model_id, key, with_optimizer=training)
        if tinker_path:
            saved = bus.WeightsSaved(
                model_id=model_id,
                tinker_path=tinker_path,
                blob_key=key,
                kind=command.kind,
                base_model=str(metadata["base_model"]),
                lora_rank=int(str(metadata["lora_rank"])),
                size_bytes=size,
                user_metadata=command.user_metadata,
                lora=queue.create.lora,
                epoch=queue.epoch,
            )
            if command.HasField("ttl_seconds"):
                saved.ttl_seconds = command.ttl_seconds
            await self.log.append(events.make(weights_saved=saved))
        if training:
            return _json({"type": "save_weights", "path": tinker_path})
        if command.kind == bus.CHECKPOINT_KIND_EXTERNAL:
            return _json({"type": "save_weights_external", "path": tinker_path, "size_bytes": size})
        if tinker_path:
            return _json({"type": "save_weights_for_sampler", "path": tinker_path})
        sampler = bus.SamplerCreated(
            sampler_id=command.sampler_id,
            session_id=command.sampler_id.split(":", 1)[0],
            base_model=str(metadata["base_model"]),
            adapter_key=key,
        )
        await self.log.append(events.make(sampler_created=sampler), request_aggregate="sampler")
        return _json(
            {"type": "save_weights_for_sampler", "sampling_session_id": command.sampler_id}
        )

    # -- storage -------------------------------------------------------------------------------

    async def _export(
        self, model_id: str, key: str, *, with_optimizer: bool, with_gradients: bool = False
    ) -> tuple[dict[str, object], int]:
        captured = await self.compute.traced(
            "save",
            self._attributes(model_id),
            self.engine.capture,
            model_id,
            with_optimizer=with_optimizer,
            with_gradients=with_gradients,
        )
        # Written off the compute thread, which goes on with the other runs' work.
        with tempfile.TemporaryDirectory(prefix="tinsmith-save-") as tmp:
            metadata = await asyncio.to_thread(captured.write, Path(tmp))
            return metadata, await self.blobs.put_dir(key, Path(tmp))

    async def _with_checkpoint(
        self, key: str, fn: Callable[..., _T], model_id: str, *args: object
    ) -> _T:
        """Download the artifact at ``key`` and run ``fn(model_id, *args, directory)`` on the
        compute thread while it is on local disk."""
        with tempfile.TemporaryDirectory(prefix="tinsmith-load-") as tmp:
            try:
                await self.blobs.get_dir(key, Path(tmp))
            except FileNotFoundError as exc:
                raise NotFound(f"the checkpoint is gone from the object store: {exc}") from exc
            return await self._fitting(
                model_id,
                lambda: self.compute.traced(
                    "load", self._attributes(model_id), fn, model_id, *args, Path(tmp)
                ),
            )


def _json(value: object, metrics: Mapping[str, float] | None = None) -> Outcome:
    return Outcome(json.dumps(value).encode(), JSON, metrics or {})
