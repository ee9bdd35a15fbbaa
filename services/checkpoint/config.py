"""The checkpoint service's settings, read once from the environment."""

from __future__ import annotations

import math
import os
from dataclasses import dataclass


@dataclass(frozen=True)
class CheckpointConfig:
    blob_url: str
    # The SQL catalog (read models of the event log): sqlite+aiosqlite:///... or
    # postgresql+asyncpg://...; `tinsmith up` puts a SQLite file in its data directory. Empty: a
    # SQLite file in a temporary directory, rebuilt from the log at every start.
    catalog_url: str
    # Garbage collection: an artifact in the store that no event records is removed once it is
    # this old (a save in progress writes its blob before it records it), on start and then
    # every gc_interval_s.
    gc_grace_s: float = 3600.0
    gc_interval_s: float = 6 * 3600.0
    # How long the download URLs of get_external_weights_urls (and of checkpoint archives and
    # session traces) stay valid.
    url_ttl_s: int = 3600
    # The event log's retention (services/checkpoint/retention.py): "keep" keeps every event
    # (the default: a version whose projections differ can start only from the whole log);
    # "snapshots" purges, after each catalog snapshot, what every kind's newest projection
    # snapshot covers and nothing needs any more.
    events_retention: str = "keep"
    # How long a live event waits to share its catalog transaction with those that follow it,
    # while no reader waits for the tables (services/checkpoint/projection.py). 0: each event
    # is folded as it arrives.
    catalog_gather_s: float = 0.05

    @classmethod
    def from_env(cls) -> CheckpointConfig:
        gather = os.environ.get("TINSMITH_CATALOG_GATHER_MS", "").strip()
        return cls(
            blob_url=os.environ.get("TINSMITH_BLOB_URL", "file://./blobs"),
            catalog_url=os.environ.get("TINSMITH_CATALOG_URL", ""),
            events_retention=_retention(os.environ.get("TINSMITH_EVENTS_RETENTION", "")),
            catalog_gather_s=(
                _milliseconds("TINSMITH_CATALOG_GATHER_MS", gather) / 1e3
                if gather
                else cls.catalog_gather_s
            ),
        )


def _retention(value: str) -> str:
    value = value.strip() or "keep"
    if value not in ("snapshots", "keep"):
        raise SystemExit(f"TINSMITH_EVENTS_RETENTION={value!r}: use snapshots or keep")
    return value


def _milliseconds(name: str, value: str) -> float:
    try:
        found = float(value)
    except ValueError:
        found = math.nan
    if not math.isfinite(found) or found < 0:
        raise SystemExit(f"{name}={value!r}: give a number of milliseconds, 0 or more")
    return found
