"""Reading a stream in order on a real nats-server: a replay larger than what the process may
hold arrives whole, in order, whatever the handler's speed; a lost consumer is made again from
the next sequence; a reader starts anywhere and stops."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator

import pytest
from nats.js import api

from tinsmith.bus import Bus


@pytest.fixture
async def bus(nats_url: str) -> AsyncIterator[Bus]:
    connection = await Bus.connect(nats_url, name="test-follower")
    yield connection
    await connection.close()


async def _stream(bus: Bus, count: int, size: int) -> tuple[str, str]:
    name = "F" + uuid.uuid4().hex[:8].upper()
    subject = f"{name.lower()}.>"
    await bus.js.add_stream(api.StreamConfig(name=name, subjects=[subject]))
    for start in range(0, count, 200):
        acks = [
            bus.js.publish(f"{name.lower()}.{n % 7}", n.to_bytes(4, "big") + b"x" * (size - 4))
            for n in range(start, min(count, start + 200))
        ]
        await asyncio.gather(*acks)
    return name, subject


async def test_a_replay_far_larger_than_the_window_arrives_whole_with_a_slow_handler(
    bus: Bus,
) -> None:
    """3 MB of log, a reader allowed 64 KiB and 32 messages in hand, and a handler that yields
    to the loop and sleeps now and then: every message arrives once, in order, and the reader
    never holds more than it was allowed (with nats-py's ordered push consumer, the client's
    pending limit dropped the tail of such a replay silently)."""
    count, size = 3000, 1000
    stream, subject = await _stream(bus, count, size)
    seen: list[int] = []
    most = [0, 0]
    done = asyncio.Event()

    async def handler(seq: int, data: bytes) -> None:
        seen.append(int.from_bytes(data[:4], "big"))
        held, held_bytes = reader.buffered
        most[0], most[1] = max(most[0], held), max(most[1], held_bytes)
        await asyncio.sleep(0.002 if seq % 50 == 0 else 0)
        if len(seen) == count + 500:
            done.set()

    reader = await bus.follow(stream, subject, handler, window=32, window_bytes=64 * 1024)
    # Live messages while the replay is still going: they come after it, in order.
    for start in range(count, count + 500, 100):
        await asyncio.gather(
            *(
                bus.js.publish(f"{stream.lower()}.x", n.to_bytes(4, "big") + b"y" * (size - 4))
                for n in range(start, start + 100)
            )
        )
    await asyncio.wait_for(done.wait(), 60)
    assert seen == list(range(count + 500))
    assert most[0] <= 32 and most[1] <= 64 * 1024
    await reader.stop()


async def test_a_reader_starts_at_a_sequence_and_follows_what_comes_next(bus: Bus) -> None:
    stream, subject = await _stream(bus, 50, 16)
    seen: list[int] = []
    arrived = asyncio.Event()

    async def handler(seq: int, data: bytes) -> None:
        seen.append(seq)
        if seq == 51:
            arrived.set()

    reader = await bus.follow(stream, subject, handler, start_seq=41)
    await bus.js.publish(f"{stream.lower()}.z", b"late")
    await asyncio.wait_for(arrived.wait(), 10)
    assert seen == list(range(41, 52))
    await reader.stop()


async def test_a_deleted_consumer_is_made_again_from_the_next_sequence(bus: Bus) -> None:
    """The server forgets the consumer (a restart of an in-memory consumer, or its inactivity
    limit): the reader makes a new one where it was, and loses nothing."""
    stream, subject = await _stream(bus, 10, 16)
    seen: list[int] = []
    changed = asyncio.Event()

    async def handler(seq: int, data: bytes) -> None:
        seen.append(seq)
        changed.set()

    reader = await bus.follow(stream, subject, handler)
    while len(seen) < 10:
        changed.clear()
        await asyncio.wait_for(changed.wait(), 10)
    await bus.js.delete_consumer(stream, reader._consumer)
    for n in range(5):
        await bus.js.publish(f"{stream.lower()}.after", str(n).encode())
    while len(seen) < 15:
        changed.clear()
        await asyncio.wait_for(changed.wait(), 20)
    assert seen == list(range(1, 16))
    assert reader.restarts >= 1
    await reader.stop()
    assert not [c for c in await bus.js.consumers_info(stream)]


async def test_a_message_larger_than_the_window_is_read_alone(bus: Bus) -> None:
    stream, subject = await _stream(bus, 20, 100)
    await bus.js.publish(f"{stream.lower()}.big", b"B" * 50_000)
    await bus.js.publish(f"{stream.lower()}.small", b"after")
    seen: list[int] = []
    arrived = asyncio.Event()

    async def handler(seq: int, data: bytes) -> None:
        seen.append(len(data))
        if data == b"after":
            arrived.set()

    reader = await bus.follow(stream, subject, handler, window=8, window_bytes=4096)
    await asyncio.wait_for(arrived.wait(), 20)
    assert seen == [100] * 20 + [50_000, 5]
    await reader.stop()
