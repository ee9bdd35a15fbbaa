"""The sampler's work loop: accepted sample requests from the queue that all replicas share,
adapters fetched from the object store by key, results and completions appended to the log.

Continuous batching: a replica holds up to ``SamplerConfig.batch`` requests and takes more from
the queue as they finish, so a request that arrives while others decode joins them at the next
step, and replicas split the load between them. Each request is settled and acked on its own, once
its outcome is durable, so one bad request fails alone and a replica that dies loses nothing: what
it held is delivered to another once its ack deadline passes (a replica that stops cleanly hands
its requests back at once).

Failures stay with their request. The engines fail a request alone (engine.py); an adapter
fetched from the object store is checked for NaN and infinite weights before any engine sees it
(``nonfinite_tensors``), and one that has them fails its request (``Unprocessable``) without being
loaded. A step that raises fails the requests in the engine, as a last resort. Redelivery is
bounded (tinsmith/workqueue.py): a request on its last delivery, which every earlier taker let go
of without an outcome (it crashed, stalled or stopped), is recorded as failed
(``workqueue.exhausted``) and acked, not run once more.

Cancellation: every replica follows the log's RequestCancelled events (subjects.SAMPLES_CANCELLED,
an ordered consumer of its own, replayed from the start, so a replica started later knows the
earlier ones too). A replica that holds the request drops it from the engine and acks it without
recording anything (the cancellation is its outcome); one that fetches it later skips it. It
remembers the last ``_CANCELLED_REMEMBERED`` cancellations: an older one fetched later runs, and
its outcome is ignored (the first outcome recorded wins).

Streaming: a request whose command names a gateway (``stream_to``) has each step's new tokens
published to that gateway on core NATS, fire-and-forget; the others cost nothing extra.

Owns: taking work, fetching adapters (and checking their weights are finite), driving the
engine's steps, acking, failing work on its last delivery, dropping cancelled work, publishing
streamed tokens. Does not own: the sampling itself (the engines).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import tempfile
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from opentelemetry.trace import SpanKind
from safetensors import SafetensorError, safe_open

from services import gpu
from tinsmith import artifacts, events, subjects, telemetry
from tinsmith._proto import bus_pb2 as bus
from tinsmith._proto import service_pb2 as svc
from tinsmith._proto import tinker_public_pb2 as tp
from tinsmith.blobs import BlobStore
from tinsmith.bus import Bus
from tinsmith.compute import ComputeThread
from tinsmith.eventlog import PROTOBUF, EventLog, Outcome
from tinsmith.failures import Cancelled, NotFound, Unprocessable
from tinsmith.tensors import tokens_from_bytes
from tinsmith.workqueue import Delivery, WorkQueue, exhausted

from .config import SamplerConfig
from .engine import AdapterMissing, Delta, Engine

log = logging.getLogger(__name__)

# How many cancelled request ids a replica remembers, to skip such requests when it fetches them.
_CANCELLED_REMEMBERED = 65536


@dataclass
class _Held:
    delivery: Delivery
    accepted: bus.RequestAccepted
    outcome: asyncio.Future[bytes | Exception] = field(
        default_factory=lambda: asyncio.get_running_loop().create_future()
    )
    # Its life in the engine (unix ns), for its spans: given to the engine, first step done
    # (its prefill merged into the running batch), last step done.
    admitted_ns: int = 0
    joined_ns: int = 0
    finished_ns: int = 0
    steps: int = 0
    batch_requests: int = 0  # the most requests that shared a step with it
    batch_sequences: int = 0  # the most sequences that did
    gpu_ms: float = 0.0  # GPU time of the steps it took part in (shared with the batch)
    stream: str = ""  # where its tokens go as they are generated (a streaming call's gateway)
    cancelled: str = ""  # why it was cancelled, once it is


@dataclass(frozen=True)
class _Step:
    finished: list[tuple[int, bytes | Exception]]
    busy: bool
    started_ns: int
    ended_ns: int
    gpu_ms: float
    progress: list[Delta] = field(default_factory=list)  # tokens of the streamed requests


class Sampler:
    def __init__(self, bus_: Bus, engine: Engine, blobs: BlobStore, config: SamplerConfig):
        self.bus = bus_
        self.log = EventLog(bus_)
        self.engine = engine
        self.blobs = blobs
        self.config = config
        self.compute = ComputeThread(
            "sampler-compute",
            engine.init_compute_thread,
            device=engine.device,
            gpu_clock=gpu.cuda_clock(engine.device()),
        )
        self._held: dict[int, _Held] = {}
        self._tickets = itertools.count()
        self._work = asyncio.Event()  # set when the engine was given something
        self._room = asyncio.Event()  # set when a held request was let go
        self._stopping = False
        self._queue: WorkQueue | None = None  # once started
        self._cancelled: OrderedDict[str, None] = OrderedDict()  # request ids, oldest first

    async def start(self) -> None:
        telemetry.observe_models(self.engine.loaded)
        gpu.observe_memory(self.engine.device())
        telemetry.observe(
            "tinsmith.queue.depth",
            lambda: {(("tinsmith.queue", "sampler.local"),): float(len(self._held))},
            unit="{request}",
            description="Sample requests this replica holds (waiting for their adapter or "
            "decoding)",
        )
        self.bus.spawn(self._drive())
        self.bus.spawn(self._keep_alive())
        # Before taking work, so that the cancellations logged so far are mostly known when it
        # comes (one that arrives after its request is handled the same way, a moment later).
        await self.bus.follow(
            subjects.EVENTS_STREAM, subjects.SAMPLES_CANCELLED, self._on_cancelled
        )
        self._queue = await self.bus.consume(
            subjects.EVENTS_STREAM,
            subjects.SAMPLER_CONSUMER,
            subjects.events_of("sampler"),
            self._on_deliveries,
            batch=self.config.batch,
            ack_wait_s=self.config.ack_wait_s,
            room=self._wait_for_room,
        )

    async def stop(self) -> None:
        """Take no more work, and hand every request not yet answered back to the queue, for
        another replica now (none can come back to this one)."""
        self._stopping = True
        if self._queue is not None:
            await self._queue.stop()
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
            if events.kind_of(event) != "request_accepted":
                await (delivery.nak() if self._stopping else delivery.ack())
                continue
            accepted = event.request_accepted
            if accepted.request_id in self._cancelled:
                log.info("skipped request %s: it was cancelled", accepted.request_id)
                await delivery.ack()
                continue
            if delivery.last:  # stopping or not: handed back, it would never come again
                await self._give_up(delivery, accepted)
                continue
            if self._stopping:
                await delivery.nak()
                continue
            ticket = next(self._tickets)
            stream_to = accepted.sample.stream_to
            stream = subjects.sample_stream_subject(stream_to) if stream_to else ""
            self._held[ticket] = _Held(delivery, accepted, stream=stream)
            self.bus.spawn(self._serve(ticket))

    async def _give_up(self, delivery: Delivery, accepted: bus.RequestAccepted) -> None:
        """Record a request on its last delivery as failed, without running it: every earlier
        taker let go of it without an outcome, and it may be what brought them down."""
        error = exhausted(delivery, accepted.request_id)
        with telemetry.request_scope(accepted.request_id):
            log.error("failed request %s without running it: %s", accepted.request_id, error)
            await self.log.fail(
                accepted.request_id,
                accepted.aggregate_id,
                error.kind,
                error.detail,
                request_aggregate="sampler",
            )
        await delivery.ack()

    async def _on_cancelled(self, seq: int, data: bytes) -> None:
        """A sample request was cancelled: remember it, and drop it if this replica holds it."""
        event = events.decode(data)
        if events.kind_of(event) != "request_cancelled":
            return
        request_id = event.request_cancelled.request_id
        self._cancelled[request_id] = None
        while len(self._cancelled) > _CANCELLED_REMEMBERED:
            self._cancelled.popitem(last=False)
        for ticket, held in list(self._held.items()):
            if held.accepted.request_id == request_id and not held.cancelled:
                await self._drop(ticket, held, event.request_cancelled.detail, event.time)

    async def _drop(self, ticket: int, held: _Held, detail: str, cancelled_at: float) -> None:
        """Let go of a held request: it is answered (``Cancelled`` ends its ``_serve`` without
        recording anything), and the engine forgets it before its next step."""
        if held.outcome.done():
            return  # it finished first; the first outcome recorded wins
        held.cancelled = detail or "cancelled"
        held.outcome.set_result(Cancelled(held.cancelled))
        if held.admitted_ns:  # otherwise _admit cancels it once the engine has it
            await self.compute.run(self.engine.cancel, ticket)
        log.info(
            "dropped request %s %.1f ms after its cancellation, after %d steps",
            held.accepted.request_id,
            (time.time() - cancelled_at) * 1e3,
            held.steps,
        )

    async def _serve(self, ticket: int) -> None:
        """One request from admission to ack, in the trace that accepted it. Its compute time
        is from admission to its last token: it shared the engine with others all along."""
        held = self._held[ticket]
        accepted = held.accepted
        telemetry.queue_wait("sample", held.delivery.published_ns, held.delivery.trace)

        async def work() -> Outcome:
            await self._admit(ticket, held)
            outcome = await held.outcome
            generated = self._trace_sampling(held, outcome)
            if isinstance(outcome, Unprocessable):  # its numbers went wrong: say whose they were
                raise Unprocessable(f"request {accepted.request_id}: {outcome.detail}") from outcome
            if isinstance(outcome, Exception):
                raise outcome
            metrics = {
                "sample/prompt_tokens:sum": len(accepted.sample.prompt),
                "sample/sampled_tokens:sum": generated,
                "sample/sequences:sum": max(1, accepted.sample.num_samples),
            }
            return Outcome(outcome, PROTOBUF, metrics)

        try:
            with (
                telemetry.tracer.start_as_current_span(
                    "sampler sample",
                    context=held.delivery.trace,
                    kind=SpanKind.CONSUMER,
                    attributes=_attributes(accepted),
                ),
                telemetry.request_scope(accepted.request_id),
            ):
                await self.log.settle(accepted, work, request_aggregate="sampler", worker="sampler")
            await held.delivery.ack()
        finally:
            del self._held[ticket]
            self._room.set()

    async def _admit(self, ticket: int, held: _Held) -> None:
        """Give the engine the request, with its adapter from the object store if the engine
        does not hold it."""
        command = held.accepted.sample
        if held.cancelled:
            raise Cancelled(held.cancelled)
        try:
            held.admitted_ns = await self.compute.run(self._add, ticket, command)
        except AdapterMissing:
            with tempfile.TemporaryDirectory(prefix="tinsmith-adapter-") as tmp:
                try:
                    await self.blobs.get_dir(command.adapter_key, Path(tmp))
                except FileNotFoundError as exc:
                    raise NotFound(
                        f"the adapter weights at {command.adapter_key!r} are gone: {exc}"
                    ) from exc
                broken = await self.compute.run(nonfinite_tensors, Path(tmp))
                if broken:
                    raise Unprocessable(
                        f"request {held.accepted.request_id}: the adapter weights at "
                        f"{command.adapter_key!r} hold NaN or infinite values ({len(broken)} "
                        f"tensors, {broken[0]} first), so nothing can be sampled from them: the "
                        "training run diverged, most likely (a learning rate too high?). Sample "
                        "from an earlier checkpoint. The adapter was not loaded"
                    ) from None
                held.admitted_ns = await self.compute.traced(
                    "load_adapter",
                    _attributes(held.accepted),
                    self._add,
                    ticket,
                    command,
                    Path(tmp),
                )
        if held.cancelled:  # while it was being added: the engine had not got it yet
            await self.compute.run(self.engine.cancel, ticket)
            return
        self._work.set()

    def _add(self, ticket: int, command: bus.Sample, adapter_dir: Path | None = None) -> int:
        """``engine.add`` on the compute thread; returns when it was done (unix ns), which
        tells the steps that include the request from those that ran before it joined."""
        self.engine.add(ticket, command, adapter_dir)
        return time.time_ns()

    def _trace_sampling(self, held: _Held, outcome: bytes | Exception) -> int:
        """The spans of a request's time in the engine, now that its outcome is known: batch
        formation (until the step that prefilled it into the running batch ended) and compute
        (until its last token), with its tokens and the batch it shared; and the token counts.
        Returns how many tokens it generated."""
        command = held.accepted.sample
        generated = 0
        if isinstance(outcome, bytes):
            response = tp.SampleResponse.FromString(outcome)
            generated = sum(len(tokens_from_bytes(s.tokens)) for s in response.sequences)
        attributes = _attributes(held.accepted)
        end = held.finished_ns or time.time_ns()
        joined = held.joined_ns or end
        telemetry.finished_span("batch_formation", held.admitted_ns, joined, attributes)
        compute: dict[str, str | int | float] = {
            **attributes,
            "tinsmith.op": "sample",
            "tinsmith.device": self.engine.device(),
            "tinsmith.tokens": len(command.prompt) + generated,
            "tinsmith.tokens.prompt": len(command.prompt),
            "tinsmith.tokens.generated": generated,
            "tinsmith.batch_size": held.batch_requests,
            "tinsmith.batch_sequences": held.batch_sequences,
            "tinsmith.steps": held.steps,
        }
        if self.compute.gpu_clock is not None and held.gpu_ms:
            compute["tinsmith.gpu_time_ms"] = held.gpu_ms
        telemetry.finished_span("compute", held.admitted_ns, end, compute)
        counted = {"tinsmith.service": "sampler"}
        telemetry.TOKENS.add(len(command.prompt), {**counted, "tinsmith.tokens": "prompt"})
        telemetry.TOKENS.add(generated, {**counted, "tinsmith.tokens": "generated"})
        return generated

    def _step(self) -> _Step:
        started = time.time_ns()
        on_gpu = telemetry.tracing() and self.engine.device().startswith("cuda")
        clock = self.compute.gpu_clock if on_gpu else None
        mark = clock.start() if clock is not None else None
        finished = self.engine.step()
        gpu_ms = clock.elapsed_ms(mark) if clock is not None else 0.0
        ended = time.time_ns()
        progress = self.engine.progress()
        return _Step(finished, self.engine.has_work(), started, ended, gpu_ms, progress)

    def _steps(self) -> list[_Step]:
        """Steps of the engine one after another on the compute thread, until one has something
        for the event loop (finished requests, streamed tokens), the engine has no work left, or
        other work waits for the thread (a request to add, a cancellation, which so wait one
        step at most): the event loop takes over at those moments only, not after every token."""
        steps = [self._step()]
        while (
            steps[-1].busy
            and not steps[-1].finished
            and not steps[-1].progress
            and not self.compute.others_waiting()
        ):
            steps.append(self._step())
        return steps

    async def _drive(self) -> None:
        """Step the engine while it has work; requests admitted meanwhile join at the next step
        (their ``add`` runs on the compute thread between two steps). Work given to an idle
        engine first waits for company (``_form``)."""
        while True:
            await self._work.wait()
            await self._form()
            self._work.clear()
            busy = True
            while busy:
                try:
                    steps = await self.compute.run(self._steps)
                except Exception as exc:
                    # The engines fail a request alone; a step that raises is a bug in one. The
                    # last resort: fail what it holds, tell it to let go of them, keep serving.
                    log.exception("a sampling step failed")
                    admitted = [t for t, h in self._held.items() if h.admitted_ns]
                    for ticket in admitted:
                        with contextlib.suppress(Exception):
                            await self.compute.run(self.engine.cancel, ticket)
                    failed: list[tuple[int, bytes | Exception]] = [(t, exc) for t in admitted]
                    steps = [_Step(failed, False, time.time_ns(), time.time_ns(), 0.0)]
                for step in steps:
                    self._account(step)
                step = steps[-1]  # only the last may have finished or streamed anything
                if step.progress:
                    await self._publish(step.progress)
                busy = step.busy
                for ticket, outcome in step.finished:
                    held = self._held.get(ticket)
                    if held is not None and not held.outcome.done():
                        held.outcome.set_result(outcome)

    async def _form(self) -> None:
        """Let a batch form: the engine was idle and has been given work; wait
        ``batch_delay_s`` before its first step, so that requests sent together but arriving
        over some milliseconds are prefilled together. Measured through the SDK
        (bench/sample_throughput.py), 8 concurrent requests reach the sampler over 10 to 25 ms,
        in two or three bursts; the first step, begun at the first arrival, shares the CPU with
        the rest arriving and took 35 to 65 ms (20 ms of it computing) for one prompt, before a
        second prefill for the others.

        The delay runs from the admission of the first request still waiting (given to the
        engine on the compute thread), not from when this loop got round to it: a trace of the
        sampler under the SDK's load saw it wake 1.7 to 3 ms after that admission."""
        if self.config.batch_delay_s <= 0:
            return
        waiting = [
            held.admitted_ns
            for held in self._held.values()
            if held.admitted_ns and not held.outcome.done()
        ]
        waited_s = (time.time_ns() - min(waiting)) / 1e9 if waiting else 0.0
        await asyncio.sleep(max(0.0, self.config.batch_delay_s - waited_s))

    def _account(self, step: _Step) -> None:
        """Note the step in the life of each request it advanced."""
        done = {ticket for ticket, _ in step.finished}
        running = [
            (ticket, held)
            for ticket, held in self._held.items()
            if 0 < held.admitted_ns <= step.started_ns and not held.outcome.done()
        ]
        sequences = sum(max(1, held.accepted.sample.num_samples) for _, held in running)
        for ticket, held in running:
            held.steps += 1
            held.batch_requests = max(held.batch_requests, len(running))
            held.batch_sequences = max(held.batch_sequences, sequences)
            held.gpu_ms += step.gpu_ms
            held.joined_ns = held.joined_ns or step.ended_ns
            if ticket in done:
                held.finished_ns = step.ended_ns

    async def _publish(self, progress: list[Delta]) -> None:
        """Send each streamed request's new tokens to the gateway that relays them (core NATS:
        one lost is filled in from the stored result)."""
        by_ticket: dict[int, list[svc.SampleDelta]] = {}
        for delta in progress:
            by_ticket.setdefault(delta.ticket, []).append(
                svc.SampleDelta(
                    index=delta.index,
                    offset=delta.offset,
                    tokens=np.asarray(delta.tokens, "<i4").tobytes(),
                    logprobs=np.asarray(delta.logprobs, "<f4").tobytes(),
                )
            )
        for ticket, deltas in by_ticket.items():
            held = self._held.get(ticket)
            if held is None or not held.stream or held.cancelled:
                continue
            message = bus.SampleProgress(request_id=held.accepted.request_id, deltas=deltas)
            await self.bus.notify(held.stream, message.SerializeToString())

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


