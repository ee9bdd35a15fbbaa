"""How runs are going, from the catalog: the metrics of each run by step, its requests' timeline,
the metrics a client adds, the console's list of runs, a sweep's runs side by side, and a
session's trace for Perfetto.

Owns: the JSON of those reads (the console and ``tinsmith runs``/``run`` show it as it is),
turning a client's metrics into an event, and building and storing a session's trace. Does not
own: who may read what (access.py: a run's progress is its tenant's alone, published or not),
the tables (tinsmith/catalog.py) or the other catalog answers (handlers.py).
"""

from __future__ import annotations

import json
import math
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from sqlalchemy import select
from sqlalchemy.ext.asyncio import AsyncSession

from tinsmith import artifacts, catalog, events
from tinsmith._proto import bus_pb2 as bus
from tinsmith.blobs import BlobStore
from tinsmith.eventlog import EventLog
from tinsmith.failures import InvalidRequest
from tinsmith.limits import INT32_MAX

from . import access
from .projection import SqlProjection

JsonDict = dict[str, Any]

LOSS = "loss:sum"
# The points of a run's sparkline in the console's list: its last steps' losses.
SPARKLINE_STEPS = 60
# What a client may report at once, and how it may name a metric.
MAX_REPORTED = 100
MAX_NAME = 200
# The file of a session's trace, in its artifact (artifacts.trace_key).
TRACE_FILE = "trace.json"


class Progress:
    def __init__(
        self, eventlog: EventLog, projection: SqlProjection, blobs: BlobStore, *, url_ttl_s: int
    ) -> None:
        self.log = eventlog
        self.projection = projection
        self.blobs = blobs
        self.url_ttl_s = url_ttl_s

    # -- one run -------------------------------------------------------------------------------

    async def run_metrics(self, query: bus.CatalogQuery) -> JsonDict:
        """Every metric of a run by step: ``{"metrics": {name: [[step, value], ...]}}``, value
        null where it was not a finite number, and the run as the console lists it."""
        await self.projection.catch_up()
        async with self.projection.session() as session:
            run = await access.find_own_run(session, query, query.training_run_id)
            found = await catalog.series(session, [run.model_id])
            finished = await _finished_sessions(session, {run.session_id})
        return {
            "training_run_id": run.model_id,
            "steps": run.steps,
            "run": _summary(run, finished),
            "metrics": {
                name: [list(point) for point in points]
                for name, points in found[run.model_id].items()
            },
        }

    async def run_requests(self, query: bus.CatalogQuery) -> JsonDict:
        """A run's requests, newest first: when each was accepted, how long it waited, computed
        and took to store, its step, status and metrics."""
        limit, offset = access.page(query, default_limit=100)
        await self.projection.catch_up()
        async with self.projection.session() as session:
            run = await access.find_own_run(session, query, query.training_run_id)
            rows, total = await catalog.run_requests(
                session, run.model_id, limit=limit, offset=offset
            )
        return {
            "requests": [_request(row) for row in rows],
            "cursor": {"offset": offset, "limit": limit, "total_count": total},
        }

    async def report_metrics(self, query: bus.CatalogQuery) -> JsonDict:
        """Keep a client's scalars for its run at a step (the run's current one when none is
        given), beside the trainer's."""
        metrics = _reported(query.metrics)
        await self.projection.catch_up()
        async with self.projection.session() as session:
            run = await access.find_own_run(session, query, query.training_run_id)
        step = query.step if query.HasField("step") else run.steps
        if not 0 <= step <= INT32_MAX:
            raise InvalidRequest(f"step must be between 0 and {INT32_MAX}, got {step}")
        reported = bus.MetricsReported(model_id=run.model_id, step=step, metrics=metrics)
        seq, _ = await self.log.append(events.make(metrics_reported=reported))
        await self.projection.wait_for(seq)
        return {"training_run_id": run.model_id, "step": step}

    # -- many runs -----------------------------------------------------------------------------

    async def console_runs(self, query: bus.CatalogQuery) -> JsonDict:
        """The caller's runs, newest first (of a tag's sessions, of a sweep), each with its
        steps, last loss, status and a sparkline of its loss."""
        limit, offset = access.page(query, default_limit=50)
        await self.projection.catch_up()
        async with self.projection.session() as session:
            rows, total = await catalog.console_runs(
                session,
                owner=query.owner,
                tag=query.tag,
                sweep=query.sweep,
                limit=limit,
                offset=offset,
            )
            found = await catalog.series(
                session, [row.model_id for row in rows], [LOSS, "learning_rate:mean"]
            )
            finished = await _finished_sessions(session, {row.session_id for row in rows})
        runs = []
        for row in rows:
            loss = found[row.model_id].get(LOSS, [])
            runs.append(
                {
                    **_summary(row, finished),
                    "last_loss": loss[-1][1] if loss else None,
                    "learning_rate": _last(found[row.model_id].get("learning_rate:mean", [])),
                    "sparkline": [value for _, value in loss[-SPARKLINE_STEPS:]],
                }
            )
        return {"runs": runs, "cursor": {"offset": offset, "limit": limit, "total_count": total}}

    async def sweep(self, query: bus.CatalogQuery) -> JsonDict:
        """A sweep's runs side by side: each one's configuration and its curve of ``metric``,
        the configuration keys whose values differ between them, and the best value so far."""
        if not query.sweep:
            raise InvalidRequest("name the sweep: its runs carry it as user_metadata 'sweep'")
        metric = query.metric or LOSS
        goal = query.goal or ("min" if "loss" in metric else "max")
        if goal not in ("min", "max"):
            raise InvalidRequest(f"goal {goal!r} is not accepted: use 'min' or 'max'")
        await self.projection.catch_up()
        async with self.projection.session() as session:
            rows, _ = await catalog.console_runs(
                session, owner=query.owner, tag="", sweep=query.sweep, limit=1000, offset=0
            )
            found = await catalog.series(
                session, [row.model_id for row in rows], [metric, "learning_rate:mean"]
            )
            finished = await _finished_sessions(session, {row.session_id for row in rows})
        pick = min if goal == "min" else max
        runs = []
        for row in reversed(rows):  # oldest first: the order they were launched in
            curve = found[row.model_id].get(metric, [])
            values = [(step, value) for step, value in curve if value is not None]
            best = pick(values, key=lambda point: point[1]) if values else None
            config = _config(row, _last(found[row.model_id].get("learning_rate:mean", [])))
            runs.append(
                {
                    **_summary(row, finished),
                    "config": config,
                    "series": [list(point) for point in curve],
                    "best": {"step": best[0], "value": best[1]} if best else None,
                }
            )
        keys = sorted({key for run in runs for key in run["config"]})
        differs = [
            key for key in keys if len({json.dumps(run["config"].get(key)) for run in runs}) > 1
        ]
        bests = [(run["best"]["value"], run) for run in runs if run["best"] is not None]
        leader = pick(bests, key=lambda pair: pair[0])[1] if bests else None
        return {
            "sweep": query.sweep,
            "metric": metric,
            "goal": goal,
            "runs": runs,
            "differs": differs,
            "best": {"training_run_id": leader["training_run_id"], **leader["best"]}
            if leader
            else None,
        }

    # -- traces --------------------------------------------------------------------------------

    async def trace_export(self, query: bus.CatalogQuery) -> JsonDict:
        """A session's requests as a Chrome trace-event file (Perfetto opens it), stored beside
        its checkpoints, and a URL that downloads it: ``export_session_trace``'s answer."""
        await self.projection.catch_up()
        async with self.projection.session() as session:
            row = await access.find_session(session, query, query.session_id)
            requests = await catalog.session_requests(session, row.session_id)
        trace = chrome_trace(row.session_id, requests)
        key = artifacts.trace_key(row.session_id)
        with tempfile.TemporaryDirectory(prefix="tinsmith-trace-") as tmp:
            (Path(tmp) / TRACE_FILE).write_text(json.dumps(trace))
            await self.blobs.put_dir(key, Path(tmp))
        if self.blobs.presigns:
            url = self.blobs.presigned_url(key, TRACE_FILE, self.url_ttl_s)
        else:
            if not query.base_url:
                raise InvalidRequest("a trace's download URL needs the gateway's base URL")
            expires = int(time.time()) + self.url_ttl_s
            signed = self.blobs.signed_query(key, TRACE_FILE, expires=expires, tenant=query.owner)
            url = f"{query.base_url}/api/v1/blobs/{signed}"
        return {"status": "ready", "url": url}


