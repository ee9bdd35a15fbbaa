"""Which trainer replica holds which run: JetStream KV entries that the replicas keep alive.

Owns:
- the replicas' bucket (``subjects.TRAINERS_BUCKET``): one entry per live replica, named by its
  stable identity (``TINSMITH_REPLICA``), with its process's instance id and what it has room
  for. The bucket's max age is the lease: an entry not renewed within it expires, and the
  server's delete marker tells every replica's watch at once;
- the runs' bucket (``subjects.RUN_OWNERS_BUCKET``): one entry per placed run, naming the
  replica and instance that hold it. It has no expiry: a hold is valid while its replica's entry
  lives, so a replica renews one entry however many runs it holds;
- taking a run: a compare-and-set on the run's entry (create it, or replace an entry whose
  holder is gone at that entry's revision), so exactly one replica wins. The revision the
  winner wrote is its **epoch**: revisions only grow, so a later hold always has a larger one,
  which is what the folds compare to ignore a cut-off holder's events (``jobs.fenced``);
- noticing loss: a replica whose own entry was replaced or expired (it was paused, or cut off
  from the bus, past the lease) has lost every run (``on_fenced``); a run whose entry names
  another holder now is lost alone (``on_lost``); a run whose holder's entry expired, or that
  was released, may need a new holder (``on_orphaned``).

A replica restarted under the same identity (``tinsmith up`` names its trainer ``trainer-0``; a
Kubernetes pod keeps its name across container restarts) knows that the entry of its name is its
predecessor's, dead, and takes that replica's runs over at once instead of after the lease.

Does not own: where a run should go (``placement``), or what holding a run means (the trainer).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import logging
import re
import uuid
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import asdict, dataclass, replace

from nats.js import api
from nats.js.errors import BucketNotFoundError, KeyNotFoundError, KeyWrongLastSequenceError
from nats.js.kv import KeyValue

from tinsmith import subjects
from tinsmith.bus import Bus

log = logging.getLogger(__name__)

# The server's expiry markers stay this long; a watch sees them as they are placed.
_MARKER_TTL_S = 60.0


@dataclass(frozen=True)
class Replica:
    """A live trainer replica, as its entry describes it."""

    name: str  # stable identity, unique among live replicas
    instance: str  # the process behind it now
    base_models: tuple[str, ...] = ()  # loaded in its memory
    runs: int = 0  # runs it holds
    free_bytes: int = 0  # of its device memory budget
    budget_bytes: int = 0
    draining: bool = False  # stopping: it takes no run

    def encode(self) -> bytes:
        return json.dumps(asdict(self)).encode()

    @classmethod
    def decode(cls, data: bytes) -> Replica:
        fields = json.loads(data)
        fields["base_models"] = tuple(fields.get("base_models", ()))
        return cls(**fields)


@dataclass(frozen=True)
class Hold:
    """A run's entry: who holds it, and the revision (the epoch) it was taken at."""

    name: str
    instance: str
    epoch: int


Describe = Callable[[], Replica]


