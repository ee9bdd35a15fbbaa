"""``tinsmith runs`` and ``tinsmith run ID``: what the console's run list and run page show, in a
terminal, read from the same REST routes with an API key as any client (the SDK's
``TINKER_BASE_URL`` and ``TINKER_API_KEY``, or ``--url`` and ``--key``).

Owns: fetching those routes and laying their JSON out as text. Does not own: the numbers (the
catalog's, services/checkpoint/progress.py).
"""

from __future__ import annotations

import json
import math
import os
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Sequence
from datetime import datetime
from typing import Any

DEFAULT_URL = "http://127.0.0.1:8000"
_BARS = "▁▂▃▄▅▆▇█"


class Unanswered(Exception):
    """The server refused the call (its ``detail``) or could not be reached."""


def fetch(url: str, key: str, path: str, **params: object) -> Any:
    """GET ``/api/v1<path>`` as the holder of ``key``; its JSON, or ``Unanswered``."""
    query = urllib.parse.urlencode({k: v for k, v in params.items() if v not in (None, "")})
    request = urllib.request.Request(
        f"{url.rstrip('/')}/api/v1{path}" + (f"?{query}" if query else ""),
        headers={"X-API-Key": key},
    )
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            return json.loads(response.read())
    except urllib.error.HTTPError as error:
        try:
            detail = json.loads(error.read()).get("detail", "")
        except ValueError:
            detail = error.reason
        raise Unanswered(f"{error.code}: {detail}") from None
    except OSError as error:
        raise Unanswered(f"{url} did not answer: {error}") from None


def connection(url: str | None, key: str | None) -> tuple[str, str]:
    """The server and key to use: the flags, else the SDK's environment variables."""
    key = key or os.environ.get("TINKER_API_KEY", "")
    if not key:
        raise Unanswered("no API key: pass --key or set TINKER_API_KEY")
    return url or os.environ.get("TINKER_BASE_URL", "") or DEFAULT_URL, key


def sparkline(values: Sequence[float | None], width: int = 24) -> str:
    """Values as a line of block characters, the last ``width`` of them; a gap for a missing or
    non-finite one."""
    values = list(values)[-width:]
    finite = [v for v in values if v is not None and math.isfinite(v)]
    if not finite:
        return " " * len(values)
    low, high = min(finite), max(finite)
    span = high - low or 1.0
    return "".join(
        " "
        if v is None or not math.isfinite(v)
        else _BARS[min(len(_BARS) - 1, int((v - low) / span * len(_BARS)))]
        for v in values
    )


def _number(value: float | None) -> str:
    if value is None:
        return "-"
    return f"{value:.4g}"


def _table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    widths = [max(len(str(cell)) for cell in column) for column in zip(header, *rows, strict=True)]
    lines = [header, *rows]
    return "\n".join(
        "  ".join(str(cell).ljust(width) for cell, width in zip(line, widths, strict=True)).rstrip()
        for line in lines
    )


def runs_text(answer: dict[str, Any]) -> str:
    """The run list: newest first, with its steps, last loss, status and loss sparkline."""
    runs = answer["runs"]
    if not runs:
        return "no runs"
    rows = [
        [
            run["training_run_id"],
            run["base_model"],
            str(run["lora_rank"]),
            str(run["steps"]),
            _number(run["last_loss"]),
            run["status"],
            run["sweep"] or "",
            sparkline(run["sparkline"]),
        ]
        for run in runs
    ]
    header = ["RUN", "BASE MODEL", "RANK", "STEPS", "LAST LOSS", "STATUS", "SWEEP", "LOSS"]
    total = answer["cursor"]["total_count"]
    shown = f"{len(runs)} of {total} runs" if total > len(runs) else f"{total} runs"
    return _table(header, rows) + f"\n{shown}"


