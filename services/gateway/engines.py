"""What the engines are doing, for operators: the reports every trainer and sampler (every
service, in fact) publishes every few seconds (tinsmith/runtime.py: its compute thread's busy
seconds and its gauges), kept for the last minutes, per replica.

Owns: following the reports (core NATS: a lost one is a gap in a chart, nothing more), the
history kept per replica, and the engines part of the ``/api/v1/engines`` JSON: each replica's
busy share between two reports (the duty cycle: ``busy``, points ``[time, share]`` of the
interval since the point before, the first one's since ``busy_since``), its latest gauges (queue
depth, base models and adapters loaded, memory, GPU memory where there is a GPU). Does not own:
what a service reports (``telemetry.status``) or who may see it (operations.py: admins).
"""

from __future__ import annotations

import itertools
import json
import logging
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from tinsmith import subjects
from tinsmith.bus import Bus

log = logging.getLogger(__name__)

HISTORY = 300  # reports kept per replica: ten minutes at one every two seconds
GONE_S = 60.0  # a replica silent this long is no longer shown


@dataclass
class _Replica:
    service: str
    replica: str
    reports: deque[dict[str, Any]] = field(default_factory=lambda: deque(maxlen=HISTORY))


class Engines:
    def __init__(self, bus: Bus) -> None:
        self.bus = bus
        self.replicas: dict[str, _Replica] = {}

    async def start(self) -> None:
        await self.bus.listen(subjects.status_subject("*"), self._on_report)

    async def _on_report(self, data: bytes) -> None:
        try:
            report = json.loads(data)
            service, replica = str(report["service"]), str(report["replica"])
            float(report["time"]), float(report["busy_s"])  # numbers, or it is no report
        except (ValueError, KeyError, TypeError):
            log.warning("a status report that is not one: %r", data[:200])
            return
        held = self.replicas.get(replica)
        if held is None:
            held = self.replicas[replica] = _Replica(service, replica)
        held.reports.append(report)

    def view(self, now: float) -> list[dict[str, Any]]:
        """Each replica heard from in the last ``GONE_S``: its busy share over time and what
        it last reported."""
        out = []
        for key, held in list(self.replicas.items()):
            last = held.reports[-1]
            if now - float(last["time"]) > GONE_S:
                del self.replicas[key]
                continue
            out.append(
                {
                    "service": held.service,
                    "replica": held.replica,
                    "seen_at": last["time"],
                    "busy": busy_shares(list(held.reports)),
                    # Where the first busy point's interval starts: its report before it.
                    "busy_since": float(held.reports[0]["time"]),
                    "gauges": last.get("gauges", {}),
                }
            )
        return sorted(out, key=lambda engine: (engine["service"], engine["replica"]))


def busy_shares(reports: list[dict[str, Any]]) -> list[list[float]]:
    """``[[time, share], ...]``: the share of each interval between two reports that the
    replica's compute thread was busy (0 to 1)."""
    out = []
    for before, after in itertools.pairwise(reports):
        elapsed = float(after["time"]) - float(before["time"])
        if elapsed <= 0:
            continue
        share = (float(after["busy_s"]) - float(before["busy_s"])) / elapsed
        out.append([float(after["time"]), round(min(1.0, max(0.0, share)), 4)])
    return out
