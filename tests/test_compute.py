"""The compute thread's count of waiting work, which long work on the thread reads between two
pieces (the sampler's loop of steps) to let other work in."""

from __future__ import annotations

import asyncio
import threading

from tinsmith.compute import ComputeThread


async def _started(event: threading.Event) -> None:
    while not event.is_set():
        await asyncio.sleep(0.001)


async def test_long_work_on_the_thread_sees_the_work_waiting_behind_it() -> None:
    compute = ComputeThread("test-compute")
    running, go = threading.Event(), threading.Event()
    seen: list[bool] = []

    def long() -> None:
        running.set()
        seen.append(compute.others_waiting())  # alone
        go.wait(10.0)
        seen.append(compute.others_waiting())  # with the short work waiting

    try:
        first = asyncio.create_task(compute.run(long))
        await _started(running)
        assert not compute.others_waiting()  # the running work is not waiting
        second = asyncio.create_task(compute.run(lambda: "short"))
        await asyncio.sleep(0.01)  # submitted
        assert compute.others_waiting()
        go.set()
        await first
        assert await second == "short"
        assert seen == [False, True]
        assert not compute.others_waiting()
    finally:
        compute.shutdown()


async def test_work_cancelled_before_it_started_stops_waiting() -> None:
    compute = ComputeThread("test-compute")
    running, go = threading.Event(), threading.Event()
    ran: list[str] = []

    def block() -> None:
        running.set()
        go.wait(10.0)

    try:
        first = asyncio.create_task(compute.run(block))
        await _started(running)
        queued = asyncio.create_task(compute.run(ran.append, "queued"))
        await asyncio.sleep(0.01)
        assert compute.others_waiting()
        queued.cancel()
        await asyncio.gather(queued, return_exceptions=True)
        # Cancelled while it waited: it never runs, and no longer counts as waiting.
        assert not compute.others_waiting()
        go.set()
        await first
        await compute.run(lambda: None)
        assert ran == [] and not compute.others_waiting()
    finally:
        compute.shutdown()
