"""The trainer's work loop: accepted requests of every run, from the log, in each run's seq_id
order, executed on the compute thread, with results and events appended back to the log.

Owns: ordering (the SDK may send a forward_backward's chunks out of order, chunk 1 last; a
request the gateway rejected leaves its seq_id to be skipped), acking (a request is acked only
after its outcome is durable, so a trainer that dies mid-step gets it again), and storing
checkpoints. Does not own: the torch math (engine.py).
"""

from __future__ import annotations

import json
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from tinsmith import artifacts, events, subjects
from tinsmith._proto import bus_pb2 as bus
from tinsmith.blobs import BlobStore
from tinsmith.bus import Bus, Delivery
from tinsmith.compute import ComputeThread
from tinsmith.eventlog import JSON, PROTOBUF, EventLog
from tinsmith.failures import Unavailable

from .engine import TrainerEngine


@dataclass
class _Work:
    delivery: Delivery
    event: bus.Event


@dataclass
class _RunQueue:
    next_seq: int = 0
    pending: dict[int, _Work] = field(default_factory=dict)
    busy: bool = False


class Trainer:
    def __init__(self, bus_: Bus, engine: TrainerEngine, blobs: BlobStore) -> None:
        self.bus = bus_
        self.log = EventLog(bus_)
        self.engine = engine
        self.blobs = blobs
        self.compute = ComputeThread("trainer-compute")
        self.queues: dict[str, _RunQueue] = {}

    async def start(self) -> None:
        await self.bus.consume(
            subjects.EVENTS_STREAM,
            subjects.TRAINER_CONSUMER,
            subjects.events_of("run"),
            self._on_deliveries,
            batch=256,
            ack_wait_s=600.0,
        )

    async def _on_deliveries(self, deliveries: list[Delivery]) -> None:
        for delivery in deliveries:
            event = events.decode(delivery.data)
            kind = events.kind_of(event)
            if kind not in ("request_accepted", "request_rejected"):
                await delivery.ack()
                continue
            body = getattr(event, kind)
            queue = self.queues.get(body.aggregate_id)
            if queue is None:
                if kind == "request_accepted" and body.HasField("create_model"):
                    queue = self.queues[body.aggregate_id] = _RunQueue()
                else:
                    await self._orphan(delivery, event)
                    continue
            if body.seq_id < queue.next_seq:
                await delivery.ack()  # a redelivery of work already done
                continue
            queue.pending[body.seq_id] = _Work(delivery, event)
            if not queue.busy:
                queue.busy = True
                self.bus.spawn(self._advance(body.aggregate_id, queue))

    async def _advance(self, model_id: str, queue: _RunQueue) -> None:
        """Execute the run's requests while the next seq_id is here; later ones wait for it."""
        try:
            while queue.next_seq in queue.pending:
                work = queue.pending.pop(queue.next_seq)
                if events.kind_of(work.event) == "request_accepted":
                    await self._execute(work.event.request_accepted)
                await work.delivery.ack()
                queue.next_seq += 1
        finally:
            queue.busy = False

    async def _orphan(self, delivery: Delivery, event: bus.Event) -> None:
        """Work for a run this trainer does not hold (it restarted): fail it clearly."""
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

    async def _execute(self, accepted: bus.RequestAccepted) -> None:
        handler = getattr(self, f"_{events.command_of(accepted)}")
        await self.log.settle(
            accepted, lambda: handler(accepted), request_aggregate="run", worker="trainer"
        )

    # -- commands ------------------------------------------------------------------------------

    async def _create_model(self, accepted: bus.RequestAccepted) -> tuple[bytes, str]:
        command = accepted.create_model
        tokenizer_id = await self.compute.run(
            self.engine.create_run, accepted.aggregate_id, command
        )
        created = bus.RunCreated(
            model_id=accepted.aggregate_id,
            session_id=command.session_id,
            base_model=command.base_model,
            lora=command.lora,
            user_metadata=command.user_metadata,
            tokenizer_id=tokenizer_id,
        )
        await self.log.append(events.make(run_created=created))
        return _json({"type": "create_model", "model_id": accepted.aggregate_id})

    async def _forward_backward(self, accepted: bus.RequestAccepted) -> tuple[bytes, str]:
        output = await self.compute.run(
            self.engine.forward_backward, accepted.aggregate_id, accepted.forward_backward
        )
        return output, PROTOBUF

    async def _optim_step(self, accepted: bus.RequestAccepted) -> tuple[bytes, str]:
        metrics = await self.compute.run(
            self.engine.optim_step, accepted.aggregate_id, accepted.optim_step.adam
        )
        return _json({"type": "optim_step", "metrics": metrics})

    async def _save_weights(self, accepted: bus.RequestAccepted) -> tuple[bytes, str]:
        command = accepted.save_weights
        model_id = accepted.aggregate_id
        training = command.kind == bus.CHECKPOINT_KIND_TRAINING
        if command.name:
            path = artifacts.TinkerPath(model_id, command.kind, command.name)
            key, tinker_path = path.key, str(path)
        else:
            key, tinker_path = artifacts.ephemeral_sampler_key(model_id, command.sampler_id), ""
        with tempfile.TemporaryDirectory(prefix="tinsmith-save-") as tmp:
            metadata = await self.compute.run(
                self.engine.export, model_id, Path(tmp), with_optimizer=training
            )
            size = await self.blobs.put_dir(key, Path(tmp))
        if tinker_path:
            saved = bus.WeightsSaved(
                model_id=model_id,
                tinker_path=tinker_path,
                blob_key=key,
                kind=command.kind,
                base_model=metadata["base_model"],
                lora_rank=metadata["lora_rank"],
                size_bytes=size,
                user_metadata=command.user_metadata,
            )
            if command.HasField("ttl_seconds"):
                saved.ttl_seconds = command.ttl_seconds
            await self.log.append(events.make(weights_saved=saved))
        if training:
            return _json({"type": "save_weights", "path": tinker_path})
        if tinker_path:
            return _json({"type": "save_weights_for_sampler", "path": tinker_path})
        sampler = bus.SamplerCreated(
            sampler_id=command.sampler_id,
            session_id=command.sampler_id.split(":", 1)[0],
            base_model=metadata["base_model"],
            adapter_key=key,
        )
        await self.log.append(events.make(sampler_created=sampler), request_aggregate="sampler")
        return _json(
            {"type": "save_weights_for_sampler", "sampling_session_id": command.sampler_id}
        )


def _json(value: object) -> tuple[bytes, str]:
    return json.dumps(value).encode(), JSON
