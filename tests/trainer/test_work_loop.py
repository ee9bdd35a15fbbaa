"""The trainer's work loop on a real nats-server with tinsmith/tiny: a request that fails fails
alone and its run's next requests run; a run taken over too many times from trainers that died
fails its next request instead of running it; requests that wait for an earlier seq_id wait as
log positions and run in order; a stop is quick, snapshots its runs and hands them over."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import numpy as np
import pytest
import torch
from nats.js import api

from services.trainer.config import TrainerConfig
from services.trainer.engine import TrainerEngine
from services.trainer.handlers import MAX_TAKEOVERS, Trainer, _RunQueue
from tests.latency import delayed
from tinsmith import events, jobs, models, subjects
from tinsmith._proto import bus_pb2 as bus
from tinsmith._proto import tinker_public_pb2 as tp
from tinsmith.blobs import BlobStore
from tinsmith.bus import Bus
from tinsmith.eventlog import EventLog, FollowedProjection

ADAM = bus.AdamParams(learning_rate=1e-2, beta1=0.9, beta2=0.95, eps=1e-8, grad_clip_norm=1.0)


class Harness:
    """Trainers on connections of their own (as the service has), the log they share, and a
    projection of it to wait on."""

    def __init__(self, eventlog: EventLog, nats_url: str, blobs: Path) -> None:
        self.eventlog = eventlog
        self.nats_url = nats_url
        self.blob_url = f"file://{blobs}"
        self.projection = FollowedProjection(eventlog)
        self.trainers: list[Trainer] = []

    @contextlib.asynccontextmanager
    async def trainer(
        self,
        idle_unload_s: float = 3600.0,
        engine: TrainerEngine | None = None,
        replica: str = "",
        nats_url: str = "",
        **config: float,
    ) -> AsyncIterator[Trainer]:
        settings = TrainerConfig(
            blob_url=self.blob_url,
            cache_dir=models.default_cache_dir(),
            idle_unload_s=idle_unload_s,
            replica=replica or f"test-trainer-{uuid.uuid4().hex[:8]}",
            **config,  # type: ignore[arg-type]
        )
        connection = await Bus.connect(nats_url or self.nats_url, name="test-trainer")
        trainer = Trainer(
            connection,
            engine or TrainerEngine(settings.cache_dir, slice_tokens=settings.slice_tokens),
            BlobStore(self.blob_url),
            settings,
        )
        await trainer.start()
        try:
            yield trainer
        finally:
            if not trainer.stopping:
                await trainer.stop()
            await connection.close()

    @contextlib.asynccontextmanager
    async def compute_held(self, trainer: Trainer, waiting: int) -> AsyncIterator[None]:
        """Hold ``trainer``'s compute thread while the body asks for requests, and let it go
        once ``waiting`` requests wait for it in the fuser's line: whatever the machine's load,
        the fuser then chooses among all of them."""
        gate = threading.Event()
        busy = asyncio.ensure_future(trainer.compute.run(gate.wait, 60.0))
        try:
            yield
            deadline = time.monotonic() + 30.0
            while trainer.fuser.waiting < waiting and time.monotonic() < deadline:
                await asyncio.sleep(0.01)
            assert trainer.fuser.waiting == waiting, (trainer.fuser.waiting, waiting)
        finally:
            gate.set()
            await busy

    async def accept(self, model_id: str, seq_id: int, **command: object) -> str:
        request_id = events.request_id(model_id, seq_id)
        accepted = bus.RequestAccepted(
            request_id=request_id,
            aggregate_id=model_id,
            seq_id=seq_id,
            **command,  # type: ignore[arg-type]
        )
        await self.eventlog.append(events.make(request_accepted=accepted), msg_id=request_id)
        return request_id

    async def create(self, model_id: str, rank: int = 4) -> str:
        lora = bus.LoraConfig(
            rank=rank, seed=1, train_mlp=True, train_attn=True, train_unembed=True
        )
        create = bus.CreateModel(session_id="S", base_model=models.TINY, lora=lora)
        return await self.accept(model_id, 0, create_model=create)

    async def settled(self, *request_ids: str, timeout: float = 60.0) -> list[jobs.RequestState]:
        requests = self.projection.state.requests

        def done() -> bool:
            return all(
                rid in requests and requests[rid].status is not jobs.Status.PENDING
                for rid in request_ids
            )

        assert await self.projection.wait_until(done, timeout), [
            requests.get(rid) for rid in request_ids
        ]
        return [requests[rid] for rid in request_ids]

    async def until(self, predicate: Callable[[], bool], timeout: float = 30.0) -> None:
        deadline = time.monotonic() + timeout
        while not predicate():
            assert time.monotonic() < deadline, "timed out"
            await asyncio.sleep(0.02)

    async def outcomes(self) -> list[tuple[str, str]]:
        """The run and request id of every outcome, in the order the log recorded them."""
        order = []
        log = self.eventlog.bus
        for seq in range(1, await log.last_seq(subjects.EVENTS_STREAM) + 1):
            event = events.decode(await log.get(subjects.EVENTS_STREAM, seq))
            kind = events.kind_of(event)
            if kind in ("request_completed", "request_failed"):
                body = getattr(event, kind)
                order.append((body.aggregate_id, body.request_id))
        return order

    async def completion_order(self, model_id: str) -> list[int]:
        """The seq_ids of the run's outcomes, in the order they were recorded."""
        return [
            int(request_id.rsplit(":", 1)[1])
            for run, request_id in await self.outcomes()
            if run == model_id
        ]


