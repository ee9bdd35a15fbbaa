"""The sampler's work loop: accepted sample requests from the shared queue, adapters fetched
from the object store by key, results and completions appended to the log.

All the requests of one fetch from the queue (up to ``SamplerConfig.batch``) run as one engine
batch; each is then settled and acked on its own, so one bad request fails alone. Requests that
arrive while a batch runs wait for the next fetch.

Owns: taking work, fetching adapters, acking once the outcome is durable. Does not own: the
sampling math (engine.py).
"""

from __future__ import annotations

import asyncio
import logging
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
from .engine import MAX_ADAPTERS, SamplerEngine

log = logging.getLogger(__name__)

# How often a running batch extends its requests' ack deadline (the consumer's is 300 s).
_KEEP_ALIVE_S = 60.0


def _chunks(
    accepted: list[tuple[Delivery, bus.RequestAccepted]],
) -> list[list[tuple[Delivery, bus.RequestAccepted]]]:
    """Split a fetch so that no batch needs more adapters than the engine keeps loaded (else
    loading one would evict another that the same batch needs)."""
    chunks: list[list[tuple[Delivery, bus.RequestAccepted]]] = []
    keys: set[tuple[str, str]] = set()
    for item in accepted:
        key = (item[1].sample.base_model, item[1].sample.adapter_key)
        if not chunks or (key not in keys and len(keys) >= MAX_ADAPTERS):
            chunks.append([])
            keys = set()
        chunks[-1].append(item)
        if key[1]:
            keys.add(key)
    return chunks


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
        """Run all the sample requests of a fetch as one batch, then settle and ack each on its
        own: one request's failure (a missing adapter, a bad prompt) does not fail the others."""
        accepted: list[tuple[Delivery, bus.RequestAccepted]] = []
        for delivery in deliveries:
            event = events.decode(delivery.data)
            if events.kind_of(event) == "request_accepted":
                accepted.append((delivery, event.request_accepted))
            else:
                await delivery.ack()
        for chunk in _chunks(accepted):
            await self._execute(chunk)

    async def _execute(self, chunk: list[tuple[Delivery, bus.RequestAccepted]]) -> None:
        loop = asyncio.get_running_loop()
        batch: asyncio.Future[list[bytes | Exception]] = loop.create_future()

        async def run() -> None:
            try:
                batch.set_result(await self._run_batch([a.sample for _, a in chunk]))
            except Exception as exc:
                batch.set_exception(exc)

        async def settle(index: int, delivery: Delivery, accepted: bus.RequestAccepted) -> None:
            async def work() -> tuple[bytes, str]:
                # Each request's compute time is the batch's: it ran for all of that time.
                outcome = (await asyncio.shield(batch))[index]
                if isinstance(outcome, Exception):
                    raise outcome
                return outcome, PROTOBUF

            await self.log.settle(accepted, work, request_aggregate="sampler", worker="sampler")
            await delivery.ack()

        results = await asyncio.gather(
            run(),
            self._keep_alive([d for d, _ in chunk], batch),
            *(settle(i, d, a) for i, (d, a) in enumerate(chunk)),
            return_exceptions=True,
        )
        for result in results:
            if isinstance(result, BaseException):
                raise result

    async def _run_batch(self, commands: list[bus.Sample]) -> list[bytes | Exception]:
        """Fetch the adapters the requests need, then sample all that can run in one engine
        call; a request that cannot run gets its exception in its place."""
        outcomes: list[bytes | Exception | None] = [None] * len(commands)
        for i, command in enumerate(commands):
            if command.adapter_key:
                try:
                    await self._ensure_adapter(command.base_model, command.adapter_key)
                except Exception as exc:
                    outcomes[i] = exc
        runnable = [i for i, outcome in enumerate(outcomes) if outcome is None]
        if runnable:
            try:
                results = await self.compute.run(
                    self.engine.sample_batch, [commands[i] for i in runnable]
                )
            except Exception as exc:
                results = [exc] * len(runnable)
            for i, result in zip(runnable, results, strict=True):
                outcomes[i] = result
        return [outcome if outcome is not None else RuntimeError("not run") for outcome in outcomes]

    async def _keep_alive(
        self, deliveries: list[Delivery], batch: asyncio.Future[list[bytes | Exception]]
    ) -> None:
        """While a long batch runs, tell JetStream its requests are in progress, so none is
        delivered again meanwhile."""
        while True:
            await asyncio.wait([batch], timeout=_KEEP_ALIVE_S)
            if batch.done():
                return
            for delivery in deliveries:
                try:
                    await delivery.in_progress()
                except Exception:
                    log.warning("could not extend the ack deadline of %d", delivery.stream_seq)

    async def _ensure_adapter(self, base_model: str, key: str) -> None:
        if await self.compute.run(self.engine.has_adapter, base_model, key):
            return
        with tempfile.TemporaryDirectory(prefix="tinsmith-adapter-") as tmp:
            try:
                await self.blobs.get_dir(key, Path(tmp))
            except FileNotFoundError as exc:
                raise NotFound(f"the adapter weights at {key!r} are gone: {exc}") from exc
            await self.compute.run(self.engine.load_adapter, base_model, key, Path(tmp))
