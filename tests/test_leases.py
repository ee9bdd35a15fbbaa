"""The trainer fleet's leases on a real nats-server: one holder per run, a dead holder's runs
orphaned when its lease expires, and at once when a replica restarts under the same name."""

from __future__ import annotations

import asyncio
import json
import uuid
from collections.abc import AsyncIterator, Iterable

import pytest

from tinsmith import subjects
from tinsmith.bus import Bus
from tinsmith.leases import Fleet, Replica


class Member:
    """A fleet member on a connection of its own, noting what it is told."""

    def __init__(self, bus: Bus, name: str, ttl_s: float) -> None:
        self.lost: list[str] = []
        self.orphaned: list[str] = []
        self.fenced = 0
        self.fleet = Fleet(
            bus,
            name,
            ttl_s,
            lambda: Replica(name=name, instance=""),
            on_lost=self._lost,
            on_fenced=self._fenced,
            on_orphaned=self._orphaned,
        )

    async def _lost(self, model_id: str) -> None:
        self.lost.append(model_id)

    async def _fenced(self) -> None:
        self.fenced += 1

    async def _orphaned(self, model_ids: Iterable[str]) -> None:
        self.orphaned.extend(model_ids)


@pytest.fixture
async def connect(nats_url: str) -> AsyncIterator[object]:
    connections: list[Bus] = []

    async def member(name: str, ttl_s: float = 1.0) -> Member:
        bus = await Bus.connect(nats_url, name="test-leases")
        connections.append(bus)
        joined = Member(bus, name, ttl_s)
        await joined.fleet.start()
        return joined

    yield member
    for bus in connections:
        if not bus.nc.is_closed:
            await bus.close()


async def _sever(member: Member) -> None:
    """What a SIGKILL leaves: the connection gone, no renewal, no goodbye."""
    for task in list(member.fleet.bus._tasks):
        task.cancel()
    await member.fleet.bus.nc.close()


async def _until(predicate: object, timeout: float = 10.0) -> None:
    assert callable(predicate)
    for _ in range(int(timeout / 0.05)):
        if predicate():
            return
        await asyncio.sleep(0.05)
    raise AssertionError("timed out")


async def test_a_run_has_one_holder_until_it_is_released(connect: object) -> None:
    assert callable(connect)
    run = f"S{uuid.uuid4().hex[:8]}:train:0"
    a, b = await connect(f"a-{run}"), await connect(f"b-{run}")
    epoch = await a.fleet.take(run)
    assert epoch is not None
    assert await b.fleet.take(run) is None  # a is alive
    assert await a.fleet.confirm(run)
    await a.fleet.release(run)
    await _until(lambda: run in b.orphaned)  # (other tests' runs may be orphaned too)
    later = await b.fleet.take(run)
    assert later is not None and later > epoch
    assert not await a.fleet.confirm(run) and await b.fleet.confirm(run)


async def test_a_hold_of_its_own_whose_answer_was_lost_is_taken_not_left_stuck(
    connect: object,
) -> None:
    """A take whose update the bus applied but whose answer a lost connection never brought
    (sent again, the same update is refused as out of date): the run's entry names this very
    process, which does not know that it holds the run. Taking it again takes it at that
    revision; before, the replica answered that another one held it, and nobody ran the run."""
    assert callable(connect)
    run = f"S{uuid.uuid4().hex[:8]}:train:0"
    a, b = await connect(f"a-{run}"), await connect(f"b-{run}")
    kv = await a.fleet.bus.js.key_value(subjects.RUN_OWNERS_BUCKET)
    own = json.dumps({"name": a.fleet.name, "instance": a.fleet.instance}).encode()
    revision = await kv.create(run.replace(":", "."), own)  # what the lost take left
    assert await a.fleet.take(run) == revision
    assert await a.fleet.confirm(run)
    assert await b.fleet.take(run) is None  # and it is a's, alive


async def test_a_dead_holder_s_runs_are_orphaned_after_its_lease_or_at_once_on_restart(
    connect: object,
) -> None:
    assert callable(connect)
    run, other = (f"S{uuid.uuid4().hex[:8]}:train:{n}" for n in range(2))
    name = f"restarts-{uuid.uuid4().hex[:6]}"
    dead = await connect(name)
    watcher = await connect(f"watcher-{name}")
    assert await dead.fleet.take(run) is not None
    await _sever(dead)

    restarted = await connect(name, ttl_s=60.0)  # the same identity: its predecessor is dead
    assert run in restarted.orphaned
    assert await restarted.fleet.take(run) is not None
    # Another replica's expiry: the watcher hears of it once the lease ends.
    short = await connect(f"short-{name}", ttl_s=1.0)
    assert await short.fleet.take(other) is not None
    await _sever(short)
    await _until(lambda: other in watcher.orphaned, timeout=10)


async def test_a_replica_started_with_another_lease_sets_the_bucket_s(connect: object) -> None:
    """The replicas' bucket expires entries after the lease it was made with; a replica started
    with another TINSMITH_TRAINER_LEASE_S sets it, so that a changed setting takes effect, a
    shorter one included (the bucket's duplicate window shortens with it)."""
    assert callable(connect)
    bucket = f"KV_{subjects.TRAINERS_BUCKET}"
    probe = await connect(f"lease-probe-{uuid.uuid4().hex[:6]}", ttl_s=1.0)
    await probe.fleet.bus.js.delete_key_value(subjects.TRAINERS_BUCKET)
    made = await connect(f"lease-made-{uuid.uuid4().hex[:6]}", ttl_s=3.0)  # the default lease
    assert (await made.fleet.bus.js.stream_info(bucket)).config.duplicate_window == 3.0
    first = await connect(f"lease-a-{uuid.uuid4().hex[:6]}", ttl_s=1.0)
    config = (await first.fleet.bus.js.stream_info(bucket)).config
    assert (config.max_age, config.duplicate_window) == (1.0, 1.0)
    await connect(f"lease-b-{uuid.uuid4().hex[:6]}", ttl_s=2.5)
    assert (await first.fleet.bus.js.stream_info(bucket)).config.max_age == 2.5
    await connect(f"lease-c-{uuid.uuid4().hex[:6]}", ttl_s=1.0)  # as the other tests have it
    assert (await first.fleet.bus.js.stream_info(bucket)).config.max_age == 1.0
