"""The trainer's work loop: accepted requests of every run, from the log, in each run's seq_id
order, executed on the compute thread, with results and events appended back to the log.

Owns:
- ordering: the SDK may send a forward_backward's chunks out of order, chunk 1 last, and a
  request the gateway rejected leaves its seq_id to be skipped;
- acking: a request is acked only after its outcome is durable, so a trainer that dies mid-step
  gets it again;
- storing checkpoints;
- letting go of idle runs: a run whose session stopped heart-beating is snapshotted to the object
  store and unloaded, and its next request restores it, also after a trainer restart.

Does not own: the torch math (engine.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypeVar

from opentelemetry.trace import SpanKind

from services import gpu
from tinsmith import artifacts, events, subjects, telemetry
from tinsmith._proto import bus_pb2 as bus
from tinsmith.blobs import BlobStore
from tinsmith.bus import Bus
from tinsmith.compute import ComputeThread
from tinsmith.eventlog import JSON, PROTOBUF, EventLog, FollowedProjection
from tinsmith.failures import NotFound, Unavailable
from tinsmith.tensors import model_input_tokens
from tinsmith.workqueue import Delivery

from .engine import TrainerEngine

log = logging.getLogger(__name__)
_T = TypeVar("_T")


@dataclass
class _Work:
    delivery: Delivery
    event: bus.Event


@dataclass
class _RunQueue:
    create: bus.CreateModel
    next_seq: int = 0
    pending: dict[int, _Work] = field(default_factory=dict)
    busy: bool = False
    snapshot_key: str = ""  # set while the run is unloaded


class Trainer:
    def __init__(
        self, bus_: Bus, engine: TrainerEngine, blobs: BlobStore, idle_unload_s: float
    ) -> None:
        self.bus = bus_
        self.log = EventLog(bus_)
        self.projection = FollowedProjection(self.log)
        self.engine = engine
        self.blobs = blobs
        self.idle_unload_s = idle_unload_s
        self.compute = ComputeThread(
            "trainer-compute",
            engine.init_compute_thread,
            device=engine.device,
            gpu_clock=gpu.cuda_clock(),
        )
        self.queues: dict[str, _RunQueue] = {}
        self.last_seen: dict[str, float] = {}  # session id -> monotonic time of last sign of life
        self._reaper_wake = asyncio.Event()

    async def start(self) -> None:
        telemetry.observe_models(self.engine.loaded)
        gpu.observe_memory()
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
        await self.bus.consume(
            subjects.EVENTS_STREAM,
            subjects.TRAINER_CONSUMER,
            subjects.events_of("run"),
            self._on_deliveries,
            batch=256,
            ack_wait_s=600.0,
        )
        self.bus.spawn(self._reap_idle_runs())

    async def stop(self) -> None:
        """On a graceful stop, snapshot and unload every run still in memory, so the next
        trainer restores each one on its next request: stopping loses no run."""
        for model_id, queue in list(self.queues.items()):
            while queue.busy:  # let a running step (or an idle unload) finish first
                await asyncio.sleep(0.05)
            if not queue.snapshot_key:
                await self._unload(model_id, queue)

    async def _on_heartbeat(self, payload: bytes) -> None:
        self.last_seen[payload.decode()] = time.monotonic()

    # -- ordering ------------------------------------------------------------------------------

    async def _on_deliveries(self, deliveries: list[Delivery]) -> None:
        for delivery in deliveries:
            event = events.decode(delivery.data)
            kind = events.kind_of(event)
            if kind not in ("request_accepted", "request_rejected"):
                await delivery.ack()
                continue
            body = getattr(event, kind)
            queue = self.queues.get(body.aggregate_id) or self._adopt(body)
            if queue is None:
                await self._orphan(delivery, event)
                continue
            self.last_seen[queue.create.session_id] = time.monotonic()
            if body.seq_id < queue.next_seq:
                await delivery.ack()  # a redelivery of work already done
                continue
            queue.pending[body.seq_id] = _Work(delivery, event)
            if not queue.busy:
                queue.busy = True
                self.bus.spawn(self._advance(body.aggregate_id, queue))

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
        """Execute the run's requests while the next seq_id is here; later ones wait for it."""
        try:
            while queue.next_seq in queue.pending:
                work = queue.pending.pop(queue.next_seq)
                if events.kind_of(work.event) == "request_accepted":
                    await self._execute(work, queue)
                await work.delivery.ack()
                queue.next_seq += 1
        finally:
            queue.busy = False
            self._reaper_wake.set()

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

    async def _execute(self, work: _Work, queue: _RunQueue) -> None:
        """Run one request, now that its turn has come (restoring its run first if it was
        unloaded), in the trace that accepted it."""
        accepted = work.event.request_accepted
        command = events.command_of(accepted)
        telemetry.queue_wait(command, work.delivery.published_ns, work.delivery.trace)
        handler = getattr(self, f"_{command}")
        with (
            telemetry.tracer.start_as_current_span(
                f"trainer {command}",
                context=work.delivery.trace,
                kind=SpanKind.CONSUMER,
                attributes=self._attributes(accepted.aggregate_id, queue),
            ),
            telemetry.request_scope(accepted.request_id),
        ):
            if queue.snapshot_key:
                await self._restore(accepted.aggregate_id, queue)
            await self.log.settle(
                accepted, lambda: handler(accepted), request_aggregate="run", worker="trainer"
            )

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
            deadlines = {
                model_id: self.last_seen.get(queue.create.session_id, now) + self.idle_unload_s
                for model_id, queue in self.queues.items()
                if not queue.snapshot_key
            }
            for model_id, deadline in deadlines.items():
                queue = self.queues[model_id]
                if deadline <= now and not queue.busy and not queue.pending:
                    await self._unload(model_id, queue)
            upcoming = [d for d in deadlines.values() if d > now]
            self._reaper_wake.clear()
            timeout = min(upcoming) - now if upcoming else None
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._reaper_wake.wait(), timeout)

    async def _unload(self, model_id: str, queue: _RunQueue) -> None:
        queue.busy = True  # requests that arrive meanwhile wait, then restore
        try:
            with telemetry.tracer.start_as_current_span(
                "trainer unload_idle_run", attributes=self._attributes(model_id, queue)
            ):
                key = artifacts.snapshot_key(model_id, queue.next_seq)
                await self._export(model_id, key, with_optimizer=True, with_gradients=True)
                await self.compute.run(self.engine.unload, model_id)
                unloaded = bus.RunUnloaded(
                    model_id=model_id,
                    snapshot_key=key,
                    next_seq_id=queue.next_seq,
                    create=queue.create,
                )
                await self.log.append(events.make(run_unloaded=unloaded))
            queue.snapshot_key = key
            log.info("unloaded idle run %s to %s", model_id, key)
        finally:
            queue.busy = False
        if queue.pending:
            queue.busy = True
            self.bus.spawn(self._advance(model_id, queue))

    async def _restore(self, model_id: str, queue: _RunQueue) -> None:
        create = bus.CreateModel()
        create.CopyFrom(queue.create)
        create.load_key, create.load_optimizer = queue.snapshot_key, True
        await self._with_checkpoint(create.load_key, self.engine.create_run, model_id, create)
        await self.log.append(
            events.make(
                run_restored=bus.RunRestored(model_id=model_id, snapshot_key=create.load_key)
            )
        )
        log.info("restored run %s from %s", model_id, queue.snapshot_key)
        queue.snapshot_key = ""
        self.last_seen[create.session_id] = time.monotonic()

    # -- commands ------------------------------------------------------------------------------

    async def _create_model(self, accepted: bus.RequestAccepted) -> tuple[bytes, str]:
        command = accepted.create_model
        model_id = accepted.aggregate_id
        if command.load_key:
            tokenizer_id = await self._with_checkpoint(
                command.load_key, self.engine.create_run, model_id, command
            )
        else:
            tokenizer_id = await self.compute.traced(
                "create_run", self._attributes(model_id), self.engine.create_run, model_id, command
            )
        created = bus.RunCreated(
            model_id=model_id,
            session_id=command.session_id,
            base_model=command.base_model,
            lora=command.lora,
            user_metadata=command.user_metadata,
            tokenizer_id=tokenizer_id,
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
        output = await self.compute.traced(
            op, attributes, self.engine.forward_backward, accepted.aggregate_id, request
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
            return await self.compute.traced(
                "load", self._attributes(model_id), fn, model_id, *args, Path(tmp)
            )


def _json(value: object) -> tuple[bytes, str]:
    return json.dumps(value).encode(), JSON