@pytest.fixture
async def harness(eventlog: EventLog, nats_url: str, tmp_path: Path) -> Harness:
    harness = Harness(eventlog, nats_url, tmp_path / "blobs")
    await harness.projection.start()
    return harness


def _batch(seed: int, datums: int = 2, length: int = 11) -> tp.ForwardBackwardRequest:
    rng = np.random.default_rng(seed)
    request = tp.ForwardBackwardRequest(loss_fn="cross_entropy")
    for _ in range(datums):
        ids = rng.integers(3, 512, size=length + 1)
        datum = request.data.add()
        datum.model_input.add().encoded_text.tokens = ids[:-1].astype("<i4").tobytes()
        datum.loss_fn_inputs["target_tokens"].CopyFrom(
            tp.Tensor(dense=ids[1:].astype("<i8").tobytes(), dtype=tp.DTYPE_INT64, shape=[length])
        )
    return request


def _diverging(seed: int) -> tp.ForwardBackwardRequest:
    """importance_sampling with sampler logprobs of -1e30: the ratio exp(p - q) is inf."""
    request = _batch(seed)
    request.loss_fn = "importance_sampling"
    for datum in request.data:
        n = datum.loss_fn_inputs["target_tokens"].shape[0]
        for key, value in (("logprobs", -1e30), ("advantages", 1.0)):
            datum.loss_fn_inputs[key].CopyFrom(
                tp.Tensor(
                    dense=np.full(n, value, "<f4").tobytes(), dtype=tp.DTYPE_FLOAT32, shape=[n]
                )
            )
    return request


async def _created_and_passed(harness: Harness, *model_ids: str) -> None:
    """Each run created, then given one forward_backward (seq_id 1), all settled."""
    for model_id in model_ids:
        await harness.settled(await harness.create(model_id))
        await harness.settled(await harness.accept(model_id, 1, forward_backward=_batch(1)))


@contextlib.asynccontextmanager
async def _full(harness: Harness, *streams: str | tuple[str, int]) -> AsyncIterator[None]:
    """The streams full, with JetStream's own limits (``max_msgs`` at the count they hold, plus
    the room given with a name, and new messages refused), inside the block; as before after."""
    js = harness.eventlog.bus.js
    before = []
    for stream in streams:
        name, room = stream if isinstance(stream, tuple) else (stream, 0)
        info = await js.stream_info(name)
        assert info.state.messages is not None
        before.append(info.config)
        held = info.state.messages + room
        full = dataclasses.replace(info.config, max_msgs=held, discard=api.DiscardPolicy.NEW)
        await js.update_stream(full)
    try:
        yield
    finally:
        for config in before:
            await js.update_stream(config)


