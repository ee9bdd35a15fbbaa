"""The sampler's work loop: accepted sample requests from the queue that all replicas share,
adapters fetched from the object store by key, results and completions appended to the log.

Continuous batching: a replica holds up to ``SamplerConfig.batch`` requests and takes more from
the queue as they finish, so a request that arrives while others decode joins them at the next
step, and replicas split the load between them. Each request is settled and acked on its own, once
its outcome is durable, so one bad request fails alone and a replica that dies loses nothing: what
it held is delivered to another once its ack deadline passes (a replica that stops cleanly hands
its requests back at once).

Owns: taking work, fetching adapters, driving the engine's steps, acking. Does not own: the
sampling itself (the engines).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from tinsmith import events, subjects
from tinsmith._proto import bus_pb2 as bus
from tinsmith.blobs import BlobStore
from tinsmith.bus import Bus, Delivery
from tinsmith.compute import ComputeThread
from tinsmith.eventlog import PROTOBUF, EventLog
from tinsmith.failures import NotFound

from .config import SamplerConfig
from .engine import AdapterMissing, Engine

log = logging.getLogger(__name__)


@dataclass
class _Held:
    delivery: Delivery
    accepted: bus.RequestAccepted
    outcome: asyncio.Future[bytes | Exception] = field(
        default_factory=lambda: asyncio.get_running_loop().create_future()
    )


class Sampler:
    def __init__(self, bus_: Bus, engine: Engine, blobs: BlobStore, config: SamplerConfig):
        self.bus = bus_
        self.log = EventLog(bus_)
        self.engine = engine
        self.blobs = blobs
        self.config = config
        self.compute = ComputeThread("sampler-compute", engine.init_compute_thread)
        self._held: dict[int, _Held] = {}
        self._tickets = itertools.count()
        self._work = asyncio.Event()  # set when the engine was given something
        self._room = asyncio.Event()  # set when a held request was let go
        self._stopping = False

    async def start(self) -> None:
        self.bus.spawn(self._drive())
        self.bus.spawn(self._keep_alive())
        await self.bus.consume(
            subjects.EVENTS_STREAM,
            subjects.SAMPLER_CONSUMER,
            subjects.events_of("sampler"),
            self._on_deliveries,
            batch=self.config.batch,
            ack_wait_s=self.config.ack_wait_s,
            room=self._wait_for_room,
        )

    async def stop(self) -> None:
        """Hand every request not yet answered back to the queue, for another replica now."""
        self._stopping = True
        for held in list(self._held.values()):
            with contextlib.suppress(Exception):
                await held.delivery.nak()
        self.compute.shutdown()

    async def _wait_for_room(self) -> int:
        while len(self._held) >= self.config.batch or self._stopping:
            self._room.clear()
            await self._room.wait()
        return self.config.batch - len(self._held)

    async def _on_deliveries(self, deliveries: list[Delivery]) -> None:
        for delivery in deliveries:
            event = events.decode(delivery.data)
            if events.kind_of(event) != "request_accepted" or self._stopping:
                if self._stopping:
                    await delivery.nak()
                else:
                    await delivery.ack()
                continue
            ticket = next(self._tickets)
            self._held[ticket] = _Held(delivery, event.request_accepted)
            self.bus.spawn(self._serve(ticket))

    async def _serve(self, ticket: int) -> None:
        """One request from admission to ack. Its compute time is from admission to its last
        token: it shared the engine with others all along."""
        held = self._held[ticket]

        async def work() -> tuple[bytes, str]:
            await self._admit(ticket, held.accepted.sample)
            outcome = await held.outcome
            if isinstance(outcome, Exception):
                raise outcome
            return outcome, PROTOBUF

        try:
            await self.log.settle(
                held.accepted, work, request_aggregate="sampler", worker="sampler"
            )
            await held.delivery.ack()
        finally:
            del self._held[ticket]
            self._room.set()

    async def _admit(self, ticket: int, command: bus.Sample) -> None:
        """Give the engine the request, with its adapter from the object store if the engine
        does not hold it."""
        try:
            await self.compute.run(self.engine.add, ticket, command)
        except AdapterMissing:
            with tempfile.TemporaryDirectory(prefix="tinsmith-adapter-") as tmp:
                try:
                    await self.blobs.get_dir(command.adapter_key, Path(tmp))
                except FileNotFoundError as exc:
                    raise NotFound(
                        f"the adapter weights at {command.adapter_key!r} are gone: {exc}"
                    ) from exc
                await self.compute.run(self.engine.add, ticket, command, Path(tmp))
        self._work.set()

    def _step(self) -> tuple[list[tuple[int, bytes | Exception]], bool]:
        finished = self.engine.step()
        return finished, self.engine.has_work()

    async def _drive(self) -> None:
        """Step the engine while it has work; requests admitted meanwhile join at the next step
        (their ``add`` runs on the compute thread between two steps)."""
        while True:
            await self._work.wait()
            self._work.clear()
            busy = True
            while busy:
                try:
                    finished, busy = await self.compute.run(self._step)
                except Exception as exc:  # a bug in the engine: fail what it holds, keep serving
                    log.exception("a sampling step failed")
                    finished, busy = [(t, exc) for t in self._held], False
                for ticket, outcome in finished:
                    held = self._held.get(ticket)
                    if held is not None and not held.outcome.done():
                        held.outcome.set_result(outcome)

    async def _keep_alive(self) -> None:
        """Tell JetStream that the requests this replica holds are in progress, so none is
        delivered to another replica while this one is alive."""
        while True:
            await asyncio.sleep(self.config.ack_wait_s / 3)
            for held in list(self._held.values()):
                try:
                    await held.delivery.in_progress()
                except Exception:
                    log.warning("could not extend the ack deadline of %d", held.delivery.stream_seq)