def nonfinite_tensors(directory: Path) -> list[str]:
    """The tensors of the safetensors files in ``directory`` (an adapter) that hold NaN or
    infinite values, read with safetensors into torch (every float type, bfloat16 included):
    run it on the compute thread. A file that is not valid safetensors is left for the engine's
    loader to refuse."""
    broken = []
    for path in sorted(directory.glob("*.safetensors")):
        try:
            with safe_open(str(path), framework="pt") as weights:
                for name in weights.keys():  # noqa: SIM118 (a safetensors handle, not a dict)
                    tensor = weights.get_tensor(name)
                    if tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()):
                        broken.append(name)
        except SafetensorError:
            log.warning("%s is not valid safetensors; its values were not checked", path.name)
    return broken


def _attributes(accepted: bus.RequestAccepted) -> dict[str, str | int]:
    """What a span of a sample request carries: its sampler, the run whose weights it samples
    (none for a base model), the base model and the adapter."""
    command = accepted.sample
    return {
        "tinsmith.sampler_id": accepted.aggregate_id,
        "tinsmith.model_id": artifacts.run_of_key(command.adapter_key),
        "tinsmith.base_model": command.base_model,
        "tinsmith.adapter": command.adapter_key,
        "tinsmith.num_samples": command.num_samples,
    }
