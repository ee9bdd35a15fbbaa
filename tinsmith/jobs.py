"""The state of sessions, runs, samplers, requests and checkpoints, as folds over the event log.

Owns: ``evolve(state, event) -> state`` for each aggregate, and ``Projection``, which indexes the
folded states of a whole log for the services that read it. Does not own: where events come from.
Pure: no I/O; the per-aggregate states are immutable, and a projection is rebuilt by replaying.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from enum import StrEnum
from typing import TypeVar

from tinsmith import events
from tinsmith._proto import bus_pb2 as bus
from tinsmith.failures import Cancelled

_K = TypeVar("_K")
_V = TypeVar("_V")


class Status(StrEnum):
    PENDING = "pending"
    COMPLETED = "completed"
    FAILED = "failed"


@dataclass(frozen=True)
class RequestState:
    request_id: str
    aggregate_id: str
    seq_id: int
    command: str
    status: Status = Status.PENDING
    result_seq: int = 0
    media_type: str = ""
    error_kind: str = ""
    error_detail: str = ""
    log_seq: int = 0  # where its RequestAccepted is in the log: read the command back from there


@dataclass(frozen=True)
class SessionState:
    session_id: str
    owner: str = ""  # the tenant; its runs, samplers, requests and checkpoints are its own
    tags: tuple[str, ...] = ()
    user_metadata: tuple[tuple[str, str], ...] = ()
    finished: bool = False
    run_ids: tuple[str, ...] = ()
    sampler_ids: tuple[str, ...] = ()
    last_active: float = 0.0  # when it was created or last took a request (event time)


@dataclass(frozen=True)
class RunState:
    model_id: str
    session_id: str
    base_model: str
    lora_rank: int
    train_mlp: bool
    train_attn: bool
    train_unembed: bool
    user_metadata: tuple[tuple[str, str], ...] = ()
    ready: bool = False
    tokenizer_id: str = ""
    last_seq_id: int = 0
    # The lowest seq_id not yet spent (accepted or rejected), and those above it already spent:
    # how far ahead of the run's queue a new request is.
    next_seq_id: int = 1
    spent_ahead: frozenset[int] = frozenset()
    last_request_time: float = 0.0
    last_checkpoint: str = ""  # tinker:// path of the newest training checkpoint
    last_sampler_checkpoint: str = ""
    # Set while the trainer has let go of the run: where its state is, and what runs next.
    snapshot: bus.RunUnloaded | None = None
    owner: str = ""  # its session's tenant
    # Placement among trainer replicas (RunPlaced): the latest hold's epoch, whether some replica
    # holds the run now (placed, until it unloads it), and how many replicas took it over from a
    # holder that died, since the run last recorded an outcome (the bound on poison requests).
    epoch: int = 0
    placed: bool = False
    takeovers: int = 0
    # The newest snapshot of the run's state (taken in the background, or when it was unloaded),
    # and the log position a rebuild reads from: that snapshot's event, or the run's creation.
    last_snapshot: bus.RunSnapshotted | None = None
    replay_from: int = 0
    # The tinker:// path whose copy the run holds (copy_weights): such a run is that checkpoint
    # alone, never loaded on a trainer, and takes no requests.
    copied_from: str = ""


@dataclass(frozen=True)
class SamplerState:
    sampler_id: str
    session_id: str
    base_model: str
    model_path: str
    adapter_key: str
    owner: str = ""  # its session's tenant


def evolve_request(state: RequestState | None, event: bus.Event) -> RequestState | None:
    kind = events.kind_of(event)
    if kind == "request_accepted":
        accepted = event.request_accepted
        return state or RequestState(
            request_id=accepted.request_id,
            aggregate_id=accepted.aggregate_id,
            seq_id=accepted.seq_id,
            command=events.command_of(accepted),
        )
    if state is None or state.status is not Status.PENDING:
        return state  # the first outcome wins; a redelivered worker's repeat changes nothing
    if kind == "request_completed":
        done = event.request_completed
        return replace(
            state,
            status=Status.COMPLETED,
            result_seq=done.result_seq,
            media_type=done.media_type,
        )
    if kind == "request_failed":
        failed = event.request_failed
        return replace(
            state, status=Status.FAILED, error_kind=failed.kind, error_detail=failed.detail
        )
    if kind == "request_cancelled":
        return replace(
            state,
            status=Status.FAILED,
            error_kind=Cancelled.kind,
            error_detail=event.request_cancelled.detail,
        )
    return state


def evolve_session(state: SessionState | None, event: bus.Event) -> SessionState | None:
    kind = events.kind_of(event)
    if kind == "session_created":
        created = event.session_created
        return SessionState(
            session_id=created.session_id,
            owner=created.owner,
            tags=tuple(created.tags),
            user_metadata=tuple(sorted(created.user_metadata.items())),
            last_active=event.time,
        )
    if kind == "weights_copied":  # a copy's run joins the session, created finished if new
        copied = event.weights_copied
        if state is None:
            state = SessionState(
                session_id=copied.session_id,
                owner=copied.owner,
                finished=True,
                last_active=event.time,
            )
        return replace(state, run_ids=(*state.run_ids, copied.model_id))
    if state is None:
        return None
    if kind == "session_finished":
        return replace(state, finished=True)
    if kind == "request_accepted":
        state = replace(state, last_active=max(state.last_active, event.time))
        if event.request_accepted.HasField("create_model"):
            return replace(state, run_ids=(*state.run_ids, event.request_accepted.aggregate_id))
        return state
    if kind == "sampler_created":
        return replace(
            state,
            sampler_ids=(*state.sampler_ids, event.sampler_created.sampler_id),
            last_active=max(state.last_active, event.time),
        )
    return state


def evolve_run(state: RunState | None, event: bus.Event) -> RunState | None:
    kind = events.kind_of(event)
    if kind == "request_accepted":
        accepted = event.request_accepted
        if accepted.HasField("create_model") and state is None:
            create = accepted.create_model
            return RunState(
                model_id=accepted.aggregate_id,
                session_id=create.session_id,
                base_model=create.base_model,
                lora_rank=create.lora.rank,
                train_mlp=create.lora.train_mlp,
                train_attn=create.lora.train_attn,
                train_unembed=create.lora.train_unembed,
                user_metadata=tuple(sorted(create.user_metadata.items())),
                last_request_time=event.time,
            )
        if state is not None:
            return _spend(
                replace(
                    state,
                    last_seq_id=max(state.last_seq_id, accepted.seq_id),
                    last_request_time=event.time,
                ),
                accepted.seq_id,
            )
    if state is not None and kind == "request_rejected":
        return _spend(state, event.request_rejected.seq_id)
    if state is None and kind == "weights_copied":
        return _copy_run(event)
    if state is not None and kind == "run_created":
        return replace(state, ready=True, tokenizer_id=event.run_created.tokenizer_id)
    if state is not None and kind == "weights_saved":
        saved = event.weights_saved
        if saved.kind == bus.CHECKPOINT_KIND_TRAINING:
            return replace(state, last_checkpoint=saved.tinker_path)
        return replace(state, last_sampler_checkpoint=saved.tinker_path)
    if state is not None and kind == "checkpoint_deleted":
        gone = event.checkpoint_deleted.tinker_path
        if state.last_checkpoint == gone:
            return replace(state, last_checkpoint="")
        if state.last_sampler_checkpoint == gone:
            return replace(state, last_sampler_checkpoint="")
        return state
    if state is not None and kind == "run_unloaded":
        unloaded = event.run_unloaded
        snapshot = bus.RunSnapshotted(
            model_id=unloaded.model_id,
            snapshot_key=unloaded.snapshot_key,
            next_seq_id=unloaded.next_seq_id,
            create=unloaded.create,
            epoch=unloaded.epoch,
        )
        return replace(state, snapshot=unloaded, last_snapshot=snapshot, placed=False)
    if state is not None and kind == "run_snapshotted":
        return replace(state, last_snapshot=event.run_snapshotted)
    if state is not None and kind == "run_restored":
        return replace(state, snapshot=None)
    if state is not None and kind == "run_placed":
        placed = event.run_placed
        return replace(
            state,
            epoch=max(state.epoch, placed.epoch),
            placed=True,
            takeovers=state.takeovers + int(placed.takeover),
        )
    if state is not None and kind in ("request_completed", "request_failed"):
        return replace(state, takeovers=0) if state.takeovers else state
    return state


def _copy_run(event: bus.Event) -> RunState:
    """The run a copy of weights makes: the copied checkpoint's model and LoRA layout, ready,
    and its newest checkpoint of the copy's kind."""
    copied = event.weights_copied
    saved = copied.saved
    lora = saved.lora if saved.HasField("lora") else bus.LoraConfig()
    every = not saved.HasField("lora")  # as the catalog reads a save without a layout: all
    training = saved.kind == bus.CHECKPOINT_KIND_TRAINING
    return RunState(
        model_id=copied.model_id,
        session_id=copied.session_id,
        base_model=saved.base_model,
        lora_rank=saved.lora_rank,
        train_mlp=every or lora.train_mlp,
        train_attn=every or lora.train_attn,
        train_unembed=every or lora.train_unembed,
        ready=True,
        last_request_time=event.time,
        last_checkpoint=saved.tinker_path if training else "",
        last_sampler_checkpoint="" if training else saved.tinker_path,
        owner=copied.owner,
        copied_from=copied.source_path,
    )


