"""The sampler's work loop, on a real nats-server with the torch engine: a request cancelled
before any replica fetched it is skipped, acked without running, while the request after it runs
as usual; the loop steps the engine on its compute thread without a hand-off per token, yet a
request that comes, or a cancellation, gets in between two steps of a long request; requests that
come to an idle sampler within its batch delay start together. (A request cancelled while it
decodes, through the gateway: tests/e2e/test_grpc.py.)"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

import pytest

from services.sampler.config import SamplerConfig
from services.sampler.engine import make_engine
from services.sampler.handlers import Sampler
from services.sampler.torch_engine import TorchEngine
from tinsmith import events, jobs, models
from tinsmith._proto import bus_pb2 as bus
from tinsmith._proto import tinker_public_pb2 as tp
from tinsmith.blobs import BlobStore
from tinsmith.eventlog import EventLog, FollowedProjection

from .test_failures import nothing_left

SAMPLER = "S:sample:0"


async def _accept(eventlog: EventLog, seq_id: int, max_tokens: int) -> str:
    """A request of four sequences of exactly ``max_tokens`` tokens, accepted into the log."""
    request_id = events.request_id(SAMPLER, seq_id)
    command = bus.Sample(
        base_model=models.TINY,
        prompt=[5, 17, 99],
        params=tp.SamplingParams(max_tokens=max_tokens, temperature=1.0, top_p=1.0, top_k=-1),
        num_samples=4,
    )
    command.params.stop_tokens.SetInParent()  # no stop: it runs to max_tokens
    accepted = bus.RequestAccepted(
        request_id=request_id, aggregate_id=SAMPLER, seq_id=seq_id, sample=command
    )
    await eventlog.append(
        events.make(request_accepted=accepted), msg_id=request_id, request_aggregate="sampler"
    )
    return request_id


async def test_a_request_cancelled_before_it_was_fetched_is_not_run(
    eventlog: EventLog, caplog: pytest.LogCaptureFixture
) -> None:
    long = await _accept(eventlog, 0, max_tokens=1000)  # seconds of work, were it run
    assert await eventlog.cancel(long, SAMPLER, "the client went away", request_aggregate="sampler")
    short = await _accept(eventlog, 1, max_tokens=4)
    projection = FollowedProjection(eventlog)
    await projection.start()
    config = SamplerConfig(blob_url="memory://", cache_dir=models.default_cache_dir())
    sampler = Sampler(eventlog.bus, make_engine(config), BlobStore("memory://"), config)
    caplog.set_level(logging.INFO, logger="services.sampler.handlers")
    await sampler.start()
    try:
        assert await projection.wait_until(
            lambda: _status(projection, short) is jobs.Status.COMPLETED, 60.0
        )
        # Nothing left unacked: the long request is not running behind the short one.
        await nothing_left(eventlog, within_s=2.0)
        # Skipped when the sampler knew of the cancellation as it was fetched; dropped at once
        # when the cancellation came a moment after (the sampler reads cancellations before it
        # takes work, but does not wait for the end of the log to start).
        assert (
            f"skipped request {long}: it was cancelled" in caplog.text
            or f"dropped request {long}" in caplog.text
        ), caplog.text
        cancelled = projection.state.requests[long]
        assert (cancelled.status, cancelled.error_kind) == (jobs.Status.FAILED, "cancelled")
    finally:
        await sampler.stop()


def _status(projection: FollowedProjection, request_id: str) -> jobs.Status | None:
    """The request's status as the projection knows it (None before its acceptance arrives)."""
    request = projection.state.requests.get(request_id)
    return request.status if request is not None else None


async def _start(
    eventlog: EventLog, batch_delay_s: float = SamplerConfig.batch_delay_s
) -> tuple[Sampler, FollowedProjection]:
    projection = FollowedProjection(eventlog)
    await projection.start()
    config = SamplerConfig(
        blob_url="memory://", cache_dir=models.default_cache_dir(), batch_delay_s=batch_delay_s
    )
    sampler = Sampler(eventlog.bus, make_engine(config), BlobStore("memory://"), config)
    await sampler.start()
    return sampler, projection


async def _decoding(sampler: Sampler) -> None:
    """Return once the engine has a request to step."""
    deadline = time.monotonic() + 30.0
    while not sampler.engine.has_work():
        assert time.monotonic() < deadline
        await asyncio.sleep(0.01)


