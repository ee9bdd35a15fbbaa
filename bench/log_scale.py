"""The log at scale: how long each service takes to become ready, and the memory it peaks at,
with 1k, 10k and 100k requests in the event log: started from the log alone (a full replay,
what every start did before the projection snapshots) and from the snapshots the services keep
(tinsmith/snapshots.py), side by side on the same logs.

For each size it builds a log as RL jobs write it (``History``: sessions of three tenants, each
with a run that does forward_backward, optim_step, a save for sampling and four sample requests
per step, with training checkpoints, TTLs, publications, deletions, unloads, rejections, failures
and cancellations along the way; about 2.2 events and 1.3 KB per request) on a private
nats-server, with a result in the results stream for every completion, all but the newest
2,000 of them expired (the results stream's max age passed: a log of long history). Then it
starts the gateway, the trainer (on the CPU, no base model loaded) and the checkpoint service (a
new SQLite catalog each time) as processes (``python -m services.<name>``), one at a time:

- ``replay``: no snapshot kept, each replays the whole log;
- ``snapshot``: after the gateway and the checkpoint service have written their snapshots, each
  starts from them (the trainer from the newest of the gateway's and its own, none here).

Ready is the process's first answer to ``tinsmith.ping.<name>``, timed from its spawn (the
trainer's includes importing torch); peak memory is its VmHWM then.

    .venv/bin/python -m bench.log_scale [--sizes 1000,10000,100000] [--before REV]

``--before REV`` also starts the services of git revision REV (a worktree of it, same
environment) on each log, with a limit of ``--limit`` seconds. Building the 100k log takes a
minute or two on 2 cores; the whole run with the default sizes, about five minutes.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import nats
from nats.errors import NoRespondersError
from nats.errors import TimeoutError as NatsTimeout
from nats.js.errors import NotFoundError

from tinsmith import artifacts, events, snapshots, subjects
from tinsmith._proto import bus_pb2 as bus
from tinsmith._proto import tinker_public_pb2 as tp
from tinsmith.bus import MAX_PAYLOAD, Bus
from tinsmith.embedded import free_port, nats_server_binary
from tinsmith.eventlog import EventLog

SERVICES = ("gateway", "trainer", "checkpoint")
ROOT = Path(__file__).resolve().parent.parent

BASE = "tinsmith/tiny"
DAY = 86400
WEEK = 7 * DAY
TENANTS = ("alice", "bob", "carol")
SAMPLES_PER_STEP = 4
RECENT_RESULTS = 2000  # results still in the results stream; older ones expired


@dataclass
class _Job:
    session_id: str
    owner: str
    model_id: str
    steps: int
    seq_id: int = 0
    step: int = 0
    samplers: int = 0
    checkpoints: list[str] = field(default_factory=list)


class History:
    """A realistic event log, event by event; ``result_seq`` numbers results in the order the
    completions come (the bench stores one result per completion, in that order)."""

    def __init__(self, requests: int, seed: int = 0, start: float = 1.7e9) -> None:
        self.budget = requests
        self.random = random.Random(seed)
        # The metrics' values, drawn apart: the history's own draws stay what they were.
        self.values = random.Random(seed + 1)
        self.time = start
        self.results = 0
        self.requests = 0
        self.sessions = 0

    def __iter__(self) -> Iterator[bus.Event]:
        for n, tenant in enumerate(TENANTS):
            issued = bus.KeyIssued(
                key_id=f"k{n:015d}", tenant=tenant, salt=b"s" * 16, digest=b"d" * 32
            )
            yield self._event(key_issued=issued)
        jobs: list[_Job] = []
        while self.requests < self.budget or jobs:
            while len(jobs) < 3 and self.requests < self.budget:
                jobs.append(self._new_job())
                yield from self._create(jobs[-1])
            job = jobs[self.random.randrange(len(jobs))]
            if job.step >= job.steps or self.requests >= self.budget:
                jobs.remove(job)
                if self.requests < self.budget:
                    yield self._event(
                        session_finished=bus.SessionFinished(session_id=job.session_id)
                    )
                continue
            yield from self._step(job)
        yield self._event(key_revoked=bus.KeyRevoked(key_id="k000000000000001"))

    def _event(self, **body: object) -> bus.Event:
        self.time += self.random.uniform(0.001, 0.05)
        event = events.make(**body)
        event.time = self.time
        return event

    def _new_job(self) -> _Job:
        self.sessions += 1
        session_id = f"{self.sessions:08x}-0000-4000-8000-{self.random.getrandbits(48):012x}"
        return _Job(
            session_id=session_id,
            owner=self.random.choice(TENANTS),
            model_id=f"{session_id}:train:0",
            steps=self.random.randint(100, 300),
        )

    def _create(self, job: _Job) -> Iterator[bus.Event]:
        created = bus.SessionCreated(
            session_id=job.session_id,
            owner=job.owner,
            tags=["rl", "bench"],
            user_metadata={"experiment": f"e{self.sessions}"},
            project_id="p1",
            sdk_version="0.38.0",
        )
        yield self._event(session_created=created)
        create = bus.CreateModel(
            session_id=job.session_id,
            base_model=BASE,
            lora=bus.LoraConfig(rank=8, train_mlp=True, train_attn=True),
            optimizer="adamw",
        )
        yield from self._request(job.model_id, 0, create_model=create)
        yield self._event(run_created=bus.RunCreated(model_id=job.model_id, tokenizer_id=BASE))
        yield self._done(job.model_id, 0)

    def _request(self, aggregate: str, seq_id: int, **command: object) -> Iterator[bus.Event]:
        self.requests += 1
        accepted = bus.RequestAccepted(
            request_id=events.request_id(aggregate, seq_id),
            aggregate_id=aggregate,
            seq_id=seq_id,
            **command,  # type: ignore[arg-type]
        )
        yield self._event(request_accepted=accepted)

    def _done(
        self,
        aggregate: str,
        seq_id: int,
        media: str = "application/json",
        metrics: dict[str, float] | None = None,
    ) -> bus.Event:
        """A completion, with the metrics its worker records (the catalog folds them per step)."""
        self.results += 1
        completed = bus.RequestCompleted(
            metrics=metrics or {},
            request_id=events.request_id(aggregate, seq_id),
            aggregate_id=aggregate,
            result_seq=self.results,
            media_type=media,
            compute_seconds=self.random.uniform(0.01, 0.5),
            replica="trainer@bench:1",
        )
        return self._event(request_completed=completed)

    def _step(self, job: _Job) -> Iterator[bus.Event]:
        rng = self.random
        run = job.model_id
        job.step += 1
        job.seq_id += 1
        datums = [_datum(rng) for _ in range(4)]
        fb = tp.ForwardBackwardRequest(model_id=run, seq_id=job.seq_id, data=datums, loss_fn="ppo")
        yield from self._request(run, job.seq_id, forward_backward=fb)
        value = self.values
        loss = {"loss:sum": value.uniform(1, 100), "ppo/clip_fraction:mean": value.random()}
        counts = {"tokens:sum": 4.0 * 64, "datums:sum": 4.0}
        yield self._done(run, job.seq_id, "application/x-protobuf", {**loss, **counts})
        if rng.random() < 0.01:  # a request refused after its seq_id was spent
            job.seq_id += 1
            rejected = bus.RequestRejected(
                aggregate_id=run, seq_id=job.seq_id, kind="invalid_request", detail="bad tokens"
            )
            yield self._event(request_rejected=rejected)
        job.seq_id += 1
        adam = bus.AdamParams(learning_rate=1e-4, beta1=0.9, beta2=0.95, eps=1e-8)
        yield from self._request(run, job.seq_id, optim_step=bus.OptimStep(adam=adam))
        optim = {"grad_norm:mean": value.uniform(0.1, 10), "learning_rate:mean": 1e-4}
        yield self._done(run, job.seq_id, metrics=optim)
        if job.step % 25 == 0:
            yield from self._checkpoint(job)
        job.seq_id += 1
        job.samplers += 1
        sampler_id = f"{job.session_id}:sample:{job.samplers}"
        key = artifacts.ephemeral_sampler_key(run, sampler_id)
        save = bus.SaveWeights(kind=bus.CHECKPOINT_KIND_SAMPLER, sampler_id=sampler_id)
        yield from self._request(run, job.seq_id, save_weights=save)
        created = bus.SamplerCreated(
            sampler_id=sampler_id, session_id=job.session_id, base_model=BASE, adapter_key=key
        )
        yield self._event(sampler_created=created)
        yield self._done(run, job.seq_id)
        for n in range(SAMPLES_PER_STEP):
            prompt = [rng.randrange(1, 250) for _ in range(48)]
            sample = bus.Sample(
                base_model=BASE,
                adapter_key=key,
                prompt=prompt,
                params=tp.SamplingParams(max_tokens=64, temperature=1.0, seed=n),
                num_samples=4,
            )
            yield from self._request(sampler_id, n, sample=sample)
            draw = rng.random()
            rid = events.request_id(sampler_id, n)
            if draw < 0.01:
                failed = bus.RequestFailed(
                    request_id=rid, aggregate_id=sampler_id, kind="unprocessable", detail="NaN"
                )
                yield self._event(request_failed=failed)
            elif draw < 0.02:
                cancelled = bus.RequestCancelled(
                    request_id=rid, aggregate_id=sampler_id, detail="the caller went away"
                )
                yield self._event(request_cancelled=cancelled)
            else:
                drawn = {"sample/prompt_tokens:sum": 48.0, "sample/sampled_tokens:sum": 256.0}
                drawn["sample/sequences:sum"] = 4.0
                yield self._done(sampler_id, n, "application/x-protobuf", drawn)
        if job.step % 100 == 0:  # the session fell silent for a while: unloaded, then back
            snapshot = artifacts.snapshot_key(run, job.seq_id + 1)
            create = bus.CreateModel(session_id=job.session_id, base_model=BASE)
            unloaded = bus.RunUnloaded(
                model_id=run, snapshot_key=snapshot, next_seq_id=job.seq_id + 1, create=create
            )
            yield self._event(run_unloaded=unloaded)
            yield self._event(run_restored=bus.RunRestored(model_id=run, snapshot_key=snapshot))

    def _checkpoint(self, job: _Job) -> Iterator[bus.Event]:
        rng = self.random
        run = job.model_id
        job.seq_id += 1
        name = f"step-{job.step:05d}"
        path = artifacts.checkpoint(run, f"weights/{name}")
        save = bus.SaveWeights(kind=bus.CHECKPOINT_KIND_TRAINING, name=name)
        yield from self._request(run, job.seq_id, save_weights=save)
        saved = bus.WeightsSaved(
            model_id=run,
            tinker_path=str(path),
            blob_key=path.key,
            kind=bus.CHECKPOINT_KIND_TRAINING,
            base_model=BASE,
            lora_rank=8,
            size_bytes=rng.randrange(1_000_000, 3_000_000),
            lora=bus.LoraConfig(rank=8, train_mlp=True, train_attn=True),
        )
        yield self._event(weights_saved=saved)
        yield self._done(run, job.seq_id)
        job.checkpoints.append(str(path))
        if rng.random() < 0.3:
            ttl = bus.CheckpointTtlSet(
                model_id=run, tinker_path=str(path), ttl_seconds=WEEK, expires_at=self.time + WEEK
            )
            yield self._event(checkpoint_ttl_set=ttl)
        if rng.random() < 0.2:
            published = bus.CheckpointPublished(model_id=run, tinker_path=str(path), public=True)
            yield self._event(checkpoint_published=published)
        if len(job.checkpoints) > 3:  # the oldest goes
            gone = artifacts.parse(job.checkpoints.pop(0))
            deleted = bus.CheckpointDeleted(
                model_id=run, tinker_path=str(gone), blob_key=gone.key, reason="deleted"
            )
            yield self._event(checkpoint_deleted=deleted)


def _datum(rng: random.Random) -> tp.Datum:
    tokens = [rng.randrange(1, 250) for _ in range(192)]
    raw = b"".join(t.to_bytes(4, "little") for t in tokens)
    floats = b"".join(rng.randrange(0, 2**30).to_bytes(4, "little") for _ in tokens)
    chunk = tp.Chunk(encoded_text=tp.EncodedTextChunk(tokens=raw))
    shape = [len(tokens)]
    return tp.Datum(
        model_input=[chunk],
        loss_fn_inputs={
            "target_tokens": tp.Tensor(dense=raw, dtype=tp.DTYPE_INT32, shape=shape),
            "logprobs": tp.Tensor(dense=floats, dtype=tp.DTYPE_FLOAT32, shape=shape),
            "advantages": tp.Tensor(dense=floats, dtype=tp.DTYPE_FLOAT32, shape=shape),
        },
    )


# -- the benchmark -----------------------------------------------------------------------------


@dataclass
class Start:
    seconds: float | None  # None: not ready within the limit
    peak_mib: float


async def build(url: str, requests: int) -> tuple[int, float]:
    """Write a log of ``requests`` requests and its results; return its events and MB."""
    connection = await Bus.connect(url, name="bench-log-scale")
    await connection.ensure_streams(results_max_age_s=DAY)
    eventlog = EventLog(connection)
    # A long history: it ends over a day ago (the results stream's max age), as the purge of all
    # but the newest results below has it; its checkpoints' TTLs (a week) have not passed.
    history = History(requests, start=time.time() - DAY - 3600 - 0.03 * 2.2 * requests)
    pending = []
    for event in history:
        pending.append(eventlog.append(event))
        if len(pending) == 500:
            await asyncio.gather(*pending)
            pending = []
    await asyncio.gather(*pending)
    for start in range(0, history.results, 500):
        await asyncio.gather(
            *(
                connection.js.publish(subjects.result_subject(f"bench:{n}"), b"j{}")
                for n in range(start, min(history.results, start + 500))
            )
        )
    expired = history.results - RECENT_RESULTS
    if expired > 0:
        await connection.js.purge_stream(subjects.RESULTS_STREAM, seq=expired + 1)
    info = await connection.js.stream_info(subjects.EVENTS_STREAM)
    await connection.close()
    return int(info.state.messages), int(info.state.bytes) / 1e6


def _environment(url: str, work: Path, *, write: bool) -> dict[str, str]:
    env = {
        **os.environ,
        "TINSMITH_NATS_URL": url,
        "TINSMITH_BLOB_URL": f"file://{work / 'blobs'}",
        "TINSMITH_HOST": "127.0.0.1",
        "TINSMITH_DEVICE": "cpu",
        "TINSMITH_BASE_MODELS": "",
        "TINSMITH_EVENTS_RETENTION": "keep",  # the same log for every start
        "TINSMITH_LOG_FORMAT": "text",
        "HF_HUB_OFFLINE": "1",
    }
    # Written at once after the start (write), or not while a start is measured.
    env["TINSMITH_PROJECTION_SNAPSHOT_EVENTS"] = "1" if write else str(10**9)
    env["TINSMITH_PROJECTION_SNAPSHOT_S"] = str(10**6)
    return env


def _spawn(name: str, env: dict[str, str], work: Path, code: Path) -> subprocess.Popen[bytes]:
    env = {
        **env,
        "TINSMITH_PORT": str(free_port()),
        "TINSMITH_GRPC_PORT": str(free_port()),
        "TINSMITH_CATALOG_URL": f"sqlite+aiosqlite:///{work / f'catalog-{time.time_ns()}.db'}",
        "TINSMITH_REPLICA": f"bench-{name}",
        "PYTHONPATH": str(code),
    }
    log = (work / f"{name}.log").open("ab")
    return subprocess.Popen(
        [sys.executable, "-m", f"services.{name}"],
        env=env,
        cwd=code,
        stdout=log,
        stderr=subprocess.STDOUT,
    )


def _peak_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return 0.0


async def _ready(url: str, name: str, process: subprocess.Popen[bytes], limit: float) -> bool:
    nc = await nats.connect(url)
    deadline = time.monotonic() + limit
    try:
        while time.monotonic() < deadline:
            if process.poll() is not None:
                raise RuntimeError(f"{name} exited with {process.returncode}: see its log")
            try:
                await nc.request(subjects.ping_subject(name), b"", timeout=0.5)
                return True
            except (NoRespondersError, NatsTimeout):
                await asyncio.sleep(0.02)
        return False
    finally:
        await nc.close()


def _stop(process: subprocess.Popen[bytes]) -> None:
    process.terminate()
    try:
        process.wait(30)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


async def measure(
    url: str, name: str, env: dict[str, str], work: Path, code: Path, limit: float
) -> Start:
    started = time.monotonic()
    process = _spawn(name, env, work, code)
    try:
        ready = await _ready(url, name, process, limit)
        seconds = time.monotonic() - started
        return Start(seconds if ready else None, _peak_mib(process.pid))
    finally:
        _stop(process)


async def write_snapshots(url: str, work: Path) -> dict[str, int]:
    """Start the gateway and the checkpoint service until each has stored its snapshot of the
    whole log; return the positions."""
    connection = await Bus.connect(url, name="bench-log-scale")
    last = await connection.last_seq(subjects.EVENTS_STREAM)
    store = snapshots.Store(connection)
    env = _environment(url, work, write=True)
    for name, kind in (("gateway", "gateway"), ("checkpoint", "checkpoint")):
        process = _spawn(name, env, work, ROOT)
        try:
            await _ready(url, name, process, 600)
            while True:
                header = await store.latest(kind)
                if header is not None and header.position >= last:
                    break
                await asyncio.sleep(0.2)
        finally:
            _stop(process)
    positions = await store.positions()
    await connection.close()
    return positions


async def drop_snapshots(url: str) -> None:
    connection = await Bus.connect(url, name="bench-log-scale")
    with contextlib.suppress(NotFoundError):
        await connection.js.delete_stream(f"OBJ_{subjects.SNAPSHOTS_BUCKET}")
    await connection.close()


def _nats(store: Path) -> tuple[subprocess.Popen[bytes], str]:
    port = free_port()
    config = store / "nats-server.conf"
    config.write_text(
        f"listen: 127.0.0.1:{port}\nmax_payload: {MAX_PAYLOAD}\n"
        f'jetstream {{ store_dir: "{store / "js"}" }}\n'
    )
    server = subprocess.Popen(
        [nats_server_binary(), "-c", str(config)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    return server, f"nats://127.0.0.1:{port}"


def _before(rev: str, work: Path) -> Path:
    tree = work / "before"
    subprocess.run(
        ["git", "-C", str(ROOT), "worktree", "add", "--detach", str(tree), rev],
        check=True,
        capture_output=True,
    )
    return tree


def _cell(start: Start) -> str:
    seconds = f"{start.seconds:7.2f}" if start.seconds is not None else "  never"
    return f"{seconds} s {start.peak_mib:6.0f} MiB"


async def main(sizes: list[int], before: str, limit: float) -> None:
    work = Path(tempfile.mkdtemp(prefix="tinsmith-bench-log-"))
    old = _before(before, work) if before else None
    rows: list[tuple[int, int, float, str, dict[str, Start]]] = []
    try:
        for requests in sizes:
            store = work / f"nats-{requests}"
            store.mkdir()
            server, url = _nats(store)
            try:
                await asyncio.sleep(0.5)
                built = time.monotonic()
                events_, megabytes = await build(url, requests)
                print(
                    f"{requests} requests: {events_} events, {megabytes:.0f} MB, "
                    f"built in {time.monotonic() - built:.0f} s",
                    flush=True,
                )
                quiet = _environment(url, work, write=False)
                runs: dict[str, dict[str, Start]] = {}
                if old is not None:
                    runs["before"] = {
                        name: await measure(url, name, quiet, work, old, limit) for name in SERVICES
                    }
                await drop_snapshots(url)
                runs["replay"] = {
                    name: await measure(url, name, quiet, work, ROOT, limit) for name in SERVICES
                }
                positions = await write_snapshots(url, work)
                print(f"  snapshots at {positions}", flush=True)
                runs["snapshot"] = {
                    name: await measure(url, name, quiet, work, ROOT, limit) for name in SERVICES
                }
                for label, starts in runs.items():
                    rows.append((requests, events_, megabytes, label, starts))
                    print(f"  {label:9}" + "".join(f"  {n} {_cell(starts[n])}" for n in SERVICES))
            finally:
                server.terminate()
                server.wait(10)
    finally:
        if old is not None:
            subprocess.run(
                ["git", "-C", str(ROOT), "worktree", "remove", "--force", str(old)],
                capture_output=True,
            )
        shutil.rmtree(work, ignore_errors=True)
    print()
    print(
        f"{'requests':>9} {'events':>8} {'MB':>5} {'start':>9}"
        + "".join(f" {name + ' s':>13} {'MiB':>6}" for name in SERVICES)
    )
    for requests, events_, megabytes, label, starts in rows:
        cells = "".join(
            f" {starts[n].seconds or float('nan'):13.2f} {starts[n].peak_mib:6.0f}"
            for n in SERVICES
        )
        print(f"{requests:>9} {events_:>8} {megabytes:>5.0f} {label:>9}{cells}")
    print()
    print("ready time and peak memory, replay / snapshot:")
    by = {(r[0], r[3]): r[4] for r in rows}
    for requests in sizes:
        replay, snap = by[(requests, "replay")], by[(requests, "snapshot")]
        parts = []
        for name in SERVICES:
            slow, fast = replay[name].seconds, snap[name].seconds
            ratio = f"{slow / fast:.1f}x" if slow and fast else "n/a"
            parts.append(
                f"{name} {ratio} time, {replay[name].peak_mib / snap[name].peak_mib:.1f}x memory"
            )
        print(f"{requests:>9}: " + "; ".join(parts))


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("--sizes", default="1000,10000,100000")
    parser.add_argument("--before", default="", help="also start the services of this revision")
    parser.add_argument("--limit", type=float, default=180.0, help="seconds to wait for ready")
    arguments = parser.parse_args()
    sizes = [int(size) for size in arguments.sizes.split(",")]
    asyncio.run(main(sizes, arguments.before, arguments.limit))