def fenced(state: RunState | None, event: bus.Event) -> bool:
    """Whether ``event`` was recorded under a hold on the run that a later placement ended: a
    trainer cut off from the bus, or paused past its lease, whose run another replica took over.
    Such an event changes nothing."""
    epoch = events.epoch_of(event)
    return state is not None and epoch != 0 and epoch < state.epoch


def _spend(state: RunState, seq_id: int) -> RunState:
    """The run with ``seq_id`` spent: the next one moves past every spent seq_id in a row."""
    if seq_id < state.next_seq_id or seq_id in state.spent_ahead:
        return state
    ahead = set(state.spent_ahead)
    ahead.add(seq_id)
    next_seq_id = state.next_seq_id
    while next_seq_id in ahead:
        ahead.discard(next_seq_id)
        next_seq_id += 1
    return replace(state, next_seq_id=next_seq_id, spent_ahead=frozenset(ahead))


def evolve_sampler(state: SamplerState | None, event: bus.Event) -> SamplerState | None:
    if events.kind_of(event) == "sampler_created" and state is None:
        created = event.sampler_created
        return SamplerState(
            sampler_id=created.sampler_id,
            session_id=created.session_id,
            base_model=created.base_model,
            model_path=created.model_path,
            adapter_key=created.adapter_key,
        )
    return state


