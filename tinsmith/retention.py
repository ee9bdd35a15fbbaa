"""The retention rule of the event log: the lowest log position anything may still need, below
which the stream may be purged.

Owns: the rule, as a pure function of a ``jobs.Projection`` and the positions the bus reports.
Does not own: gathering those positions or purging (the checkpoint service does both:
services/checkpoint/retention.py), nor the snapshots (tinsmith/snapshots.py).

What must stay (each gives a position; the floor is the lowest):
- every kind's newest projection snapshot, and what follows it: a snapshot at P lets a new
  process start at P + 1, so the log may lose what is at or below P only once every kind's
  newest snapshot is at P or later (a kind without a snapshot needs the whole log);
- what a rebuild of each run reads: a trainer rebuilds a run from its newest snapshot (or its
  creation) and executes again its requests from the snapshot's next seq_id on
  (``jobs.Projection.rebuilt_from``), each read back from the log at its ``log_seq``; the
  creation's own event too while the run has no snapshot. A run whose snapshot covers all its
  requests (a run unloaded when it fell idle) holds nothing back: the rule is what the trainer
  reads, not ``RunState.replay_from`` (the snapshot event's position), which would keep every
  run's last unload in the log forever;
- each request accepted and not yet settled (``log_seq``): it is work to do, read back from the
  log by position;
- each consumer of the stream that has not seen everything (its ack floor + 1): the work queues,
  and every process still catching up with the log (its own ephemeral consumer).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from tinsmith import jobs


@dataclass(frozen=True)
class Consumer:
    """A consumer of the event stream as the server reports it."""

    name: str
    ack_floor: int  # the stream sequence at and below which it has seen (or acked) everything
    pending: int  # messages it has not been given yet
    ack_pending: int  # messages given and not acked yet

    @property
    def needs(self) -> int | None:
        """The lowest position it still needs; None: it has seen all there is."""
        if self.pending == 0 and self.ack_pending == 0:
            return None
        return self.ack_floor + 1


@dataclass(frozen=True)
class Floor:
    """The lowest position that must stay, and what holds it there."""

    position: int
    reason: str


def floor(
    state: jobs.Projection,
    *,
    snapshots: Mapping[str, int],
    kinds: Iterable[str],
    consumers: Iterable[Consumer],
) -> Floor:
    """The lowest log position that must stay; the log may drop every position below it.
    ``state`` is a projection of the log at some position (a snapshot's: positions after it are
    kept by the snapshots' own bound); ``snapshots`` the newest snapshot position of each kind,
    ``kinds`` every kind that keeps one."""
    candidates: list[Floor] = []
    for kind in kinds:
        at = snapshots.get(kind)
        if at is None:
            return Floor(1, f"the {kind} projection has no snapshot yet")
        candidates.append(Floor(at + 1, f"the {kind} snapshot is at {at}"))
    for request in state.requests.values():
        run = state.runs.get(request.aggregate_id)
        if run is not None and request.seq_id >= state.rebuilt_from(run):
            why = f"a rebuild of run {run.model_id} reads request {request.request_id}"
        elif request.status is jobs.Status.PENDING:
            why = f"request {request.request_id} is pending"
        else:
            continue
        candidates.append(Floor(max(1, request.log_seq), why))
    for consumer in consumers:
        needs = consumer.needs
        if needs is not None:
            candidates.append(Floor(needs, f"consumer {consumer.name} reads from it"))
    return min(candidates, key=lambda c: c.position, default=Floor(1, "nothing kept"))
