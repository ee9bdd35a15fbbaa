"""Cancellation in the sampler's work loop, on a real nats-server with the torch engine: a
request cancelled before any replica fetched it is skipped, acked without running, while the
request after it runs as usual. (A request cancelled while it decodes: tests/e2e/test_grpc.py.)"""

from __future__ import annotations

import asyncio
import logging
import time

import pytest

from services.sampler.config import SamplerConfig
from services.sampler.engine import make_engine
from services.sampler.handlers import Sampler
from tinsmith import events, jobs, models, subjects
from tinsmith._proto import bus_pb2 as bus
from tinsmith._proto import tinker_public_pb2 as tp
from tinsmith.blobs import BlobStore
from tinsmith.eventlog import EventLog, FollowedProjection

SAMPLER = "S:sample:0"


async def _accept(eventlog: EventLog, seq_id: int, max_tokens: int) -> str:
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
            lambda: projection.state.requests[short].status is jobs.Status.COMPLETED, 60.0
        )
        # Nothing left unacked: the long request is not running behind the short one.
        deadline = time.monotonic() + 2.0
        while True:
            info = await eventlog.bus.js.consumer_info(
                subjects.EVENTS_STREAM, subjects.SAMPLER_CONSUMER
            )
            if info.num_ack_pending == 0 and info.num_pending == 0:
                break
            assert time.monotonic() < deadline, info
            await asyncio.sleep(0.05)
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
