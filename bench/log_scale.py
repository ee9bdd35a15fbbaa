"""The log at scale: event logs of any number of requests, as RL jobs write them (``History``:
sessions of three tenants, each with a run that does forward_backward, optim_step, a save for
sampling and four sample requests per step, with training checkpoints, TTLs, publications,
deletions, unloads, rejections, failures and cancellations along the way; about 2.2 events per
request), for the benchmark of start-up time and memory and for the tests of replay and
snapshots.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from dataclasses import dataclass, field

from tinsmith import artifacts, events
from tinsmith._proto import bus_pb2 as bus
from tinsmith._proto import tinker_public_pb2 as tp

BASE = "tinsmith/tiny"
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

    def _done(self, aggregate: str, seq_id: int, media: str = "application/json") -> bus.Event:
        self.results += 1
        completed = bus.RequestCompleted(
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
        yield self._done(run, job.seq_id, "application/x-protobuf")
        if rng.random() < 0.01:  # a request refused after its seq_id was spent
            job.seq_id += 1
            rejected = bus.RequestRejected(
                aggregate_id=run, seq_id=job.seq_id, kind="invalid_request", detail="bad tokens"
            )
            yield self._event(request_rejected=rejected)
        job.seq_id += 1
        adam = bus.AdamParams(learning_rate=1e-4, beta1=0.9, beta2=0.95, eps=1e-8)
        yield from self._request(run, job.seq_id, optim_step=bus.OptimStep(adam=adam))
        yield self._done(run, job.seq_id)
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
                yield self._done(sampler_id, n, "application/x-protobuf")
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
                model_id=run, tinker_path=str(path), ttl_seconds=86400, expires_at=self.time + 86400
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
