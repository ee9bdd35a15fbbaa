"""Failures in the sampler's work loop, on a real nats-server with the torch engine on
tinsmith/tiny: a poison request fails alone and the sampler serves on; an adapter whose weights
are not finite is refused when it is fetched, and never loaded; a request on its last delivery is
recorded as failed without being run."""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from services.sampler.config import SamplerConfig
from services.sampler.engine import make_engine
from services.sampler.handlers import Sampler, nonfinite_tensors
from tests.sampler.test_isolation import save_nan_adapter
from tinsmith import events, jobs, models, subjects
from tinsmith._proto import bus_pb2 as bus
from tinsmith._proto import tinker_public_pb2 as tp
from tinsmith.blobs import BlobStore
from tinsmith.eventlog import EventLog, FollowedProjection
from tinsmith.workqueue import MAX_DELIVER, Delivery, WorkQueue

SAMPLER = "S:sample:0"


async def _accept(eventlog: EventLog, seq_id: int, adapter: str = "", **params: float) -> str:
    request_id = events.request_id(SAMPLER, seq_id)
    sampling = tp.SamplingParams(max_tokens=4, temperature=1.0, top_p=1.0, top_k=-1, seed=seq_id)
    for name, value in params.items():
        setattr(sampling, name, value)
    command = bus.Sample(
        base_model=models.TINY, adapter_key=adapter, prompt=[5, 17, 99], params=sampling
    )
    command.num_samples = 2
    accepted = bus.RequestAccepted(
        request_id=request_id, aggregate_id=SAMPLER, seq_id=seq_id, sample=command
    )
    await eventlog.append(
        events.make(request_accepted=accepted), msg_id=request_id, request_aggregate="sampler"
    )
    return request_id


@pytest.fixture
async def projection(eventlog: EventLog) -> FollowedProjection:
    projection = FollowedProjection(eventlog)
    await projection.start()
    return projection


@pytest.fixture
async def sampler(eventlog: EventLog) -> AsyncIterator[Callable[[], Sampler]]:
    """Starts a sampler on the event log (after the test has set the stage); stops it after."""
    started: list[Sampler] = []

    def start() -> Sampler:
        config = SamplerConfig(blob_url="memory://", cache_dir=models.default_cache_dir())
        sampler = Sampler(eventlog.bus, make_engine(config), BlobStore("memory://"), config)
        started.append(sampler)
        return sampler

    yield start
    for sampler in started:
        await sampler.stop()


async def _settled(projection: FollowedProjection, *request_ids: str) -> list[jobs.RequestState]:
    def done() -> bool:
        states = projection.state.requests
        return all(
            r in states and states[r].status in (jobs.Status.COMPLETED, jobs.Status.FAILED)
            for r in request_ids
        )

    assert await projection.wait_until(done, 60.0)
    return [projection.state.requests[r] for r in request_ids]


async def nothing_left(eventlog: EventLog, within_s: float = 5.0) -> None:
    """Every request was acked (within ``within_s``): none will come back."""
    deadline = time.monotonic() + within_s
    while True:
        info = await eventlog.bus.js.consumer_info(
            subjects.EVENTS_STREAM, subjects.SAMPLER_CONSUMER
        )
        if info.num_ack_pending == 0 and info.num_pending == 0:
            return
        assert time.monotonic() < deadline, info
        await asyncio.sleep(0.05)


async def test_a_poison_request_fails_alone_and_the_sampler_serves_on(
    eventlog: EventLog, projection: FollowedProjection, sampler: Callable[[], Sampler]
) -> None:
    before = await _accept(eventlog, 0)
    nan = await _accept(eventlog, 1, temperature=math.nan)
    denormal = await _accept(eventlog, 2, temperature=1e-45)  # 1.4e-45 once a float32
    beside = await _accept(eventlog, 3)
    await sampler().start()
    states = await _settled(projection, before, nan, denormal, beside)
    assert [s.status for s in states] == [
        jobs.Status.COMPLETED,
        jobs.Status.FAILED,
        jobs.Status.COMPLETED,
        jobs.Status.COMPLETED,
    ]
    assert states[1].error_kind == "invalid_request" and "temperature" in states[1].error_detail
    after = await _accept(eventlog, 4)  # the issue: every later sample failed
    [state] = await _settled(projection, after)
    assert state.status is jobs.Status.COMPLETED
    await nothing_left(eventlog)


