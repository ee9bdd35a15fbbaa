"""The sampler's work loop: accepted sample requests from the shared queue, adapters fetched
from the object store by key, results and completions appended to the log.

Owns: taking work, fetching adapters, acking once the outcome is durable. Does not own: the
sampling math (engine.py).
"""

from __future__ import annotations

import tempfile
from pathlib import Path

from tinsmith import events, subjects
from tinsmith._proto import bus_pb2 as bus
from tinsmith.blobs import BlobStore
from tinsmith.bus import Bus, Delivery
from tinsmith.compute import ComputeThread
from tinsmith.eventlog import PROTOBUF, EventLog
from tinsmith.failures import NotFound

from .config import SamplerConfig
from .engine import SamplerEngine


class Sampler:
    def __init__(self, bus_: Bus, engine: SamplerEngine, blobs: BlobStore, config: SamplerConfig):
        self.bus = bus_
        self.log = EventLog(bus_)
        self.engine = engine
        self.blobs = blobs
        self.config = config
        self.compute = ComputeThread("sampler-compute", engine.init_compute_thread)

    async def start(self) -> None:
        await self.bus.consume(
            subjects.EVENTS_STREAM,
            subjects.SAMPLER_CONSUMER,
            subjects.events_of("sampler"),
            self._on_deliveries,
            batch=self.config.batch,
            ack_wait_s=300.0,
        )

    async def _on_deliveries(self, deliveries: list[Delivery]) -> None:
        for delivery in deliveries:
            event = events.decode(delivery.data)
            if events.kind_of(event) == "request_accepted":
                await self._execute(event.request_accepted)
            await delivery.ack()

    async def _execute(self, accepted: bus.RequestAccepted) -> None:
        async def work() -> tuple[bytes, str]:
            command = accepted.sample
            if command.adapter_key:
                await self._ensure_adapter(command.base_model, command.adapter_key)
            return await self.compute.run(self.engine.sample, command), PROTOBUF

        await self.log.settle(accepted, work, request_aggregate="sampler", worker="sampler")

    async def _ensure_adapter(self, base_model: str, key: str) -> None:
        if await self.compute.run(self.engine.has_adapter, base_model, key):
            return
        with tempfile.TemporaryDirectory(prefix="tinsmith-adapter-") as tmp:
            try:
                await self.blobs.get_dir(key, Path(tmp))
            except FileNotFoundError as exc:
                raise NotFound(f"the adapter weights at {key!r} are gone: {exc}") from exc
            await self.compute.run(self.engine.load_adapter, base_model, key, Path(tmp))