def _weights(trainer: Trainer, model_id: str) -> list[torch.Tensor]:
    return [p.detach().clone() for p in trainer.engine.runs[model_id].params.values()]


def _status(request: jobs.RequestState) -> tuple[str, str]:
    return request.status.value, request.error_kind


async def test_a_request_with_a_non_finite_loss_fails_alone(harness: Harness) -> None:
    async with harness.trainer() as trainer:
        for model_id in ("hit", "clean"):
            await harness.create(model_id)
        bad = await harness.accept("hit", 1, forward_backward=_diverging(0))
        rest = [
            await harness.accept("hit", 2, forward_backward=_batch(1)),
            await harness.accept("hit", 3, optim_step=bus.OptimStep(adam=ADAM)),
            await harness.accept("clean", 1, forward_backward=_batch(1)),
            await harness.accept("clean", 2, optim_step=bus.OptimStep(adam=ADAM)),
        ]

        failed, *done = await harness.settled(bad, *rest)

        assert _status(failed) == ("failed", "unprocessable")
        assert "importance ratio" in failed.error_detail
        assert all(request.status is jobs.Status.COMPLETED for request in done)
        hit, clean = _weights(trainer, "hit"), _weights(trainer, "clean")
        assert all(torch.equal(a, b) for a, b in zip(hit, clean, strict=True))


async def test_a_runs_next_request_runs_while_the_outcome_before_it_is_recorded(
    harness: Harness, nats_url: str
) -> None:
    """Recording an outcome takes round trips to the bus (the hold is confirmed, the result
    stored, the completion appended); the run's next request runs meanwhile. Over a network 40
    ms slow each way, by the time the log holds a forward_backward's outcome, the optim_step sent
    with it has changed the weights. The outcomes are recorded in seq_id order all the same."""
    async with delayed(nats_url, 0.04) as slow, harness.trainer(nats_url=slow) as trainer:
        await harness.settled(await harness.create("overlapped"))
        before = _weights(trainer, "overlapped")
        passed = await harness.accept("overlapped", 1, forward_backward=_batch(1))
        step = await harness.accept("overlapped", 2, optim_step=bus.OptimStep(adam=ADAM))
        await harness.settled(passed)
        when_passed = _weights(trainer, "overlapped")
        await harness.settled(step)

    assert not all(torch.equal(a, b) for a, b in zip(before, when_passed, strict=True))
    assert await harness.completion_order("overlapped") == [0, 1, 2]


async def test_a_step_whose_result_the_bus_refuses_fails_and_changes_nothing(
    harness: Harness, caplog: pytest.LogCaptureFixture
) -> None:
    """An optim_step that ran, but whose result the bus refused to store (its results stream
    full), is recorded as failed, and a failed request changes nothing: the trainer lets the run
    go unsnapshotted and takes it again from its log (its creation and forward_backward), so it
    ends as a run that never took that step. Before, the step stayed applied in memory, and the
    next optim_step stepped from there."""
    caplog.set_level(logging.WARNING, logger="services.trainer.handlers")
    async with harness.trainer() as trainer:
        await _created_and_passed(harness, "refused", "clean")
        async with _full(harness, subjects.RESULTS_STREAM):
            step = await harness.accept("refused", 2, optim_step=bus.OptimStep(adam=ADAM))
            (failed,) = await harness.settled(step)
        assert _status(failed) == ("failed", "internal")
        assert "could not be recorded" in failed.error_detail
        # The same requests after it on both runs: the clean one never had the failed step.
        rest = [
            await harness.accept("refused", 3, forward_backward=_batch(2)),
            await harness.accept("refused", 4, optim_step=bus.OptimStep(adam=ADAM)),
            await harness.accept("clean", 2, forward_backward=_batch(2)),
            await harness.accept("clean", 3, optim_step=bus.OptimStep(adam=ADAM)),
        ]
        done = await harness.settled(*rest)
        assert all(request.status is jobs.Status.COMPLETED for request in done)
        await harness.until(lambda: "refused" in trainer.engine.runs)
        refused, clean = _weights(trainer, "refused"), _weights(trainer, "clean")
        assert all(torch.equal(a, b) for a, b in zip(refused, clean, strict=True))
    assert any("let go of run refused unsnapshotted" in r.getMessage() for r in caplog.records)