async def test_an_adapter_with_nan_weights_is_refused_and_never_loaded(
    eventlog: EventLog,
    projection: FollowedProjection,
    sampler: Callable[[], Sampler],
    tmp_path: Path,
) -> None:
    key = f"runs/S:train:0/sampler_weights/diverged-{time.time_ns()}"
    save_nan_adapter(tmp_path)
    await BlobStore("memory://").put_dir(key, tmp_path)
    bad = await _accept(eventlog, 0, adapter=key)
    good = await _accept(eventlog, 1)
    started = sampler()
    await started.start()
    failed, completed = await _settled(projection, bad, good)
    assert completed.status is jobs.Status.COMPLETED
    assert (failed.status, failed.error_kind) == (jobs.Status.FAILED, "unprocessable")
    assert failed.error_detail.startswith(f"request {bad}: the adapter weights at {key!r}")
    assert "NaN or infinite values" in failed.error_detail
    assert "not loaded" in failed.error_detail
    assert not started.engine.has_adapter(models.TINY, key)


def test_the_weights_check_reads_every_float_type(tmp_path: Path) -> None:
    save_file(
        {
            "fine": torch.ones(4),
            "half_inf": torch.tensor([1.0, math.inf], dtype=torch.float16),
            "brain_nan": torch.tensor([0.5, math.nan, 2.0], dtype=torch.bfloat16),
            "brain_fine": torch.tensor([-3.0, 1e30], dtype=torch.bfloat16),
            "ids": torch.tensor([1, 2], dtype=torch.int64),
        },
        str(tmp_path / "adapter_model.safetensors"),
    )
    assert sorted(nonfinite_tensors(tmp_path)) == ["brain_nan", "half_inf"]
    (tmp_path / "adapter_model.safetensors").unlink()
    save_file({"w": torch.from_numpy(np.zeros((3, 5), "f8"))}, str(tmp_path / "x.safetensors"))
    assert nonfinite_tensors(tmp_path) == []


async def test_a_request_on_its_last_delivery_is_failed_without_running(
    eventlog: EventLog,
    projection: FollowedProjection,
    sampler: Callable[[], Sampler],
    caplog: pytest.LogCaptureFixture,
) -> None:
    poison = await _accept(eventlog, 0, max_tokens=1000)  # seconds of work, were it run

    # Four workers took it and let go of it without an outcome (here: handed it back at once;
    # in life, they crashed, stalled past the ack wait, or stopped).
    async def unused(deliveries: list[Delivery]) -> None:
        raise AssertionError("not started")

    queue = WorkQueue(
        eventlog.bus,
        subjects.EVENTS_STREAM,
        subjects.SAMPLER_CONSUMER,
        subjects.events_of("sampler"),
        unused,
        batch=1,
        ack_wait_s=30,
    )
    await eventlog.bus.js.add_consumer(subjects.EVENTS_STREAM, queue.config)
    taker = await eventlog.bus.js.pull_subscribe_bind(
        durable=subjects.SAMPLER_CONSUMER, stream=subjects.EVENTS_STREAM
    )
    for n in range(1, MAX_DELIVER):
        [msg] = await taker.fetch(1, timeout=5)
        assert msg.metadata.num_delivered == n
        await msg.nak()
    await taker.unsubscribe()
    after = await _accept(eventlog, 1)
    caplog.set_level(logging.INFO, logger="services.sampler.handlers")
    await sampler().start()
    failed, completed = await _settled(projection, poison, after)
    assert completed.status is jobs.Status.COMPLETED
    assert (failed.status, failed.error_kind) == (jobs.Status.FAILED, "internal")
    assert f"request {poison} was taken {MAX_DELIVER} times" in failed.error_detail
    assert f"failed request {poison} without running it" in caplog.text
    await nothing_left(eventlog)


async def test_the_service_states_its_device_and_fails_what_its_budget_cannot_hold(
    eventlog: EventLog, projection: FollowedProjection, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The service as `python -m services.sampler` starts it: on TINSMITH_DEVICE, within
    TINSMITH_DEVICE_MEMORY_MB, which it states; a request that could never fit is failed as the
    caller's (400), with its need and the budget, and the others are served."""
    from services.sampler.__main__ import start
    from tinsmith import health

    for name, value in {
        "TINSMITH_BLOB_URL": "memory://",
        "TINSMITH_CACHE_DIR": str(models.default_cache_dir()),
        "TINSMITH_SAMPLER_ENGINE": "torch",
        "TINSMITH_DEVICE": "cpu",
        "TINSMITH_DEVICE_MEMORY_MB": "2",
    }.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setattr(health, "_FACTS", {})  # this process's facts, as they were after
    stop = await start(eventlog.bus)
    try:
        stated = health.facts()["device"]
        assert stated.startswith("cpu (") and "float32" in stated and "(torch engine)" in stated
        small = await _accept(eventlog, 0)
        huge = await _accept(eventlog, 1, max_tokens=100_000)
        states = await _settled(projection, small, huge)
    finally:
        await stop()
    assert [s.status for s in states] == [jobs.Status.COMPLETED, jobs.Status.FAILED]
    assert states[1].error_kind == "invalid_request"
    detail = states[1].error_detail
    assert "even alone, more than its budget of 2.0 MiB (TINSMITH_DEVICE_MEMORY_MB)" in detail
    assert "3 prompt + 100000 sampled tokens" in detail