def run_text(run: dict[str, Any], metrics: dict[str, Any], requests: dict[str, Any]) -> str:
    """One run: what it is, each metric's latest value and curve, and its latest requests."""
    lines = [
        f"run {run['training_run_id']}",
        f"  base model {run['base_model']}, rank {run['lora_rank']}",
        f"  steps {metrics['steps']}, last request {run['last_request_time']}",
    ]
    curves = metrics["metrics"]
    if curves:
        rows = [
            [name, str(points[-1][0]), _number(points[-1][1]), sparkline([v for _, v in points])]
            for name, points in sorted(curves.items())
        ]
        lines += ["", _table(["METRIC", "STEP", "LAST", "BY STEP"], rows)]
    if requests["requests"]:
        rows = [
            [
                datetime.fromtimestamp(r["accepted_at"]).strftime("%H:%M:%S"),
                r["op"],
                "" if r["step"] is None else str(r["step"]),
                r["status"],
                _seconds(r["queue_s"]),
                _seconds(r["compute_s"]),
                _seconds(r["store_s"]),
            ]
            for r in requests["requests"]
        ]
        header = ["ACCEPTED", "REQUEST", "STEP", "STATUS", "QUEUE", "COMPUTE", "STORE"]
        lines += ["", _table(header, rows)]
    return "\n".join(lines)


def _seconds(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f}s"


def top_text(answer: dict[str, Any]) -> str:
    """The engines: each replica's busy share (the last report's interval, and the last
    minute's mean), queue, what it holds and its memory; then each tenant's usage."""
    rows = []
    for engine in answer["engines"]:
        busy = [share for _, share in engine["busy"]]
        gauges = engine["gauges"]
        rows.append(
            [
                engine["service"],
                engine["replica"],
                _percent(busy[-1] if busy else None),
                _percent(sum(busy[-30:]) / len(busy[-30:]) if busy else None),
                _total(gauges.get("tinsmith.queue.depth")),
                _total(gauges.get("tinsmith.base_models.loaded")),
                _total(gauges.get("tinsmith.adapters.loaded")),
                _mib(gauges.get("process.memory.usage")),
                sparkline(busy, width=30),
            ]
        )
    header = ["SERVICE", "REPLICA", "BUSY", "BUSY 1M", "QUEUE", "MODELS", "ADAPTERS", "MEMORY", ""]
    lines = [_table(header, rows) if rows else "no engine has reported yet"]
    tenants = answer["tenants"]
    if tenants:
        rows = [
            [
                name,
                str(usage["sessions"]),
                str(usage["runs"]),
                str(usage["inflight"]),
                str(usage["queued_samples"]),
                _mib(usage["checkpoint_bytes"]),
            ]
            for name, usage in tenants.items()
        ]
        header = ["TENANT", "SESSIONS", "RUNS", "IN FLIGHT", "QUEUED SAMPLES", "CHECKPOINTS"]
        lines += ["", _table(header, rows)]
    return "\n".join(lines)


def _percent(share: float | None) -> str:
    return "-" if share is None else f"{share * 100:.0f}%"


def _total(gauge: float | dict[str, float] | None) -> str:
    if gauge is None:
        return "-"
    value = sum(gauge.values()) if isinstance(gauge, dict) else gauge
    return f"{value:g}"


def _mib(value: float | dict[str, float] | None) -> str:
    if value is None or isinstance(value, dict):
        return "-"
    return f"{value / 2**20:.0f} MiB"


def show_top(url: str, key: str) -> str:
    return top_text(fetch(url, key, "/engines"))


def show_runs(url: str, key: str, *, tag: str = "", sweep: str = "", limit: int = 50) -> str:
    return runs_text(fetch(url, key, "/console/runs", tag=tag, sweep=sweep, limit=limit))


def show_run(url: str, key: str, run_id: str, *, requests: int = 20) -> str:
    quoted = urllib.parse.quote(run_id, safe=":")
    return run_text(
        fetch(url, key, f"/training_runs/{quoted}"),
        fetch(url, key, f"/training_runs/{quoted}/metrics"),
        fetch(url, key, f"/training_runs/{quoted}/requests", limit=requests),
    )