@dataclass(frozen=True)
class KeyState:
    """An API key as the operator issued it (its digest, never the key), and whether it was
    revoked since."""

    issued: bus.KeyIssued
    issued_at: float
    revoked: bool = False


@dataclass
class TenantUsage:
    """What one tenant holds now, kept by the fold so that quotas are checked without a scan of
    the whole log: its sessions and runs (counted against their quotas as they stand), the bytes
    of its live checkpoints, and its requests not yet settled."""

    session_ids: set[str] = field(default_factory=set)
    run_ids: set[str] = field(default_factory=set)
    checkpoint_bytes: int = 0
    inflight: int = 0  # requests accepted and not yet settled
    queued_samples: int = 0  # of those, sample requests


@dataclass
class Projection:
    """Every aggregate's folded state, indexed by id, and the log position it reflects."""

    sessions: dict[str, SessionState] = field(default_factory=dict)
    runs: dict[str, RunState] = field(default_factory=dict)
    samplers: dict[str, SamplerState] = field(default_factory=dict)
    requests: dict[str, RequestState] = field(default_factory=dict)
    # Requests the gateway refused after their seq_id was spent, by request id: a repeat of one
    # gets the same answer.
    rejections: dict[str, bus.RequestRejected] = field(default_factory=dict)
    checkpoints: dict[str, bus.WeightsSaved] = field(default_factory=dict)
    saved_at: dict[str, float] = field(default_factory=dict)  # tinker path -> event time
    published: set[str] = field(default_factory=set)  # tinker paths readable by every tenant
    keys: dict[str, KeyState] = field(default_factory=dict)  # by key_id
    tenants: dict[str, TenantUsage] = field(default_factory=dict)
    # Requests accepted and not yet settled: the depth of the samplers' shared queue, and of
    # the trainers' work.
    pending_samples: int = 0
    pending_training: int = 0
    # Per run, its requests accepted and not yet settled: the runs a trainer must hold.
    pending_runs: dict[str, int] = field(default_factory=dict)
    position: int = 0

    def owner_of(self, aggregate_id: str) -> str | None:
        """The tenant of a run or sampler (None: there is no such aggregate)."""
        held = self.runs.get(aggregate_id) or self.samplers.get(aggregate_id)
        return None if held is None else held.owner

    def usage(self, tenant: str) -> TenantUsage:
        return self.tenants.get(tenant) or TenantUsage()

    def apply(self, seq: int, event: bus.Event) -> None:
        """Fold one event in. Events at or below ``position`` were applied already."""
        if seq <= self.position:
            return
        self.position = seq
        kind = events.kind_of(event)
        if kind in events.FENCED and fenced(self.runs.get(self._run_of(kind, event)), event):
            return
        if kind.startswith("request_"):
            self._apply_request(seq, kind, event)
            return
        aggregate, agg_id = events.aggregate_of(event)
        if aggregate == "key":
            self._apply_key(kind, event)
        elif aggregate == "session":
            session = evolve_session(self.sessions.get(agg_id), event)
            _put(self.sessions, agg_id, session)
            if kind == "session_created" and session is not None:
                self._usage(session.owner).session_ids.add(agg_id)
        elif aggregate == "sampler":
            sid = event.sampler_created.session_id
            owner = self.sessions[sid].owner if sid in self.sessions else ""
            sampler = evolve_sampler(self.samplers.get(agg_id), event)
            _put(self.samplers, agg_id, sampler and replace(sampler, owner=owner))
            _put(self.sessions, sid, evolve_session(self.sessions.get(sid), event))
        elif kind == "weights_copied":
            self._copied(event)
        else:
            if kind == "weights_saved":
                self._saved(event.weights_saved, event.time)
            elif kind == "checkpoint_deleted":
                gone = event.checkpoint_deleted
                saved = self.checkpoints.get(gone.tinker_path)
                if saved is not None and saved.blob_key == gone.blob_key:
                    self._forget(gone.tinker_path)
            elif kind == "checkpoint_published":
                published = event.checkpoint_published
                if published.public and published.tinker_path in self.checkpoints:
                    self.published.add(published.tinker_path)
                else:
                    self.published.discard(published.tinker_path)
            run = evolve_run(self.runs.get(agg_id), event)
            if run is not None and kind in ("run_unloaded", "run_snapshotted"):
                run = replace(run, replay_from=seq)
            _put(self.runs, agg_id, run)

    @staticmethod
    def _run_of(kind: str, event: bus.Event) -> str:
        body = getattr(event, kind)
        return str(body.aggregate_id if kind.startswith("request_") else body.model_id)

    def _apply_request(self, seq: int, kind: str, event: bus.Event) -> None:
        body = getattr(event, kind)
        agg = body.aggregate_id
        rid = body.request_id if kind != "request_rejected" else ""
        if rid:
            before = self.requests.get(rid)
            after = evolve_request(before, event)
            if before is None and after is not None:
                after = replace(after, log_seq=seq)
            _put(self.requests, rid, after)
            if after is not None:
                was = before is not None and before.status is Status.PENDING
                change = int(after.status is Status.PENDING) - int(was)
                usage = self._usage(self._owner_for(agg, event))
                usage.inflight += change
                if after.command == "sample":
                    self.pending_samples += change
                    usage.queued_samples += change
                else:
                    self.pending_training += change
                    left = self.pending_runs.get(agg, 0) + change
                    if left > 0:
                        self.pending_runs[agg] = left
                    else:
                        self.pending_runs.pop(agg, None)
        if kind == "request_rejected":
            self.rejections.setdefault(events.request_id(agg, body.seq_id), body)
        run = evolve_run(self.runs.get(agg), event)
        if kind == "request_accepted" and body.HasField("create_model"):
            sid = body.create_model.session_id
            session = evolve_session(self.sessions.get(sid), event)
            _put(self.sessions, sid, session)
            if run is not None and agg not in self.runs:
                run = replace(run, replay_from=seq)  # a rebuild without a snapshot starts here
            if run is not None and agg not in self.runs and session is not None:
                run = replace(run, owner=session.owner)
                self._usage(session.owner).run_ids.add(agg)
        elif kind == "request_accepted":
            held = self.runs.get(agg) or self.samplers.get(agg)
            if held is not None and held.session_id in self.sessions:
                sid = held.session_id
                _put(self.sessions, sid, evolve_session(self.sessions[sid], event))
        _put(self.runs, agg, run)

    def _owner_for(self, aggregate_id: str, event: bus.Event) -> str:
        owner = self.owner_of(aggregate_id)
        if owner is None and event.request_accepted.HasField("create_model"):
            session = self.sessions.get(event.request_accepted.create_model.session_id)
            owner = session.owner if session is not None else ""
        return owner or ""

    def _apply_key(self, kind: str, event: bus.Event) -> None:
        if kind == "key_issued":
            issued = event.key_issued
            self.keys.setdefault(issued.key_id, KeyState(issued=issued, issued_at=event.time))
        elif kind == "key_revoked" and event.key_revoked.key_id in self.keys:
            key_id = event.key_revoked.key_id
            self.keys[key_id] = replace(self.keys[key_id], revoked=True)

    def _copied(self, event: bus.Event) -> None:
        """A copy of weights: its session (new, or the owner's own), its run, its checkpoint. A
        repeat, or a session of another tenant (the catalog refuses both), changes nothing. The
        run is no loaded run of the tenant's: it never reaches a trainer."""
        copied = event.weights_copied
        session = self.sessions.get(copied.session_id)
        if copied.model_id in self.runs or (session is not None and session.owner != copied.owner):
            return
        if session is None:
            self._usage(copied.owner).session_ids.add(copied.session_id)
        _put(self.sessions, copied.session_id, evolve_session(session, event))
        _put(self.runs, copied.model_id, evolve_run(None, event))
        self._saved(copied.saved, event.time)

    def _saved(self, saved: bus.WeightsSaved, time: float) -> None:
        if saved.tinker_path in self.checkpoints:
            self._forget(saved.tinker_path)  # overwritten: the new one replaces it
        self.checkpoints[saved.tinker_path] = saved
        self.saved_at[saved.tinker_path] = time
        self._usage(self._run_owner(saved.model_id)).checkpoint_bytes += saved.size_bytes

    def _forget(self, tinker_path: str) -> None:
        saved = self.checkpoints.pop(tinker_path)
        self.saved_at.pop(tinker_path, None)
        self.published.discard(tinker_path)
        self._usage(self._run_owner(saved.model_id)).checkpoint_bytes -= saved.size_bytes

    def _run_owner(self, model_id: str) -> str:
        run = self.runs.get(model_id)
        return run.owner if run is not None else ""

    def _usage(self, tenant: str) -> TenantUsage:
        return self.tenants.setdefault(tenant, TenantUsage())

    def prune(self, results_from: int, idle_before: float = 0.0) -> int:
        """Forget what nothing can ask about any more, so that a projection holds what is live
        rather than the whole history. Returns how many requests went.

        - Requests completed whose result has left the results stream (``results_from``: the
          first sequence it still stores; its max age passed).
        - Requests failed before the newest of those was accepted (their outcome is in the
          projection, not the results stream: they go as old as the results do).
        - Except, of both, a run's creation and the requests a rebuild of their run executes
          again (``rebuilt_from``). Pending requests stay.
        - Samplers of a session that was finished and last active before ``idle_before`` (event
          time; 0: none go), with no request left here: nothing can sample on them any more but
          a client that kept one past its session's end that long."""
        expired = [
            request
            for request in self.requests.values()
            if request.status is Status.COMPLETED and 0 < request.result_seq < results_from
        ]
        horizon = max((request.log_seq for request in expired), default=0)
        failed = [
            request
            for request in self.requests.values()
            if request.status is Status.FAILED and 0 < request.log_seq < horizon
        ]
        gone = [
            request.request_id
            for request in (*expired, *failed)
            if request.command != "create_model" and not self._rebuild_reads(request)
        ]
        for request_id in gone:
            del self.requests[request_id]
        if idle_before > 0:
            asked = {request.aggregate_id for request in self.requests.values()}
            idle = [
                sampler_id
                for sampler_id, sampler in self.samplers.items()
                if sampler_id not in asked
                and (session := self.sessions.get(sampler.session_id)) is not None
                and session.finished
                and session.last_active < idle_before
            ]
            for sampler_id in idle:
                del self.samplers[sampler_id]
        return len(gone)

    def rebuilt_from(self, run: RunState) -> int:
        """The lowest seq_id a rebuild of ``run`` executes: its newest snapshot's next one, or 0
        (its creation) without a snapshot. Its requests from there on are read back from the log
        by their ``log_seq``."""
        snapshot = run.snapshot or run.last_snapshot
        return int(snapshot.next_seq_id) if snapshot is not None else 0

    def _rebuild_reads(self, request: RequestState) -> bool:
        run = self.runs.get(request.aggregate_id)
        return run is not None and request.seq_id >= self.rebuilt_from(run)


def _put(index: dict[_K, _V], key: _K, value: _V | None) -> None:
    if value is not None:
        index[key] = value
