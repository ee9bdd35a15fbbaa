"""Applying the event log's retention rule: after each catalog snapshot, the checkpoint service
purges the event stream below the lowest position anything may still need.

Owns: gathering what the rule (tinsmith/retention.py) weighs, from the bus: every kind's newest
snapshot position, a projection of the log (the newest gateway or trainer snapshot this version
reads), and every consumer of the event stream; then the purge (every aggregate's events below
the floor but the keys', after marking the floor in the snapshot store: ``Store.purged``), and
a log line of what it dropped and what holds the rest. Does not own: the rule itself, or the
snapshots.

Only with ``TINSMITH_EVENTS_RETENTION=snapshots``; by default (``keep``) the log keeps every
event (starts still replay only the log after their snapshot), so that a version whose
projection types differ, which cannot read the snapshots of the one before, can start from the
whole log.
"""

from __future__ import annotations

import logging

from nats.js import api

from tinsmith import retention, snapshots, subjects
from tinsmith.bus import Bus
from tinsmith.eventlog import newest_projection

log = logging.getLogger(__name__)

# Aggregates whose events are never purged: API keys are issued and revoked rarely, and
# `tinsmith keys` reads every key event from the log itself (tinsmith/keyadmin.py).
KEPT = ("key",)


class Retention:
    def __init__(self, bus: Bus, store: snapshots.Store, *, purge: bool) -> None:
        self.bus = bus
        self.store = store
        self.purge = purge

    async def after_snapshot(self, _position: int) -> None:
        """What the catalog's snapshot listener calls: apply the rule (failures are logged; the
        next snapshot tries again)."""
        if not self.purge:
            return
        try:
            await self.apply()
        except Exception:
            log.exception("applying the event log's retention failed; trying again later")

    async def apply(self) -> retention.Floor | None:
        """Purge the event stream below the rule's floor; the floor, or None when no projection
        of the log this version reads is kept yet (nothing is purged then)."""
        info = await self.bus.js.stream_info(subjects.EVENTS_STREAM)
        log_id = info.created.isoformat() if info.created is not None else ""
        positions = await self.store.positions()
        state = await newest_projection(self.store, log_id)
        if state is None:
            log.info("retention: no projection snapshot this version reads yet; nothing purged")
            return None
        consumers = [
            retention.Consumer(
                name=found.name,
                ack_floor=int(found.ack_floor.stream_seq if found.ack_floor else 0),
                pending=int(found.num_pending or 0),
                ack_pending=int(found.num_ack_pending or 0),
            )
            for found in await self._consumers()
        ]
        floor = retention.floor(
            state, snapshots=positions, kinds=snapshots.KINDS, consumers=consumers
        )
        first = max(int(info.state.first_seq), await self.store.purged())
        if floor.position <= first:
            log.info("retention: the log starts at %d, kept: %s", first, floor.reason)
            return floor
        # Marked first: a reader that starts meanwhile must not take the log for whole.
        await self.store.mark_purged(floor.position)
        for aggregate in subjects.AGGREGATES:
            if aggregate in KEPT:
                continue
            await self.bus.js.purge_stream(
                subjects.EVENTS_STREAM, seq=floor.position, subject=subjects.events_of(aggregate)
            )
        after = await self.bus.js.stream_info(subjects.EVENTS_STREAM)
        log.info(
            "retention: dropped events %d to %d but the keys' (%d events, %.1f MB); the log "
            "now starts at %d, held by: %s",
            first,
            floor.position - 1,
            int(info.state.messages) - int(after.state.messages),
            (int(info.state.bytes) - int(after.state.bytes)) / 1e6,
            floor.position,
            floor.reason,
        )
        return floor

    async def _consumers(self) -> list[api.ConsumerInfo]:
        found: list[api.ConsumerInfo] = []
        while True:
            page = await self.bus.js.consumers_info(subjects.EVENTS_STREAM, offset=len(found))
            found.extend(page)
            if len(page) < 256:
                return found