async def test_a_stop_while_the_bus_refuses_a_steps_outcome_leaves_the_step_to_the_next_trainer(
    harness: Harness, caplog: pytest.LogCaptureFixture
) -> None:
    """An optim_step ran, but the bus refused its result and then its failure (both streams
    full), and the trainer was told to stop while it tried again. What it holds of the run is
    ahead of its log: the stop lets the run go unsnapshotted, and the next trainer rebuilds it
    from the log and runs the step. Before, the stop's snapshot (which the bus took by then)
    held the step and claimed its seq_id, so the next trainer never ran it, nor recorded it."""
    caplog.set_level(logging.WARNING, logger="services.trainer.handlers")
    async with harness.trainer() as trainer:
        await _created_and_passed(harness, "stopped", "clean")
        await harness.settled(await harness.accept("clean", 2, optim_step=bus.OptimStep(adam=ADAM)))
        clean = _weights(trainer, "clean")
        # The log has room for the step's acceptance, and for nothing after it.
        async with _full(harness, subjects.RESULTS_STREAM, (subjects.EVENTS_STREAM, 1)):
            step = await harness.accept("stopped", 2, optim_step=bus.OptimStep(adam=ADAM))

            def refused_twice() -> bool:
                said = [r.getMessage() for r in caplog.records]
                failing = f"could not record the failure of request {step}"
                return sum(failing in m for m in said) >= 2

            await harness.until(refused_twice)  # it tries again in 1 s
        await trainer.stop()
    assert any("let go of run stopped unsnapshotted" in r.getMessage() for r in caplog.records)
    async with harness.trainer() as successor:
        (done,) = await harness.settled(step)
        assert done.status is jobs.Status.COMPLETED
        await harness.until(lambda: "stopped" in successor.engine.runs)
        stopped = _weights(successor, "stopped")
    assert all(torch.equal(a, b) for a, b in zip(stopped, clean, strict=True))


async def test_a_request_that_cannot_be_read_back_fails_and_the_run_goes_on(
    harness: Harness, caplog: pytest.LogCaptureFixture
) -> None:
    """Requests that wait are read back from the log when their turn comes; one whose message
    was deleted from the log meanwhile fails, outside its work's settling, and the run's next
    request runs."""
    caplog.set_level(logging.INFO, logger="services.trainer.handlers")
    async with harness.trainer() as trainer:
        await harness.settled(await harness.create("unreadable"))
        lost = await harness.accept("unreadable", 2, forward_backward=_batch(2))
        after = await harness.accept("unreadable", 3, optim_step=bus.OptimStep(adam=ADAM))
        queue = await _queue(harness, trainer, "unreadable", waiting=2)
        stream_seq = queue.pending[2].log_seq
        assert await harness.eventlog.bus.js.delete_msg(subjects.EVENTS_STREAM, stream_seq)

        first = await harness.accept("unreadable", 1, forward_backward=_batch(1))
        done, failed, step = await harness.settled(first, lost, after)

    assert _status(failed) == ("failed", "internal")
    assert "failed in the trainer" in failed.error_detail
    assert (done.status, step.status) == (jobs.Status.COMPLETED, jobs.Status.COMPLETED)
    tracebacks = [r for r in caplog.records if r.exc_info and lost in r.getMessage()]
    assert len(tracebacks) == 1  # logged once, with its traceback


