"""A tinker-cookbook recipe run as its user runs it, and what the server recorded of it.

The recipe tests share this: ``run_recipe`` starts ``python -m <recipe>`` from the cookbook's own
virtual environment with a user's environment (tests/cookbook_env.py), waits for it, and gathers
the recipe's own records (``metrics.jsonl``, ``checkpoints.jsonl``) and the server's: every request
the gateway accepted, read back from the event log, with its outcome, its stored result, and where
in the log it was accepted and finished. The tests then compare the two.
"""

from __future__ import annotations

import asyncio
import json
import re
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tests.conftest import RunningSystem
from tests.cookbook_env import user_environment
from tinsmith import events, subjects
from tinsmith.bus import Bus
from tinsmith.eventlog import EventLog

RUN_TIMEOUT_S = 300


@dataclass
class Request:
    """One accepted request, with its outcome."""

    position: int  # of its RequestAccepted in the event log
    aggregate_id: str
    seq_id: int
    command: str
    body: Any  # the command message
    outcome: str = "pending"  # completed, failed
    result: bytes = b""
    detail: str = ""
    done_position: int = 0  # of its RequestCompleted or RequestFailed; 0 while pending


@dataclass
class ServerLog:
    requests: list[Request] = field(default_factory=list)  # in the order they were accepted
    samplers: dict[str, str] = field(default_factory=dict)  # sampler_id -> adapter key

    def of(self, command: str, aggregate_id: str | None = None) -> list[Request]:
        return [
            r
            for r in self.requests
            if r.command == command and (aggregate_id is None or r.aggregate_id == aggregate_id)
        ]

    def failures(self) -> list[str]:
        return [
            f"{r.command} {r.aggregate_id}:{r.seq_id}: {r.detail}"
            for r in self.requests
            if r.outcome == "failed"
        ]


@dataclass
class RecipeRun:
    system: RunningSystem
    returncode: int
    output: str
    seconds: float  # the recipe's wall time, from start to exit
    metrics: list[dict[str, Any]]  # rows of its metrics.jsonl
    checkpoints: list[dict[str, Any]]  # rows of its checkpoints.jsonl
    server: ServerLog

    def training_run(self) -> str:
        """The model id of the one training run the recipe created."""
        created = self.server.of("create_model")
        assert len(created) == 1, created
        return created[0].aggregate_id

    def failure(self) -> str:
        """What to print when the run is not what a test expects."""
        return (
            f"the recipe exited {self.returncode}:\n{self.output[-8000:]}\n\n"
            f"failed requests: {self.server.failures()}\n\nserver logs:\n{self.system.logs()}"
        )


def _jsonl(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def run_recipe(
    python: Path,
    system: RunningSystem,
    module: str,
    arguments: list[str],
    work: Path,
    api_key: str,
    environment: dict[str, str] | None = None,
) -> RecipeRun:
    """Run ``python -m module arguments...`` in ``work``, logging to a new ``work/log``, and read
    back what both sides recorded."""
    log_path = work / "log"
    started = time.monotonic()
    result = subprocess.run(
        [
            str(python),
            "-m",
            module,
            *arguments,
            f"log_path={log_path}",
            "behavior_if_log_dir_exists=raise",
        ],
        cwd=work,
        env=user_environment(work, api_key) | (environment or {}),
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        timeout=RUN_TIMEOUT_S,
    )
    return RecipeRun(
        system=system,
        returncode=result.returncode,
        output=result.stdout,
        seconds=time.monotonic() - started,
        metrics=_jsonl(log_path / "metrics.jsonl"),
        checkpoints=_jsonl(log_path / "checkpoints.jsonl"),
        server=read_server_log(system),
    )


def read_server_log(system: RunningSystem) -> ServerLog:
    """Every request the system accepted so far, from its event log, with outcomes and results."""
    return asyncio.run(_read_server_log(system))


async def _read_server_log(system: RunningSystem) -> ServerLog:
    match = re.search(r"listen: (\S+)", (system.data_dir / "nats-server.conf").read_text())
    assert match
    bus = await Bus.connect(f"nats://{match.group(1)}", name="test-reader")
    log = EventLog(bus)
    server = ServerLog()
    by_id: dict[str, Request] = {}
    try:
        for seq in range(1, await bus.last_seq(subjects.EVENTS_STREAM) + 1):
            event = events.decode(await bus.get(subjects.EVENTS_STREAM, seq))
            kind = events.kind_of(event)
            if kind == "request_accepted":
                accepted = event.request_accepted
                command = events.command_of(accepted)
                request = Request(
                    seq, accepted.aggregate_id, accepted.seq_id, command, getattr(accepted, command)
                )
                by_id[accepted.request_id] = request
                server.requests.append(request)
            elif kind == "request_completed":
                done = by_id[event.request_completed.request_id]
                done.outcome, done.done_position = "completed", seq
                done.result, _ = await log.get_result(event.request_completed.result_seq)
            elif kind == "request_failed":
                failed = by_id[event.request_failed.request_id]
                failed.outcome, failed.done_position = "failed", seq
                failed.detail = f"{event.request_failed.kind}: {event.request_failed.detail}"
            elif kind == "sampler_created":
                created = event.sampler_created
                server.samplers[created.sampler_id] = created.adapter_key
        return server
    finally:
        await bus.close()
