"""Where a run should go among the live trainer replicas: one order that every replica computes
alike from the fleet's entries (tinsmith/leases.py), so the first in it takes the run and the
others only step in, one after another, if it does not.

The order, best first: replicas that hold the run's base model in memory (runs of one base share
one copy of it, and the grouping that fused training needs), then the others; within each, the
replica holding the fewest runs (load is spread, and a replica that joins takes new runs at
once), then the one with the most free memory of its budget, then by name. A draining
(stopping) replica is never chosen. A replica short of memory makes room by unloading idle runs,
or refuses with the limit.

Pure: no I/O.
"""

from __future__ import annotations

from collections.abc import Iterable

from tinsmith.leases import Replica

# Each replica after the first in the order waits this much longer before it steps in.
STAGGER_S = 0.25


def order(replicas: Iterable[Replica], base_model: str) -> list[str]:
    """The names of the replicas that may take a run of ``base_model``, best first."""

    def key(replica: Replica) -> tuple[bool, int, int, str]:
        return (
            base_model not in replica.base_models,
            replica.runs,
            -replica.free_bytes,
            replica.name,
        )

    return [r.name for r in sorted((r for r in replicas if not r.draining), key=key)]


def delay(names: list[str], me: str) -> float:
    """How long ``me`` waits before it tries to take the run: 0 for the first in the order."""
    position = names.index(me) if me in names else len(names)
    return position * STAGGER_S