class Fleet:
    """This replica's view of the fleet and its holds on runs."""

    def __init__(
        self,
        bus: Bus,
        name: str,
        ttl_s: float,
        describe: Describe,
        *,
        on_lost: Callable[[str], Awaitable[None]],
        on_fenced: Callable[[], Awaitable[None]],
        on_orphaned: Callable[[Iterable[str]], Awaitable[None]],
    ) -> None:
        self.bus = bus
        self.name = name
        self.instance = uuid.uuid4().hex[:12]
        self.ttl_s = ttl_s
        self.describe = describe
        self.on_lost = on_lost
        self.on_fenced = on_fenced
        self.on_orphaned = on_orphaned
        self.replicas: dict[str, Replica] = {}  # live replicas, by name (this one included)
        self.holds: dict[str, Hold] = {}  # every placed run's entry, by model id
        self.held: dict[str, int] = {}  # the runs this replica holds: their epochs
        self._replicas_kv: KeyValue | None = None
        self._runs_kv: KeyValue | None = None
        self._revision = 0  # of this replica's own entry
        self._own_lock = asyncio.Lock()  # one write of the own entry at a time (compare-and-set)
        self._draining = False
        self._left = False

    # -- lifecycle -----------------------------------------------------------------------------

    async def start(self) -> None:
        """Join the fleet: open the buckets, follow them, and register this replica (replacing
        the entry of a dead predecessor with the same identity)."""
        self._replicas_kv = await self._bucket(subjects.TRAINERS_BUCKET, ttl=self.ttl_s)
        self._runs_kv = await self._bucket(subjects.RUN_OWNERS_BUCKET, ttl=None)
        await self._follow(self._runs_kv, self._on_run_entry)
        await self._follow(self._replicas_kv, self._on_replica_entry)
        await self._register()
        self.bus.spawn(self._renew())

    async def drain(self) -> None:
        """Say that this replica is stopping: no placement picks it any more."""
        self._draining = True
        with contextlib.suppress(Exception):
            await self._put_own()

    async def leave(self) -> None:
        """Remove this replica's entry (after it released its runs)."""
        self._left = True
        kv = self._replicas_kv
        if kv is not None:
            with contextlib.suppress(Exception):
                await kv.delete(_replica_key(self.name), last=self._revision)

    # -- runs ----------------------------------------------------------------------------------

    def alive(self, hold: Hold | None) -> bool:
        """Whether ``hold``'s replica lives (the very process that took it)."""
        if hold is None:
            return False
        replica = self.replicas.get(hold.name)
        return replica is not None and replica.instance == hold.instance

    def holder(self, model_id: str) -> Hold | None:
        """The live hold on a run, if any."""
        hold = self.holds.get(model_id)
        return hold if self.alive(hold) else None

    async def take(self, model_id: str) -> int | None:
        """Hold the run if nobody live does; its epoch, or None if another replica has it. A
        hold that names this very process is its own, known or not: a take whose answer a lost
        connection never brought was applied, and the same update, sent again, is refused as
        out of date; the entry is then read again, and this process's hold found there."""
        kv = self._kv(self._runs_kv)
        key = _key(model_id)
        value = json.dumps({"name": self.name, "instance": self.instance}).encode()
        for _ in range(2):  # a refused update: another took it first, or this one did
            try:
                entry = await self.bus.resent_after_reconnect(lambda: kv.get(key))
            except KeyNotFoundError as missing:
                entry = missing.entry  # deleted (released): replaced at its revision
            current = _hold(entry)
            if current is not None and self.alive(current):
                if current.instance != self.instance:
                    return None
                return await self._hold_at(model_id, current.epoch)
            last = entry.revision if entry is not None and entry.revision else 0
            try:
                epoch = await self.bus.resent_after_reconnect(
                    functools.partial(kv.update, key, value, last=last)
                )
            except KeyWrongLastSequenceError:
                continue
            return await self._hold_at(model_id, epoch)
        return None

    async def _hold_at(self, model_id: str, epoch: int) -> int:
        if self.held.get(model_id) != epoch:
            self.held[model_id] = epoch
            self.holds[model_id] = Hold(self.name, self.instance, epoch)
            await self._put_own()
        return epoch

    async def confirm(self, model_id: str) -> bool:
        """Whether this replica still holds the run, asked of the bus now (before recording)."""
        epoch = self.held.get(model_id)
        if epoch is None:
            return False
        kv = self._kv(self._runs_kv)
        try:
            entry = await self.bus.resent_after_reconnect(lambda: kv.get(_key(model_id)))
        except KeyNotFoundError:
            return False
        return entry.revision == epoch

    async def release(self, model_id: str) -> None:
        """Let go of a run: its next holder rebuilds it from its latest recorded snapshot and
        the log."""
        epoch = self.held.pop(model_id, None)
        if epoch is None:
            return
        self.holds.pop(model_id, None)
        with contextlib.suppress(KeyWrongLastSequenceError, KeyNotFoundError):
            await self._kv(self._runs_kv).delete(_key(model_id), last=epoch)
        with contextlib.suppress(Exception):
            await self._put_own()

    def forget(self, model_id: str) -> None:
        """Drop a hold that is no longer this replica's (lost), without touching the bus."""
        self.held.pop(model_id, None)

    # -- following -----------------------------------------------------------------------------

    async def _on_run_entry(self, entry: KeyValue.Entry) -> None:
        model_id = _model_id(entry.key)
        hold = _hold(entry) if entry.operation is None else None
        if hold is None:
            self.holds.pop(model_id, None)
            if model_id not in self.held:
                await self.on_orphaned([model_id])
            return
        self.holds[model_id] = hold
        mine = self.held.get(model_id)
        if mine is not None and hold.epoch != mine:
            self.held.pop(model_id, None)
            log.warning("run %s was taken over by %s", model_id, hold.name)
            await self.on_lost(model_id)

    async def _on_replica_entry(self, entry: KeyValue.Entry) -> None:
        name = _name(entry.key)
        if entry.operation is None and entry.value:
            replica = Replica.decode(entry.value)
            before = self.replicas.get(name)
            self.replicas[name] = replica
            if before is not None and before.instance != replica.instance:
                await self._gone(before)
            return
        gone = self.replicas.pop(name, None)
        if gone is not None:
            await self._gone(gone)

    async def _gone(self, replica: Replica) -> None:
        """A replica's entry expired or was replaced: its runs have no live holder now."""
        if replica.name == self.name and replica.instance == self.instance:
            if not self._left:
                await self._fence()
            return
        orphans = [
            model_id
            for model_id, hold in self.holds.items()
            if hold.name == replica.name and hold.instance == replica.instance
        ]
        if orphans:
            log.info("trainer %s is gone; %d of its runs need a holder", replica.name, len(orphans))
            await self.on_orphaned(orphans)

    # -- this replica's entry ------------------------------------------------------------------

    async def _register(self) -> None:
        kv = self._kv(self._replicas_kv)
        predecessor = self.replicas.get(self.name)
        async with self._own_lock:
            own = self._own()
            self._revision = await kv.put(_replica_key(self.name), own.encode())
            self.replicas[self.name] = own
        if predecessor is not None and predecessor.instance != self.instance:
            await self._gone(predecessor)  # this identity's previous process: dead

    def _own(self) -> Replica:
        described = self.describe()
        return replace(
            described,
            name=self.name,
            instance=self.instance,
            runs=len(self.held),
            draining=self._draining or described.draining,
        )

    async def _put_own(self) -> None:
        kv = self._kv(self._replicas_kv)
        async with self._own_lock:
            own = self._own()
            self._revision = await kv.update(
                _replica_key(self.name), own.encode(), last=self._revision
            )
            self.replicas[self.name] = own

    async def _renew(self) -> None:
        """Renew this replica's entry every third of the lease; if it was replaced or expired
        meanwhile, every hold is lost (fenced), and the replica joins again as a new instance."""
        while not self.bus.closing:
            await asyncio.sleep(self.ttl_s / 3)
            if self._left:
                return
            try:
                # A renewal gets a third of the lease: one answered later than that (it was in
                # flight when the server went away) is of no use, and the next one is due.
                await asyncio.wait_for(self._put_own(), self.ttl_s / 3)
            except KeyWrongLastSequenceError:
                if not await self._still_own():
                    await self._fence()
            except Exception:
                log.warning("could not renew trainer %s's lease", self.name, exc_info=True)

    async def _still_own(self) -> bool:
        """Whether this replica's entry is still this process's, though at another revision
        than the one it knows: a renewal whose answer was lost (a timeout, a reconnection) was
        applied. Then that revision is taken as the own one."""
        kv = self._kv(self._replicas_kv)
        try:
            entry = await self.bus.resent_after_reconnect(lambda: kv.get(_replica_key(self.name)))
        except KeyNotFoundError:
            return False
        if not entry.value or Replica.decode(entry.value).instance != self.instance:
            return False
        self._revision = entry.revision or self._revision
        return True

    async def _fence(self) -> None:
        log.error(
            "trainer %s lost its lease (paused or cut off from the bus past %.1f s): it lets go "
            "of every run it held and joins again",
            self.name,
            self.ttl_s,
        )
        self.held.clear()
        self.instance = uuid.uuid4().hex[:12]
        await self.on_fenced()
        await self._register()

    # -- plumbing ------------------------------------------------------------------------------

    async def _bucket(self, bucket: str, ttl: float | None) -> KeyValue:
        """The bucket, made if missing. One made with another lease takes this replica's: the
        last replica started sets it (give every replica the same ``TINSMITH_TRAINER_LEASE_S``)."""
        try:
            kv = await self.bus.js.key_value(bucket)
        except BucketNotFoundError:
            config = api.KeyValueConfig(
                bucket=bucket,
                history=1,
                ttl=ttl,
                storage=api.StorageType.FILE,
                limit_marker_ttl=_MARKER_TTL_S if ttl else None,
            )
            return await self.bus.js.create_key_value(config)
        if ttl is not None:
            await self._set_lease(bucket, ttl)
        return kv

    async def _set_lease(self, bucket: str, ttl: float) -> None:
        stream = f"KV_{bucket}"
        config = (await self.bus.js.stream_info(stream)).config
        if config.max_age is not None and abs(config.max_age - ttl) < 1e-3:
            return
        log.warning(
            "the trainers' lease was %s s; %s sets it to %.1f s (TINSMITH_TRAINER_LEASE_S)",
            f"{config.max_age:.1f}" if config.max_age else "unlimited",
            self.name,
            ttl,
        )
        config.max_age = ttl
        # The server refuses a duplicate window longer than the entries live (a bucket made
        # with a longer lease has one as long as that lease).
        if config.duplicate_window and config.duplicate_window > ttl:
            config.duplicate_window = ttl
        await self.bus.js.update_stream(config)

    async def _follow(
        self, kv: KeyValue, handle: Callable[[KeyValue.Entry], Awaitable[None]]
    ) -> None:
        """Apply the bucket's current entries now, then every change as it happens."""
        watcher = await kv.watchall()
        while (entry := await watcher.updates(timeout=10.0)) is not None:  # type: ignore[no-untyped-call]
            await handle(entry)

        async def follow() -> None:
            async for change in watcher:
                if change is None:
                    continue
                try:
                    await handle(change)
                except Exception:
                    log.exception("could not apply a change of %s", change.bucket)

        self.bus.spawn(follow())

    @staticmethod
    def _kv(kv: KeyValue | None) -> KeyValue:
        if kv is None:
            raise RuntimeError("the fleet has not started")
        return kv


def _key(model_id: str) -> str:
    """A run id or replica name as a KV key (KV keys have no ':'; ids have no '.')."""
    return model_id.replace(":", ".")


def _model_id(key: str) -> str:
    return key.replace(".", ":")


def _replica_key(name: str) -> str:
    """A replica's name as a KV key: bytes a key cannot hold are escaped as ``=XX``."""
    return "".join(
        chr(b) if chr(b).isascii() and (chr(b).isalnum() or chr(b) in "-_") else f"={b:02x}"
        for b in name.encode()
    )


def _name(key: str) -> str:
    raw = re.sub(rb"=([0-9a-f]{2})", lambda m: bytes([int(m.group(1), 16)]), key.encode())
    return raw.decode(errors="replace")


def _hold(entry: KeyValue.Entry | None) -> Hold | None:
    if entry is None or not entry.value or entry.operation is not None:
        return None
    fields = json.loads(entry.value)
    return Hold(str(fields["name"]), str(fields["instance"]), int(entry.revision or 0))