def chrome_trace(session_id: str, requests: Sequence[catalog.RequestRow]) -> JsonDict:
    """The trace-event JSON of a session's requests: a process per run and sampler, a request
    per slice (on the first lane free when it was accepted), split into its queue wait, its
    compute and the storing of its outcome. Times are microseconds from the first request."""
    origin = min((row.accepted_at for row in requests), default=0.0)
    out: list[JsonDict] = []
    pids: dict[str, int] = {}
    lanes: dict[str, list[float]] = {}  # each aggregate's lanes: when each one is free again

    def us(at: float) -> float:
        return round((at - origin) * 1e6, 1)

    for row in requests:
        pid = pids.get(row.aggregate_id)
        if pid is None:
            pid = pids[row.aggregate_id] = len(pids) + 1
            kind = "sampler" if row.op == "sample" else "run"
            out.append(_meta("process_name", pid, 0, f"{kind} {row.aggregate_id}"))
            lanes[row.aggregate_id] = []
        end = row.finished_at if row.finished_at is not None else row.accepted_at
        free = lanes[row.aggregate_id]
        lane = next((i for i, at in enumerate(free) if at <= row.accepted_at), len(free))
        if lane == len(free):
            free.append(end)
            out.append(_meta("thread_name", pid, lane + 1, f"lane {lane + 1}"))
        free[lane] = end
        args = {
            "request_id": row.request_id,
            "status": row.status,
            "step": row.step,
            **({"error": f"{row.error_kind}: {row.error_detail}"} if row.error_kind else {}),
            **row.metrics,
        }
        out.append(_slice(row.op, "request", us(row.accepted_at), us(end), pid, lane + 1, args))
        for name, start, stop in _phases(row):
            out.append(_slice(name, name, us(start), us(stop), pid, lane + 1, {}))
    return {
        "traceEvents": out,
        "displayTimeUnit": "ms",
        "otherData": {"session_id": session_id, "origin_unix_s": origin},
    }


