"""The event types of the log, and how an event finds its aggregate and its bytes.

Owns: constructing events, naming the aggregate each one belongs to, encoding, and the request
id convention. The types themselves are the protobuf messages of proto/tinsmith/v1/bus.proto.
Does not own: appending or reading the log (tinsmith/eventlog.py) or folding (tinsmith/jobs.py).
Pure: no I/O.
"""

from __future__ import annotations

import time
from typing import Any

from tinsmith._proto import bus_pb2 as bus

Event = bus.Event

# Which aggregate each event kind belongs to, and the field that names it.
_AGGREGATE: dict[str, tuple[str, str]] = {
    "session_created": ("session", "session_id"),
    "session_finished": ("session", "session_id"),
    "run_created": ("run", "model_id"),
    "weights_saved": ("run", "model_id"),
    "run_unloaded": ("run", "model_id"),
    "run_restored": ("run", "model_id"),
    "run_snapshotted": ("run", "model_id"),
    "run_placed": ("run", "model_id"),
    "metrics_reported": ("run", "model_id"),
    "sampler_created": ("sampler", "sampler_id"),
    "checkpoint_deleted": ("run", "model_id"),
    "checkpoint_published": ("run", "model_id"),
    "checkpoint_ttl_set": ("run", "model_id"),
    "weights_copied": ("run", "model_id"),
    "session_project_assigned": ("session", "session_id"),
    "key_issued": ("key", "key_id"),
    "key_revoked": ("key", "key_id"),
}
_REQUEST_EVENTS = (
    "request_accepted",
    "request_rejected",
    "request_completed",
    "request_failed",
    "request_cancelled",
)


def make(**kind: Any) -> bus.Event:
    """Build an event from exactly one keyword, e.g. ``make(session_created=...)``, stamped now."""
    if len(kind) != 1:
        raise ValueError(f"an event has exactly one kind, got {sorted(kind)}")
    return bus.Event(time=time.time(), **kind)


def kind_of(event: bus.Event) -> str:
    kind = event.WhichOneof("kind")
    if kind is None:
        raise ValueError("event has no kind")
    return str(kind)


def aggregate_of(event: bus.Event, *, request_aggregate: str = "run") -> tuple[str, str]:
    """``(aggregate type, aggregate id)`` of an event. Request events belong to the run or sampler
    named by their ``aggregate_id``; ``request_aggregate`` says which."""
    kind = kind_of(event)
    body = getattr(event, kind)
    if kind in _REQUEST_EVENTS:
        return request_aggregate, body.aggregate_id
    aggregate, field = _AGGREGATE[kind]
    return aggregate, getattr(body, field)


# The events a trainer records under its hold on a run (their ``epoch`` field): the folds ignore
# one whose epoch is older than the run's latest ``RunPlaced``.
FENCED = (
    "request_completed",
    "request_failed",
    "run_created",
    "weights_saved",
    "run_unloaded",
    "run_snapshotted",
    "run_restored",
)


def epoch_of(event: bus.Event) -> int:
    """The trainer's epoch an event was recorded under; 0 for events that carry none (recorded
    by another service, or by a version before epochs)."""
    kind = kind_of(event)
    return int(getattr(event, kind).epoch) if kind in FENCED else 0


def request_id(aggregate_id: str, seq_id: int) -> str:
    """Request ids are derived from ``(aggregate, seq_id)``, so a retried submission finds the
    first future without any lookup, on any gateway replica."""
    return f"{aggregate_id}:{seq_id}"


def command_of(accepted: bus.RequestAccepted) -> str:
    command = accepted.WhichOneof("command")
    if command is None:
        raise ValueError(f"request {accepted.request_id} carries no command")
    return str(command)


def encode(event: bus.Event) -> bytes:
    return event.SerializeToString()


def decode(data: bytes) -> bus.Event:
    event = bus.Event()
    event.ParseFromString(data)
    return event