async def test_a_run_names_its_tokenizer_by_its_model_never_by_a_server_path(
    harness: Harness,
) -> None:
    async with harness.trainer():
        await harness.settled(await harness.create("named"))
    run = harness.projection.state.runs["named"]
    assert run.ready and run.tokenizer_id == run.base_model
    assert not run.tokenizer_id.startswith("/")


async def test_a_run_whose_snapshot_is_gone_fails_each_request_instead_of_hanging(
    harness: Harness,
) -> None:
    async with harness.trainer(idle_unload_s=0.2) as trainer:
        await harness.settled(await harness.create("forgotten"))
        runs = harness.projection.state.runs
        await harness.until(lambda: runs["forgotten"].snapshot is not None)
        snapshot = runs["forgotten"].snapshot
        assert snapshot is not None
        assert await trainer.blobs.delete(snapshot.snapshot_key)

        first = await harness.accept("forgotten", 1, forward_backward=_batch(0))
        second = await harness.accept("forgotten", 2, optim_step=bus.OptimStep(adam=ADAM))
        outcomes = await harness.settled(first, second)

    for outcome in outcomes:
        assert _status(outcome) == ("failed", "not_found")
        assert "its snapshot cannot be read back" in outcome.error_detail


async def test_a_run_taken_over_too_often_fails_its_next_request_instead_of_running_it(
    harness: Harness,
) -> None:
    """Request 1 took down the trainers that held its run, MAX_TAKEOVERS times (here: holds
    recorded as taken over, without an outcome between them); the next holder records its
    failure instead of running it, and runs request 2."""
    async with harness.trainer():
        await harness.settled(await harness.create("poisoned"))
    epoch = harness.projection.state.runs["poisoned"].epoch
    poison = await harness.accept("poisoned", 1, forward_backward=_batch(0))
    for _ in range(MAX_TAKEOVERS):
        placed = bus.RunPlaced(model_id="poisoned", replica="gone", epoch=epoch, takeover=True)
        await harness.eventlog.append(events.make(run_placed=placed))
    await harness.projection.catch_up()
    assert harness.projection.state.runs["poisoned"].takeovers == MAX_TAKEOVERS

    async with harness.trainer():
        after = await harness.accept("poisoned", 2, forward_backward=_batch(1))
        failed, done = await harness.settled(poison, after)

    assert _status(failed) == ("failed", "internal")
    # The fifth: the holder that found it at MAX_TAKEOVERS took it over once more.
    assert f"taken over {MAX_TAKEOVERS + 1} times" in failed.error_detail
    assert done.status is jobs.Status.COMPLETED
    assert harness.projection.state.runs["poisoned"].takeovers == 0


async def test_requests_far_ahead_wait_as_log_positions_and_run_in_order(
    harness: Harness,
) -> None:
    """Forward_backwards that wait for request 1 are held as their place in the log, not their
    payloads, and are read back at their turn. They run exactly as the same requests sent in
    order."""
    batches = [_batch(seed, datums=24, length=384) for seed in range(8)]
    async with harness.trainer() as trainer:
        for model_id in ("ahead", "in-order"):
            await harness.settled(await harness.create(model_id))
        ahead = [
            await harness.accept("ahead", seq_id, forward_backward=batch)
            for seq_id, batch in enumerate(batches[1:], start=2)
        ]
        ahead.append(await harness.accept("ahead", 9, optim_step=bus.OptimStep(adam=ADAM)))
        queue = await _queue(harness, trainer, "ahead", waiting=8)
        assert all(work.log_seq > 0 for work in queue.pending.values())

        first = await harness.accept("ahead", 1, forward_backward=batches[0])
        in_order = [
            await harness.accept("in-order", seq_id, forward_backward=batch)
            for seq_id, batch in enumerate(batches, start=1)
        ]
        in_order.append(await harness.accept("in-order", 9, optim_step=bus.OptimStep(adam=ADAM)))
        outcomes = await harness.settled(first, *ahead, *in_order)

        assert all(outcome.status is jobs.Status.COMPLETED for outcome in outcomes)
        assert await harness.completion_order("ahead") == list(range(10))
        results = [await harness.eventlog.get_result(o.result_seq) for o in outcomes]
        assert results[:8] == results[9:17]  # each forward_backward's output, bit for bit
        a, b = _weights(trainer, "ahead"), _weights(trainer, "in-order")
        assert all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