def _phases(row: catalog.RequestRow) -> list[tuple[str, float, float]]:
    """A settled request's queue wait (acceptance to the start of its work), compute, and the
    storing of its outcome (to when that was recorded)."""
    if row.finished_at is None or row.started_at is None:
        return []
    computed = row.started_at + (row.compute_s or 0.0)
    phases = [("queue", row.accepted_at, row.started_at), ("compute", row.started_at, computed)]
    if row.status == "completed":
        phases.append(("store", computed, max(computed, row.finished_at)))
    return [(name, start, stop) for name, start, stop in phases if stop >= start]


def _slice(
    name: str, category: str, start: float, stop: float, pid: int, tid: int, args: JsonDict
) -> JsonDict:
    return {
        "name": name,
        "cat": category,
        "ph": "X",
        "ts": start,
        "dur": max(0.0, round(stop - start, 1)),
        "pid": pid,
        "tid": tid,
        "args": args,
    }


def _meta(name: str, pid: int, tid: int, label: str) -> JsonDict:
    return {"name": name, "ph": "M", "pid": pid, "tid": tid, "args": {"name": label}}


def _request(row: catalog.RequestRow) -> JsonDict:
    started = row.started_at
    computed = started + (row.compute_s or 0.0) if started is not None else None
    return {
        "request_id": row.request_id,
        "op": row.op,
        "status": row.status,
        "step": row.step,
        "accepted_at": row.accepted_at,
        "queue_s": started - row.accepted_at if started is not None else None,
        "compute_s": row.compute_s,
        "store_s": row.finished_at - computed
        if row.finished_at is not None and computed is not None and row.status == "completed"
        else None,
        "finished_at": row.finished_at,
        "error": f"{row.error_kind}: {row.error_detail}" if row.error_kind else None,
        "metrics": row.metrics,
    }


def _summary(row: catalog.RunRow, finished: set[str]) -> JsonDict:
    if row.pending:
        status = "training"
    elif row.session_id in finished:
        status = "finished"
    else:
        status = "idle"
    return {
        "training_run_id": row.model_id,
        "session_id": row.session_id,
        "base_model": row.base_model,
        "lora_rank": row.lora_rank,
        "loss_fn": row.loss_fn or None,
        "steps": row.steps,
        "status": status,
        "created_at": access.iso(row.created_at),
        "last_request_time": access.iso(row.last_request_time),
        "sweep": row.sweep or None,
        "tags": catalog.tags_of(row),
        "user_metadata": dict(row.user_metadata),
    }


def _config(row: catalog.RunRow, learning_rate: float | None) -> JsonDict:
    """What a sweep compares its runs by: the run's setup, the learning rate it last stepped
    with, and what its creator noted in its user_metadata (a reward variant, say)."""
    noted = {key: value for key, value in row.user_metadata.items() if key != "sweep"}
    return {
        "base_model": row.base_model,
        "lora_rank": row.lora_rank,
        "loss_fn": row.loss_fn or None,
        "train_mlp": row.train_mlp,
        "train_attn": row.train_attn,
        "train_unembed": row.train_unembed,
        "learning_rate": learning_rate,
        **noted,
    }


def _last(points: list[tuple[int, float | None]]) -> float | None:
    return points[-1][1] if points else None


async def _finished_sessions(session: AsyncSession, session_ids: set[str]) -> set[str]:
    if not session_ids:
        return set()
    rows = await session.scalars(
        select(catalog.SessionRow.session_id).where(
            catalog.SessionRow.session_id.in_(sorted(session_ids)),
            catalog.SessionRow.finished.is_(True),
        )
    )
    return set(rows.all())


def _reported(metrics: Any) -> dict[str, float]:
    """A client's metrics, checked: 1 to ``MAX_REPORTED`` finite numbers, each named by 1 to
    ``MAX_NAME`` printable characters."""
    if not metrics:
        raise InvalidRequest("'metrics' must name at least one metric: {\"reward\": 0.5}")
    if len(metrics) > MAX_REPORTED:
        raise InvalidRequest(f"at most {MAX_REPORTED} metrics at once, got {len(metrics)}")
    out = {}
    for name, value in metrics.items():
        if not 1 <= len(name) <= MAX_NAME or not name.isprintable():
            raise InvalidRequest(
                f"metric name {name[:60]!r} is not accepted: use 1 to {MAX_NAME} printable "
                "characters"
            )
        if not math.isfinite(value):
            raise InvalidRequest(f"metric {name!r} is {value}: report finite numbers")
        out[name] = float(value)
    return out
