"""Where a run should go among the live trainer replicas: one order that every replica computes
alike from the fleet's entries (tinsmith/leases.py), so the first in it takes the run and the
others only step in, one after another, if it does not.

The order, best first:
1. replicas that hold the run's base model in memory and have room for the run (runs of one base
   share one copy of it, and the grouping that fused training needs);
2. replicas with room for the run and its base model;
3. the rest (a replica makes room by unloading idle runs, or refuses with the limit);
within each, the replica holding the fewest runs first (load is spread, and a replica that
joins takes new runs at once), then the one with the most free memory, then by name.
A draining (stopping) replica is never chosen.

Pure: no I/O.
"""

from __future__ import annotations

from collections.abc import Iterable

from tinsmith.leases import Replica

# Each replica after the first in the order waits this much longer before it steps in.
STAGGER_S = 0.25


def order(
    replicas: Iterable[Replica], base_model: str, run_bytes: int, base_bytes: int
) -> list[str]:
    """The names of the replicas that may take a run, best first."""

    def key(replica: Replica) -> tuple[int, int, int, str]:
        has_base = base_model in replica.base_models
        if has_base and replica.free_bytes >= run_bytes:
            tier = 0
        elif replica.free_bytes >= run_bytes + (0 if has_base else base_bytes):
            tier = 1
        else:
            tier = 2
        return tier, replica.runs, -replica.free_bytes, replica.name

    return [r.name for r in sorted((r for r in replicas if not r.draining), key=key)]


def delay(names: list[str], me: str) -> float:
    """How long ``me`` waits before it tries to take the run: 0 for the first in the order."""
    position = names.index(me) if me in names else len(names)
    return position * STAGGER_S