async def _queue(harness: Harness, trainer: Trainer, model_id: str, waiting: int) -> _RunQueue:
    await harness.until(
        lambda: model_id in trainer.queues and len(trainer.queues[model_id].pending) == waiting
    )
    return trainer.queues[model_id]


async def test_a_stop_is_quick_snapshots_its_runs_and_hands_the_waiting_requests_back(
    harness: Harness,
) -> None:
    async with harness.trainer() as trainer:
        await harness.create("kept")
        await harness.settled(await harness.accept("kept", 1, forward_backward=_batch(1)))
        waiting = await harness.accept("kept", 3, optim_step=bus.OptimStep(adam=ADAM))
        await _queue(harness, trainer, "kept", waiting=1)

        began = time.monotonic()
        await trainer.stop()
        stopped_in = time.monotonic() - began

    assert stopped_in < 3.0
    snapshot = harness.projection.state.runs["kept"].snapshot
    assert snapshot is not None and snapshot.next_seq_id == 2
    assert not harness.projection.state.runs["kept"].placed  # released: the next trainer takes it
    async with harness.trainer():
        gap = await harness.accept("kept", 2, forward_backward=_batch(2))
        outcomes = await harness.settled(gap, waiting, timeout=30)
    assert all(outcome.status is jobs.Status.COMPLETED for outcome in outcomes)
    assert await harness.completion_order("kept") == [0, 1, 2, 3]


# -- the device's memory ------------------------------------------------------------------------


async def test_runs_that_do_not_fit_the_device_unload_the_least_recently_used(
    harness: Harness,
) -> None:
    """A budget of the base model, two runs and a step's activations: creating a third run
    unloads the least recently used one (snapshotted, as an idle run is); its next request
    restores it, with its pending gradients, and unloads the next least recently used."""
    lora = bus.LoraConfig(rank=128, seed=1, train_mlp=True, train_attn=True, train_unembed=True)
    create = bus.CreateModel(session_id="S", base_model=models.TINY, lora=lora)
    reference = TrainerEngine(models.default_cache_dir())
    reference.create_run("reference", create)
    run_bytes = reference.runs["reference"].state_bytes
    # A forward_backward sets aside three quarters of a run (gradients) beyond its activations.
    step = reference.activation_bytes(models.TINY, [11, 11], backward=True) + run_bytes * 3 // 4
    budget = reference.held_bytes() + run_bytes + step + 4096  # two runs and a step, not three
    assert budget < reference.held_bytes() + 2 * run_bytes
    placement = dataclasses.replace(reference.placement, memory_bytes=budget)
    engine = TrainerEngine(models.default_cache_dir(), placement=placement)
    runs = harness.projection.state.runs

    async with harness.trainer(engine=engine):
        await harness.settled(await harness.create("oldest", rank=128))
        await harness.settled(await harness.create("older", rank=128))
        await harness.settled(
            await harness.accept("oldest", 1, forward_backward=_batch(1)),
            await harness.accept("older", 1, forward_backward=_batch(2)),
        )
        assert set(engine.runs) == {"oldest", "older"}

        (created,) = await harness.settled(await harness.create("newest", rank=128))
        assert created.status is jobs.Status.COMPLETED
        assert set(engine.runs) == {"older", "newest"}
        assert runs["oldest"].snapshot is not None and runs["older"].snapshot is None

        (stepped,) = await harness.settled(
            await harness.accept("oldest", 2, optim_step=bus.OptimStep(adam=ADAM))
        )
        assert stepped.status is jobs.Status.COMPLETED
        assert set(engine.runs) == {"oldest", "newest"}  # "older" was the least recently used
        assert runs["older"].snapshot is not None

        reference.forward_backward("reference", _batch(1))
        reference.optim_step("reference", ADAM)
        restored = [p.detach() for p in engine.runs["oldest"].params.values()]
        expected = [p.detach() for p in reference.runs["reference"].params.values()]
        for got, want in zip(restored, expected, strict=True):
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
        assert engine.held_bytes() <= budget


