"""How long a message waits between its publish and a worker's handler, through tinsmith's work
queue (tinsmith/workqueue.py) and through the loop it replaced (nats-py's ``fetch`` of a batch
with a 30 s timeout), each with a pull request left open on the server, as a fetch that timed out
on a starved client leaves one.

Both run side by side against one private nats-server, each on its own stream and durable
consumer: a message is published, the next only once the previous one was handled (as an SDK
waits for each answer), with a pause of 0, 1, 10 or 100 ms between them, for ``--seconds``. It
prints how many messages each loop handled, its median and worst wait, and the ratio of the
worst waits: the leftover request holds one message in the old loop, until it expires.

    .venv/bin/python -m bench.work_queue [--seconds 40]

The old loop's first message waits for the leftover request's whole expiry (25 s here); so the
run takes at least that long.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import subprocess
import tempfile
import time
from collections.abc import Awaitable, Callable

from nats.js import api

from tinsmith.bus import Bus
from tinsmith.embedded import free_port, nats_server_binary
from tinsmith.workqueue import Delivery

_LEFTOVER = json.dumps({"batch": 1, "expires": int(25e9)}).encode()


async def _stream(bus: Bus, name: str) -> str:
    await bus.js.add_stream(api.StreamConfig(name=name, subjects=[f"{name.lower()}.>"]))
    return f"{name.lower()}.>"


async def _workqueue(bus: Bus, arrived: Callable[[bytes], None]) -> None:
    subject = await _stream(bus, "NEW")

    async def handler(deliveries: list[Delivery]) -> None:
        for delivery in deliveries:
            arrived(delivery.data)
            await delivery.ack()

    await bus.consume("NEW", "w", subject, handler, batch=256, ack_wait_s=600)
    inbox = [s.subject for s in bus.nc._subs.values() if s.subject.startswith("_INBOX")][-1]
    await bus.nc.publish("$JS.API.CONSUMER.MSG.NEXT.NEW.w", _LEFTOVER, reply=inbox)


async def _fetch_loop(bus: Bus, arrived: Callable[[bytes], None]) -> None:
    """The work loop tinsmith had: fetch up to 256, 30 s timeout, again."""
    subject = await _stream(bus, "OLD")
    config = api.ConsumerConfig(
        durable_name="w", ack_policy=api.AckPolicy.EXPLICIT, ack_wait=600, max_ack_pending=-1
    )
    sub = await bus.js.pull_subscribe(subject, durable="w", stream="OLD", config=config)

    async def loop() -> None:
        while True:
            try:
                msgs = await sub.fetch(256, timeout=30)
            except TimeoutError:
                continue
            for msg in msgs:
                arrived(msg.data)
                await msg.ack()

    bus.spawn(loop())
    await bus.nc.publish("$JS.API.CONSUMER.MSG.NEXT.OLD.w", _LEFTOVER, reply=sub._sub.subject)


async def _measure(
    bus: Bus, name: str, setup: Callable[[Bus, Callable[[bytes], None]], Awaitable[None]], s: float
) -> list[float]:
    waits: list[float] = []
    got = asyncio.Event()

    def arrived(data: bytes) -> None:
        waits.append(time.time() - float(data))
        got.set()

    await setup(bus, arrived)
    await asyncio.sleep(0.3)  # the leftover pull request is on the server
    end, n = time.monotonic() + s, 0
    while time.monotonic() < end or n == 0:
        got.clear()
        await bus.js.publish(f"{name.lower()}.{n}", str(time.time()).encode())
        n += 1
        await asyncio.wait_for(got.wait(), 60)
        await asyncio.sleep(random.choice([0.0, 0.001, 0.01, 0.1]))
    return waits


async def main(seconds: float) -> None:
    store = tempfile.mkdtemp(prefix="tinsmith-bench-")
    port = free_port()
    server = subprocess.Popen(
        [nats_server_binary(), "-a", "127.0.0.1", "-p", str(port), "-js", "-sd", store],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        await asyncio.sleep(0.5)
        new_bus = await Bus.connect(f"nats://127.0.0.1:{port}", name="bench-new")
        old_bus = await Bus.connect(f"nats://127.0.0.1:{port}", name="bench-old")
        new, old = await asyncio.gather(
            _measure(new_bus, "NEW", _workqueue, seconds),
            _measure(old_bus, "OLD", _fetch_loop, seconds),
        )
        print(f"{'':28}{'messages':>10}{'median ms':>12}{'worst ms':>12}")
        for label, waits in (("work queue (tinsmith)", new), ("fetch(256, timeout=30)", old)):
            median = statistics.median(waits) * 1e3
            print(f"{label:28}{len(waits):>10}{median:>12.1f}{max(waits) * 1e3:>12.1f}")
        ratio = max(old) / max(new)
        print(f"worst wait, fetch loop / work queue: {ratio:.0f}x")
        await new_bus.close()
        await old_bus.close()
    finally:
        server.kill()
        server.wait()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seconds", type=float, default=40.0)
    asyncio.run(main(parser.parse_args().seconds))
