"""The trainer's work loop: accepted requests of every run, from the log, in each run's seq_id
order, executed on the compute thread, with results and events appended back to the log.

Owns:
- ordering: the SDK may send a forward_backward's chunks out of order, chunk 1 last, and a
  request the gateway rejected leaves its seq_id to be skipped;
- failing alone: whatever goes wrong around one request (reading it, restoring its run, executing
  it, recording its outcome) ends that request failed (an unexpected exception as an
  ``InternalError``, logged once with its traceback), spends its seq_id and lets the run's later
  requests run; a failure the log refuses to record is retried until it is recorded (or, if the
  trainer stops first, the request goes back to the queue with the others it held);
- acking and redelivery: a request is acked only after its outcome is durable, so a trainer that
  dies mid-step hands it to the next one after the ack wait (``TrainerConfig.ack_wait_s``). Every
  request the trainer holds, executing or waiting for an earlier seq_id however long, is extended
  (``in_progress``) every third of the ack wait, so a wait is never taken for a dead trainer.
  Redelivery is bounded (tinsmith/workqueue.py): a request that arrives on its last delivery is
  not run; when its turn comes its failure is recorded (``workqueue.exhausted``);
- bounded buffering: requests waiting for their turn keep their payload in memory up to a budget
  (``TrainerConfig.buffer_mb``); beyond it the payload is released once its run and seq_id are
  noted, and read back from the log when its turn comes;
- storing checkpoints;
- letting go of idle runs: a run whose session stopped heart-beating is snapshotted to the object
  store and unloaded, and its next request restores it, also after a trainer restart;
- making room on the device: when the engine says that a run, a base model or a step does not
  fit what is free of its memory budget (``OutOfBudget``), the runs with nothing to do are
  snapshotted and unloaded the same way, least recently used first, until it fits (a run that
  comes back on its next request may unload another in turn);
- stopping: the request running now finishes, every run in memory is snapshotted, and the
  requests still waiting go back to the queue for the next trainer.

Does not own: the torch math (engine.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import logging
import tempfile
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypeVar

from opentelemetry.trace import SpanKind

from services import gpu
from tinsmith import artifacts, events, models, subjects, telemetry
from tinsmith._proto import bus_pb2 as bus
from tinsmith.blobs import BlobStore
from tinsmith.bus import Bus
from tinsmith.compute import ComputeThread
from tinsmith.eventlog import JSON, PROTOBUF, EventLog, FollowedProjection
from tinsmith.failures import InternalError, NotFound, TinsmithError, Unavailable
from tinsmith.tensors import model_input_tokens
from tinsmith.workqueue import Delivery, WorkQueue, exhausted

from .config import TrainerConfig
from .engine import OutOfBudget, TrainerEngine

log = logging.getLogger(__name__)
_T = TypeVar("_T")

# Messages asked of the queue at a time. Requests far ahead of their turn wait here, their
# payloads within the buffer budget.
_BATCH = 256
# Waits between attempts to record a failure that the log refused (it is down, say).
_RECORD_RETRY_S = (0.5, 1.0, 2.0, 5.0, 10.0, 30.0)
# A failure's detail is cut to this many characters, so that recording it cannot fail for size.
_MAX_DETAIL = 4000


@dataclass
class _Work:
    """A request of a run, held until its seq_id's turn: its delivery, whose payload may have
    been released (read it back from the log by ``delivery.stream_seq``), and what was noted of
    it on arrival."""

    delivery: Delivery
    seq_id: int
    request_id: str  # "" for a seq_id the gateway rejected: nothing runs, it is only spent
    size: int  # payload bytes it keeps in memory (0 once released)


@dataclass
class _RunQueue:
    create: bus.CreateModel
    next_seq: int = 0
    pending: dict[int, _Work] = field(default_factory=dict)
    busy: bool = False
    snapshot_key: str = ""  # set while the run is unloaded
    used: float = field(default_factory=time.monotonic)  # when its latest request began


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
        self.projection = FollowedProjection(self.log)
        self.engine = engine
        self.blobs = blobs
        self.config = config
        self.compute = ComputeThread(
            "trainer-compute",
            engine.init_compute_thread,
            device=engine.device,
            gpu_clock=gpu.cuda_clock(engine.device()),
        )
        self.queues: dict[str, _RunQueue] = {}
        self.last_seen: dict[str, float] = {}  # session id -> monotonic time of last sign of life
        # Every delivery not yet acked or handed back, by stream sequence: what is kept alive.
        self.held: dict[int, Delivery] = {}
        self.buffered_bytes = 0  # payload bytes of the requests waiting in ``pending``
        self._reaper_wake = asyncio.Event()
        self._quiet = asyncio.Event()  # set whenever a run's queue stops being busy
        self._stop = asyncio.Event()  # set when the trainer begins to stop
        self._queue: WorkQueue | None = None  # once started

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
        await self.projection.start()
        await self.bus.listen(subjects.SESSION_HEARTBEATS, self._on_heartbeat)
        self.bus.spawn(self._keep_alive())
        self._queue = await self.bus.consume(
            subjects.EVENTS_STREAM,
            subjects.TRAINER_CONSUMER,
            subjects.events_of("run"),
            self._on_deliveries,
            batch=_BATCH,
            ack_wait_s=self.config.ack_wait_s,
        )
        self.bus.spawn(self._reap_idle_runs())

    async def stop(self) -> None:
        """On a graceful stop: take no more work and let the requests running now finish, then
        snapshot and unload every run still in memory, so the next trainer restores each one on
        its next request (stopping loses no run), and hand the requests still waiting back to
        the queue, for the next trainer."""
        self._stop.set()
        if self._queue is not None:
            await self._queue.stop()  # no request reaches this trainer any more
        for model_id, queue in list(self.queues.items()):
            while queue.busy:  # a running step (or an idle unload) finishes first
                self._quiet.clear()
                await self._quiet.wait()
            if not queue.snapshot_key:
                try:
                    await self._unload(model_id, queue)
                except Exception:
                    log.exception("could not snapshot run %s while stopping", model_id)
        for delivery in list(self.held.values()):
            with contextlib.suppress(Exception):
                await delivery.nak()
        self.held.clear()
        self.compute.shutdown()

    @property
    def stopping(self) -> bool:
        return self._stop.is_set()

    async def _on_heartbeat(self, payload: bytes) -> None:
        self.last_seen[payload.decode()] = time.monotonic()

    async def _keep_alive(self) -> None:
        """Tell JetStream that every request this trainer holds is in progress, so that none is
        delivered again while it waits for its turn or runs, however long that takes."""
        while True:
            await asyncio.sleep(self.config.ack_wait_s / 3)
            held = list(self.held.values())
            failed = 0
            for delivery in held:
                try:
                    await delivery.in_progress()
                except Exception:
                    failed += 1
            if failed:
                log.warning("could not extend the ack deadline of %d of %d", failed, len(held))

    # -- ordering ------------------------------------------------------------------------------

    async def _on_deliveries(self, deliveries: list[Delivery]) -> None:
        for delivery in deliveries:
            try:
                await self._take(delivery)
            except Exception:
                # Not held: it comes back after the ack wait (a bounded number of times).
                log.exception("could not take message %d of the log", delivery.stream_seq)

    async def _take(self, delivery: Delivery) -> None:
        """Note a run's request (its run and seq_id) and hold it until its turn."""
        if self.stopping:
            await delivery.nak()
            return
        try:
            event = events.decode(delivery.data)
            kind = events.kind_of(event)
        except Exception:
            log.exception("message %d of the log is not an event; skipped", delivery.stream_seq)
            await delivery.ack()
            return
        if kind not in ("request_accepted", "request_rejected"):
            await delivery.ack()
            return
        body = getattr(event, kind)
        queue = self.queues.get(body.aggregate_id) or self._adopt(body)
        if queue is None:
            await self._orphan(delivery, event)
            return
        self.last_seen[queue.create.session_id] = time.monotonic()
        if body.seq_id < queue.next_seq:
            await delivery.ack()  # a redelivery of work already done
            return
        request_id = body.request_id if kind == "request_accepted" else ""
        await self._hold(queue, _Work(delivery, body.seq_id, request_id, len(delivery.data)))
        if not queue.busy:
            queue.busy = True
            self.bus.spawn(self._advance(body.aggregate_id, queue))

    async def _hold(self, queue: _RunQueue, work: _Work) -> None:
        """Keep ``work`` until its turn, its payload in memory while the budget allows."""
        earlier = queue.pending.pop(work.seq_id, None)
        if earlier is not None:
            self.buffered_bytes -= earlier.size
            if earlier.delivery.stream_seq != work.delivery.stream_seq:
                # Two messages for one seq_id: the first in the log wins, the other is spent.
                first, second = sorted((earlier, work), key=lambda w: w.delivery.stream_seq)
                await self._spend(second.delivery)
                work = first
        if self.buffered_bytes + work.size > self.config.buffer_bytes:
            work.delivery.release()
            work.size = 0
        self.buffered_bytes += work.size
        queue.pending[work.seq_id] = work
        self.held[work.delivery.stream_seq] = work.delivery

    def _adopt(self, body: bus.RequestAccepted | bus.RequestRejected) -> _RunQueue | None:
        """A queue for a run this trainer does not hold yet: a new run, or one whose last word
        in the log is a snapshot (unloaded while idle, possibly by an earlier trainer)."""
        if isinstance(body, bus.RequestAccepted) and body.HasField("create_model"):
            queue = _RunQueue(create=body.create_model)
        else:
            run = self.projection.state.runs.get(body.aggregate_id)
            if run is None or run.snapshot is None:
                return None
            queue = _RunQueue(
                create=run.snapshot.create,
                next_seq=run.snapshot.next_seq_id,
                snapshot_key=run.snapshot.snapshot_key,
            )
        self.queues[body.aggregate_id] = queue
        return queue

    async def _advance(self, model_id: str, queue: _RunQueue) -> None:
        """Take the run's requests while the next seq_id is here; later ones wait for it. Each
        one that comes to its turn ends with an outcome and spends its seq_id, whatever
        happens to it."""
        try:
            while queue.next_seq in queue.pending and not self.stopping:
                work = queue.pending.pop(queue.next_seq)
                self.buffered_bytes -= work.size
                try:
                    await self._turn(queue, work)
                except Exception as exc:
                    if not await self._record_failure(model_id, work, exc):
                        break  # stopping: it goes back to the queue, for the next trainer
                queue.next_seq = work.seq_id + 1
                await self._spend(work.delivery)
                late = queue.pending.pop(work.seq_id, None)  # delivered again while it ran
                if late is not None:
                    self.buffered_bytes -= late.size
                    await self._spend(late.delivery)
        finally:
            queue.busy = False
            self._quiet.set()
            self._reaper_wake.set()

    async def _turn(self, queue: _RunQueue, work: _Work) -> None:
        """The request's turn: run it, unless it is a rejected seq_id (nothing to do) or on its
        last delivery (earlier ones ended without an outcome: it is failed, not run again)."""
        if not work.request_id:
            return
        delivery = work.delivery
        if delivery.last:
            raise exhausted(delivery, work.request_id)  # recorded as its failure, not run
        if delivery.released:
            data = await self.bus.get(subjects.EVENTS_STREAM, delivery.stream_seq)
        else:
            data = delivery.data
        await self._execute(events.decode(data).request_accepted, delivery, queue)

    async def _record_failure(self, model_id: str, work: _Work, exc: Exception) -> bool:
        """Record that a request failed outside its work's own settling (it was on its last
        delivery, it could not be read, or its outcome could not be recorded). Retried while the
        log refuses it; False if the trainer began to stop first."""
        if isinstance(exc, TinsmithError):
            failure = exc
            log.warning("request %s failed in the trainer: %s", work.request_id, exc.detail)
        else:
            log.error("request %s failed in the trainer", work.request_id, exc_info=exc)
            failure = InternalError(f"the request failed in the trainer: {exc!r}")
        detail = failure.detail[:_MAX_DETAIL]
        for attempt in itertools.count():
            try:
                await self.log.fail(
                    work.request_id, model_id, failure.kind, detail, request_aggregate="run"
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
                if self.stopping:
                    return False
        raise AssertionError("unreachable")

    async def _spend(self, delivery: Delivery) -> None:
        """Let go of a delivery whose outcome is recorded."""
        self.held.pop(delivery.stream_seq, None)
        try:
            await delivery.ack()
        except Exception as exc:
            # Its outcome is durable: a redelivery of it is acked as work already done.
            log.warning("could not ack message %d: %r", delivery.stream_seq, exc)

    async def _orphan(self, delivery: Delivery, event: bus.Event) -> None:
        """Work for a run this trainer cannot restore (its state was only in a lost process)."""
        if events.kind_of(event) == "request_accepted":
            accepted = event.request_accepted
            error = Unavailable(
                f"training run {accepted.aggregate_id} is not loaded on this trainer (it "
                "restarted); create the run again or load it from a checkpoint"
            )
            await self.log.fail(
                accepted.request_id,
                accepted.aggregate_id,
                error.kind,
                error.detail,
                request_aggregate="run",
            )
        await delivery.ack()

    async def _execute(
        self, accepted: bus.RequestAccepted, delivery: Delivery, queue: _RunQueue
    ) -> None:
        """Run one request, now that its turn has come (restoring its run first if it was
        unloaded), in the trace that accepted it, and record its outcome."""
        command = events.command_of(accepted)
        handler = getattr(self, f"_{command}", None)
        if handler is None:
            raise InternalError(f"the trainer does not know the command {command!r}")
        telemetry.queue_wait(command, delivery.published_ns, delivery.trace)
        queue.used = time.monotonic()

        async def work() -> tuple[bytes, str]:
            if queue.snapshot_key:
                await self._restore(accepted.aggregate_id, queue)
            result: tuple[bytes, str] = await handler(accepted)
            return result

        with (
            telemetry.tracer.start_as_current_span(
                f"trainer {command}",
                context=delivery.trace,
                kind=SpanKind.CONSUMER,
                attributes=self._attributes(accepted.aggregate_id, queue),
            ),
            telemetry.request_scope(accepted.request_id),
        ):
            await self.log.settle(accepted, work, request_aggregate="run", worker="trainer")

    def _attributes(self, model_id: str, queue: _RunQueue | None = None) -> dict[str, str | int]:
        """What a span of this run's work carries: the run, its base model and its adapter."""
        queue = queue or self.queues[model_id]
        return {
            "tinsmith.model_id": model_id,
            "tinsmith.base_model": queue.create.base_model,
            "tinsmith.adapter": model_id,
            "tinsmith.lora_rank": queue.create.lora.rank,
        }

    # -- idle runs -----------------------------------------------------------------------------

    async def _reap_idle_runs(self) -> None:
        """Sleep until the earliest moment a loaded run could be idle, then let go of those that
        are. Heartbeats only push deadlines later, so waking early is harmless."""
        while True:
            now = time.monotonic()
            idle = self.config.idle_unload_s
            deadlines = {
                model_id: self.last_seen.get(queue.create.session_id, now) + idle
                for model_id, queue in self.queues.items()
                if not queue.snapshot_key
            }
            for model_id, deadline in deadlines.items():
                queue = self.queues[model_id]
                if deadline <= now and not queue.busy and not queue.pending and not self.stopping:
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
        queue.busy = True  # requests that arrive meanwhile wait, then restore
        try:
            with telemetry.tracer.start_as_current_span(
                f"trainer unload_{why}_run", attributes=self._attributes(model_id, queue)
            ):
                key = artifacts.snapshot_key(model_id, queue.next_seq)
                await self._export(model_id, key, with_optimizer=True, with_gradients=True)
                unloaded = bus.RunUnloaded(
                    model_id=model_id,
                    snapshot_key=key,
                    next_seq_id=queue.next_seq,
                    create=queue.create,
                )
                # Recorded before it leaves memory: a run the log cannot record stays loaded.
                await self.log.append(events.make(run_unloaded=unloaded))
                await self.compute.run(self.engine.unload, model_id)
            queue.snapshot_key = key
            log.info("unloaded run %s (%s) to %s", model_id, why, key)
        finally:
            queue.busy = False
            self._quiet.set()
        if queue.pending and not self.stopping:
            queue.busy = True
            self.bus.spawn(self._advance(model_id, queue))

    async def _restore(self, model_id: str, queue: _RunQueue) -> None:
        create = bus.CreateModel()
        create.CopyFrom(queue.create)
        create.load_key, create.load_optimizer = queue.snapshot_key, True
        try:
            await self._with_checkpoint(create.load_key, self.engine.create_run, model_id, create)
        except NotFound as exc:
            raise NotFound(
                f"training run {model_id} was unloaded while idle, and its snapshot cannot be "
                f"read back ({exc.detail}); load it from a checkpoint into a new run"
            ) from exc
        await self.log.append(
            events.make(
                run_restored=bus.RunRestored(model_id=model_id, snapshot_key=create.load_key)
            )
        )
        log.info("restored run %s from %s", model_id, queue.snapshot_key)
        queue.snapshot_key = ""
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
        """Snapshot and unload loaded runs that are neither running nor waiting to run (other
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
            queue = self.queues[model_id]
            run = self.engine.runs.get(model_id)
            # Checked right before: it may have been given work, or unloaded, meanwhile.
            if queue.busy or queue.pending or queue.snapshot_key or run is None:
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

    async def _create_model(self, accepted: bus.RequestAccepted) -> tuple[bytes, str]:
        command = accepted.create_model
        model_id = accepted.aggregate_id
        if command.load_key:
            await self._with_checkpoint(command.load_key, self.engine.create_run, model_id, command)
        else:
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
        created = bus.RunCreated(
            model_id=model_id,
            session_id=command.session_id,
            base_model=command.base_model,
            lora=command.lora,
            user_metadata=command.user_metadata,
            # The model's name, never the directory it was loaded from: get_info shows it.
            tokenizer_id=models.tokenizer_id(command.base_model),
        )
        await self.log.append(events.make(run_created=created))
        self._reaper_wake.set()
        if command.load_key:
            return _json({"type": "load_weights", "path": command.load_path, "model_id": model_id})
        return _json({"type": "create_model", "model_id": model_id})

    async def _load_weights(self, accepted: bus.RequestAccepted) -> tuple[bytes, str]:
        command = accepted.load_weights
        await self._with_checkpoint(
            command.blob_key,
            lambda model_id, directory: self.engine.load(
                model_id, directory, with_optimizer=command.optimizer
            ),
            accepted.aggregate_id,
        )
        return _json(
            {"type": "load_weights", "path": command.path, "model_id": accepted.aggregate_id}
        )

    async def _forward_backward(self, accepted: bus.RequestAccepted) -> tuple[bytes, str]:
        request = accepted.forward_backward
        tokens = sum(len(model_input_tokens(datum.model_input)) for datum in request.data)
        op = "forward" if request.forward_only else "forward_backward"
        attributes = {
            **self._attributes(accepted.aggregate_id),
            "tinsmith.batch_size": len(request.data),
            "tinsmith.tokens": tokens,
        }
        output = await self._fitting(
            accepted.aggregate_id,
            lambda: self.compute.traced(
                op, attributes, self.engine.forward_backward, accepted.aggregate_id, request
            ),
        )
        telemetry.TOKENS.add(tokens, {"tinsmith.service": "trainer", "tinsmith.tokens": "trained"})
        return output, PROTOBUF

    async def _optim_step(self, accepted: bus.RequestAccepted) -> tuple[bytes, str]:
        metrics = await self.compute.traced(
            "optim_step",
            self._attributes(accepted.aggregate_id),
            self.engine.optim_step,
            accepted.aggregate_id,
            accepted.optim_step.adam,
        )
        return _json({"type": "optim_step", "metrics": metrics})

    async def _save_weights(self, accepted: bus.RequestAccepted) -> tuple[bytes, str]:
        command = accepted.save_weights
        model_id = accepted.aggregate_id
        training = command.kind == bus.CHECKPOINT_KIND_TRAINING
        if command.name:
            path = artifacts.TinkerPath(model_id, command.kind, command.name)
            key, tinker_path = command.blob_key or path.key, str(path)
        else:
            key, tinker_path = artifacts.ephemeral_sampler_key(model_id, command.sampler_id), ""
        metadata, size = await self._export(model_id, key, with_optimizer=training)
        queue = self.queues[model_id]
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
        with tempfile.TemporaryDirectory(prefix="tinsmith-save-") as tmp:
            metadata = await self.compute.traced(
                "save",
                self._attributes(model_id),
                self.engine.export,
                model_id,
                Path(tmp),
                with_optimizer=with_optimizer,
                with_gradients=with_gradients,
            )
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


def _json(value: object) -> tuple[bytes, str]:
    return json.dumps(value).encode(), JSON