async def test_a_step_that_runs_out_of_device_memory_fails_alone(harness: Harness) -> None:
    engine = TrainerEngine(models.default_cache_dir())
    async with harness.trainer(engine=engine) as trainer:
        await harness.settled(await harness.create("squeezed"))
        armed = [True]

        def exhausted(*_: object) -> None:
            if armed[0]:
                armed[0] = False
                raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB")

        model = engine.bases[models.TINY].model
        model.get_decoder().layers[0].mlp.register_forward_hook(exhausted)
        failed, *done = await harness.settled(
            await harness.accept("squeezed", 1, forward_backward=_batch(1)),
            await harness.accept("squeezed", 2, forward_backward=_batch(1)),
            await harness.accept("squeezed", 3, optim_step=bus.OptimStep(adam=ADAM)),
        )

        assert _status(failed) == ("failed", "unavailable")
        assert "ran out of memory during this forward_backward" in failed.error_detail
        assert "TINSMITH_DEVICE_MEMORY_MB" in failed.error_detail
        assert all(outcome.status is jobs.Status.COMPLETED for outcome in done)
        assert trainer.engine.runs["squeezed"].params


async def test_the_service_states_its_device_and_refuses_what_its_budget_cannot_hold(
    harness: Harness, eventlog: EventLog, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The service as `python -m services.trainer` starts it: on TINSMITH_DEVICE, within
    TINSMITH_DEVICE_MEMORY_MB, which it states; a datum that could not fit even with activation
    checkpointing is refused as the caller's (422), with its need and the budget, and the run's
    other requests are served."""
    from services.trainer.__main__ import start
    from tinsmith import health

    for name, value in {
        "TINSMITH_BLOB_URL": "memory://trainer-service-test",
        "TINSMITH_CACHE_DIR": str(models.default_cache_dir()),
        "TINSMITH_DEVICE": "cpu",
        "TINSMITH_DTYPE": "",
        "TINSMITH_DEVICE_MEMORY_MB": "4",
    }.items():
        monkeypatch.setenv(name, value)
    monkeypatch.delenv("TINSMITH_BASE_MODELS", raising=False)
    monkeypatch.setattr(health, "_FACTS", {})  # this process's facts, as they were after
    stop = await start(eventlog.bus)
    try:
        stated = health.facts()["device"]
        assert stated.startswith("cpu (") and "float32 base weights" in stated
        await harness.create("budgeted")
        outcomes = await harness.settled(
            await harness.accept("budgeted", 1, forward_backward=_batch(1, datums=2, length=900)),
            await harness.accept("budgeted", 2, forward_backward=_batch(2)),
            await harness.accept("budgeted", 3, optim_step=bus.OptimStep(adam=ADAM)),
        )
    finally:
        await stop()
    refused, *served = outcomes
    assert _status(refused) == ("failed", "unprocessable")
    assert "datum 0 (900 tokens of tinsmith/tiny) needs about" in refused.error_detail
    assert "even with activation checkpointing" in refused.error_detail
    assert "budget of 4.0 MiB (TINSMITH_DEVICE_MEMORY_MB)" in refused.error_detail
    assert all(outcome.status is jobs.Status.COMPLETED for outcome in served)


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a CUDA device")
async def test_a_device_the_machine_lacks_stops_the_service(
    eventlog: EventLog, monkeypatch: pytest.MonkeyPatch
) -> None:
    from services.trainer.__main__ import start

    monkeypatch.setenv("TINSMITH_DEVICE", "cuda")
    with pytest.raises(SystemExit, match="trainer: TINSMITH_DEVICE=cuda but this torch sees no"):
        await start(eventlog.bus)