async def test_a_request_that_comes_while_a_long_one_decodes_joins_between_two_steps(
    eventlog: EventLog,
) -> None:
    sampler, projection = await _start(eventlog)
    try:
        long = await _accept(eventlog, 0, max_tokens=1000)  # a thousand steps
        await _decoding(sampler)
        short = await _accept(eventlog, 1, max_tokens=4)
        assert await projection.wait_until(
            lambda: _status(projection, short) not in (None, jobs.Status.PENDING), 60.0
        )
        # Done within a few steps of coming, not after the long request's thousand.
        assert projection.state.requests[short].status is jobs.Status.COMPLETED
        assert projection.state.requests[long].status is jobs.Status.PENDING
        assert await projection.wait_until(
            lambda: _status(projection, long) is jobs.Status.COMPLETED, 60.0
        )
    finally:
        await sampler.stop()


async def test_a_request_cancelled_while_it_decodes_stops_between_two_steps(
    eventlog: EventLog,
) -> None:
    sampler, projection = await _start(eventlog)
    try:
        whole = await _accept(eventlog, 0, max_tokens=1000)
        await _decoding(sampler)
        began = time.monotonic()
        assert await projection.wait_until(
            lambda: _status(projection, whole) is jobs.Status.COMPLETED, 60.0
        )
        run_s = time.monotonic() - began  # a thousand steps
        long = await _accept(eventlog, 1, max_tokens=1000)
        await _decoding(sampler)
        assert await eventlog.cancel(long, SAMPLER, "changed my mind", request_aggregate="sampler")
        cancelled_at = time.monotonic()
        while sampler.engine.has_work():
            await asyncio.sleep(0.005)
        # Let go of within a step or so, not after running to its end.
        assert time.monotonic() - cancelled_at < run_s / 4, run_s
        assert await projection.wait_until(
            lambda: _status(projection, long) not in (None, jobs.Status.PENDING), 60.0
        )
        cancelled = projection.state.requests[long]
        assert (cancelled.status, cancelled.error_kind) == (jobs.Status.FAILED, "cancelled")
    finally:
        await sampler.stop()


@pytest.mark.parametrize("batch_delay_s", [1.0, 0.0])
async def test_requests_that_come_to_an_idle_sampler_together_start_together(
    eventlog: EventLog, batch_delay_s: float
) -> None:
    """Two requests a moment apart: within the batch delay (0.05 s after the first, of 1 s), the
    first step holds both (one prefill); with none, the first starts alone at once (the second
    comes 0.5 s later: long enough for the first to reach a loaded machine's sampler, far
    shorter than the 1 s delay)."""
    sampler, projection = await _start(eventlog, batch_delay_s)
    engine = sampler.engine
    assert isinstance(engine, TorchEngine)
    first_rows: list[dict[int, int]] = []  # each request's rows after the first step
    step = engine.step

    def observed() -> list[tuple[int, bytes | Exception]]:
        finished = step()
        if not first_rows:
            first_rows.append(engine.batch_rows(models.TINY))
        return finished

    engine.step = observed  # type: ignore[method-assign]
    try:
        first = await _accept(eventlog, 0, max_tokens=8)
        await asyncio.sleep(0.05 if batch_delay_s else 0.5)
        second = await _accept(eventlog, 1, max_tokens=8)
        for request in (first, second):
            assert await projection.wait_until(
                lambda r=request: _status(projection, r) is jobs.Status.COMPLETED, 60.0
            )
        both = {ticket: 4 for ticket in (0, 1)}  # four sequences each
        assert first_rows == ([both] if batch_delay_s else [{0: 4}])
    finally:
        await sampler.stop()


async def test_the_batch_delay_runs_from_the_first_admission(eventlog: EventLog) -> None:
    """The event loop is held up for 0.4 s just as the first request is given to the engine:
    the first step still begins the delay (0.6 s) after that admission, not the delay after
    the loop was free again (1.0 s)."""
    delay_s, held_up_s = 0.6, 0.4
    sampler, projection = await _start(eventlog, delay_s)
    engine = sampler.engine
    loop = asyncio.get_running_loop()
    admitted: list[float] = []
    stepped: list[float] = []
    add, step = engine.add, engine.step

    def observed_add(*args: Any, **kwargs: Any) -> None:
        add(*args, **kwargs)
        if not admitted:
            admitted.append(time.monotonic())
            loop.call_soon_threadsafe(time.sleep, held_up_s)  # the loop, busy elsewhere

    def observed_step() -> list[tuple[int, bytes | Exception]]:
        if not stepped:
            stepped.append(time.monotonic())
        return step()

    engine.add = observed_add  # type: ignore[method-assign]
    engine.step = observed_step  # type: ignore[method-assign]
    try:
        request = await _accept(eventlog, 0, max_tokens=4)
        assert await projection.wait_until(
            lambda: _status(projection, request) is jobs.Status.COMPLETED, 60.0
        )
        waited = stepped[0] - admitted[0]
        assert delay_s - 0.05 <= waited < delay_s + 0.25, waited
    finally:
        await sampler.stop()
