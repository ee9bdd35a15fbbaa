"""The work queues on a real nats-server: messages reach a handler as they arrive, whatever pull
requests are left open; a replica takes only what it has room for; redelivery is bounded and its
last delivery says so."""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator

import pytest
from nats.js import api

from tinsmith.bus import Bus
from tinsmith.workqueue import MAX_DELIVER, Delivery


@pytest.fixture
async def bus(nats_url: str) -> AsyncIterator[Bus]:
    connection = await Bus.connect(nats_url, name="test-workqueue")
    yield connection
    await connection.close()


async def _stream(bus: Bus) -> str:
    name = "WQ" + uuid.uuid4().hex[:8].upper()
    await bus.js.add_stream(api.StreamConfig(name=name, subjects=[f"{name.lower()}.>"]))
    return name


async def test_a_message_is_handled_at_once_though_a_pull_request_is_left_open(bus: Bus) -> None:
    """A pull request left on the server (as a fetch that timed out leaves one) takes the next
    message; it must reach the handler at once, not when some request expires (nats-py's
    ``fetch`` held it for the whole 30 s of its own request)."""
    stream = await _stream(bus)
    arrived: asyncio.Queue[float] = asyncio.Queue()

    async def handler(deliveries: list[Delivery]) -> None:
        for delivery in deliveries:
            arrived.put_nowait(time.monotonic() - float(delivery.data))
            await delivery.ack()

    await bus.consume(stream, "w", f"{stream.lower()}.>", handler, batch=16, ack_wait_s=30)
    inboxes = [sub.subject for sub in bus.nc._subs.values() if sub.subject.startswith("_INBOX")]
    leftover = json.dumps({"batch": 1, "expires": int(25e9)}).encode()
    await bus.nc.publish(f"$JS.API.CONSUMER.MSG.NEXT.{stream}.w", leftover, reply=inboxes[-1])
    waits = []
    for n in range(10):
        await bus.js.publish(f"{stream.lower()}.{n}", str(time.monotonic()).encode())
        waits.append(await asyncio.wait_for(arrived.get(), 20))
    assert max(waits) < 1.0, waits


async def test_a_replica_takes_only_what_it_has_room_for(bus: Bus, nats_url: str) -> None:
    stream = await _stream(bus)
    held: dict[str, list[Delivery]] = {"a": [], "b": []}
    room = {"a": 2, "b": 100}

    def replica(name: str) -> tuple[object, object]:
        async def handler(deliveries: list[Delivery]) -> None:
            held[name].extend(deliveries)

        async def free() -> int:
            while room[name] - len(held[name]) <= 0:
                await asyncio.sleep(0.01)
            return room[name] - len(held[name])

        return handler, free

    other = await Bus.connect(nats_url, name="test-workqueue-b")
    try:
        for name, connection in (("a", bus), ("b", other)):
            handler, free = replica(name)
            await connection.consume(
                stream, "w", f"{stream.lower()}.>", handler, batch=64, ack_wait_s=30, room=free
            )
        await asyncio.sleep(0.3)
        for n in range(20):
            await bus.js.publish(f"{stream.lower()}.{n}", b"x")
        deadline = time.monotonic() + 10
        while len(held["a"]) + len(held["b"]) < 20 and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        assert len(held["a"]) + len(held["b"]) == 20
        assert len(held["a"]) <= 2
    finally:
        await other.close()


async def test_redelivery_is_bounded_and_the_last_delivery_says_so(bus: Bus) -> None:
    stream = await _stream(bus)
    seen: list[tuple[int, bool]] = []
    done = asyncio.Event()

    async def handler(deliveries: list[Delivery]) -> None:
        for delivery in deliveries:
            seen.append((delivery.num_delivered, delivery.last))
            if delivery.last:
                await delivery.ack()
                done.set()
            else:
                await delivery.nak()  # as a worker that died with it would, but at once

    await bus.consume(stream, "w", f"{stream.lower()}.>", handler, batch=4, ack_wait_s=30)
    await bus.js.publish(f"{stream.lower()}.1", b"poison")
    await asyncio.wait_for(done.wait(), 20)
    await asyncio.sleep(0.3)  # nothing more comes
    assert seen == [(n, n == MAX_DELIVER) for n in range(1, MAX_DELIVER + 1)]


async def test_an_existing_consumer_takes_the_current_settings(bus: Bus) -> None:
    """A data directory made by an older version keeps working, with today's ack wait and
    redelivery bound."""
    stream = await _stream(bus)
    subject = f"{stream.lower()}.>"
    old = api.ConsumerConfig(
        durable_name="w",
        ack_policy=api.AckPolicy.EXPLICIT,
        ack_wait=600,
        filter_subject=subject,
        max_ack_pending=-1,
    )
    await bus.js.add_consumer(stream, old)

    async def handler(deliveries: list[Delivery]) -> None:
        for delivery in deliveries:
            await delivery.ack()

    await bus.consume(stream, "w", subject, handler, batch=4, ack_wait_s=30)
    info = await bus.js.consumer_info(stream, "w")
    assert info.config.ack_wait == 30
    assert info.config.max_deliver == MAX_DELIVER


async def test_a_released_payload_is_gone_from_memory(bus: Bus) -> None:
    stream = await _stream(bus)
    got: asyncio.Queue[Delivery] = asyncio.Queue()

    async def handler(deliveries: list[Delivery]) -> None:
        for delivery in deliveries:
            got.put_nowait(delivery)

    await bus.consume(stream, "w", f"{stream.lower()}.>", handler, batch=4, ack_wait_s=30)
    await bus.js.publish(f"{stream.lower()}.1", b"payload")
    delivery = await asyncio.wait_for(got.get(), 10)
    assert delivery.data == b"payload"
    delivery.release()
    assert delivery.released
    with pytest.raises(RuntimeError, match="released"):
        _ = delivery.data
    assert await bus.get(stream, delivery.stream_seq) == b"payload"
    await delivery.ack()


async def test_a_stopped_queue_takes_nothing_more_and_what_it_hands_back_goes_elsewhere(
    bus: Bus, nats_url: str
) -> None:
    """A stopping replica hands its requests back: none may come back to it (each return would
    spend a delivery), and the others get them at once."""
    stream = await _stream(bus)
    subject = f"{stream.lower()}.>"
    stopping: list[Delivery] = []
    other: asyncio.Queue[Delivery] = asyncio.Queue()

    async def hold(deliveries: list[Delivery]) -> None:
        stopping.extend(deliveries)

    async def take(deliveries: list[Delivery]) -> None:
        for delivery in deliveries:
            other.put_nowait(delivery)

    queue = await bus.consume(stream, "w", subject, hold, batch=8, ack_wait_s=30)
    await bus.js.publish(f"{stream.lower()}.1", b"held")
    deadline = time.monotonic() + 10
    while not stopping and time.monotonic() < deadline:
        await asyncio.sleep(0.01)
    await queue.stop()
    for delivery in stopping:
        await delivery.nak()
    second = await Bus.connect(nats_url, name="test-workqueue-other")
    try:
        await second.consume(stream, "w", subject, take, batch=8, ack_wait_s=30)
        await bus.js.publish(f"{stream.lower()}.2", b"new")
        got = [await asyncio.wait_for(other.get(), 10) for _ in range(2)]
        assert sorted((d.data, d.num_delivered) for d in got) == [(b"held", 2), (b"new", 1)]
        assert [d.data for d in stopping] == [b"held"]
    finally:
        await second.close()
