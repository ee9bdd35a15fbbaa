"""The Tinker operations as decisions: one function per operation, from a typed request to the
event to append, the answer, or an error. Pure: no I/O, no clock, no randomness of its own.

Owns: what each Tinker call means in terms of events, who may do what (``Call.owns``: one
decision, made by every operation before it reads anything else of what it touches), each
tenant's quotas, and the order of a run's requests (repeats, refusals that spend a seq_id, the
window ahead). Does not own: the checks of a request's content against its model and the bounds
(checks.py), reading requests off the wire (http.py, grpc_face.py, wire.py), appending and
waiting (handlers.py), or compute. The model registry it asks (``models.get``) reads a served
directory's config.json: the one read of the disk behind a decision.

Isolation. Every session, run, sampler, future and checkpoint belongs to the tenant that created
its session. Another tenant is told exactly what it would be told if the thing did not exist
(404 with the same detail), on every operation. Published checkpoints are the one exception: any
tenant may load, sample and download them, and nothing else of the run that published them.

Each function takes a ``Call`` (the tenant, the projection of the log, the bounds, the time and
the ids the shell drew) and returns a ``Decision``: ``Append`` an event and answer, ``Refuse`` (a
run's request whose refusal spends its seq_id: append the rejection, then raise), or ``Done``
(nothing to append: a repeat, or a read).
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, field
from typing import Any, Generic, TypeVar

from tinsmith import artifacts, events, jobs, limits, models, subjects
from tinsmith import lora as lora_layout
from tinsmith._proto import bus_pb2 as bus
from tinsmith._proto import tinker_public_pb2 as tp
from tinsmith.failures import (
    Forbidden,
    InternalError,
    InvalidRequest,
    NotFound,
    Overloaded,
    QuotaExceeded,
    TinsmithError,
    Unprocessable,
    from_kind,
)
from tinsmith.limits import Limits, mib
from tinsmith.tenants import SESSION_ACTIVE_S, Tenant

from . import checks

A = TypeVar("A")

# -- the call and its outcomes -----------------------------------------------------------------


@dataclass(frozen=True)
class Call:
    """One operation's context: who calls, what the log says, the bounds, and the inputs the
    shell chose for it (the time, a fresh session id, this replica's stream id)."""

    tenant: Tenant
    state: jobs.Projection
    limits: Limits
    sampler_queue_limit: int
    now: float = 0.0
    new_id: str = ""
    stream_id: str = ""

    def owns(self, owner: str | None) -> bool:
        """The one authorisation decision: a thing is its tenant's alone."""
        return owner is not None and owner != "" and owner == self.tenant.name


@dataclass(frozen=True)
class Future:
    """What a request is answered with: the future to poll (``retrieve_future``)."""

    request_id: str
    aggregate_id: str
    sequence_ids: tuple[str, ...] = ()


@dataclass(frozen=True)
class Append(Generic[A]):
    """Append ``event`` (an event of ``aggregate``; ``msg_id`` de-duplicates a retried append),
    wait until this replica's projection has it, and answer ``answer``."""

    event: bus.Event
    answer: A
    aggregate: str = "run"
    msg_id: str | None = None


@dataclass(frozen=True)
class Refuse:
    """A run's request refused after its seq_id was spent: append ``event`` (a RequestRejected,
    so the run's later requests do not wait for it; ``msg_id`` is the request's id), then raise
    ``error``."""

    event: bus.Event
    error: TinsmithError
    msg_id: str


@dataclass(frozen=True)
class Done(Generic[A]):
    """Nothing to append: answer ``answer``."""

    answer: A


Decision = Append[A] | Refuse | Done[A]


# -- typed requests ----------------------------------------------------------------------------


@dataclass(frozen=True)
class CreateSession:
    tags: tuple[str, ...] = ()
    user_metadata: dict[str, str] = field(default_factory=dict)
    project_id: str = ""
    display_name: str = ""
    sdk_version: str = ""


@dataclass(frozen=True)
class SessionRef:
    """Heartbeat, or finish with a reason."""

    session_id: str
    reason: str = ""
    detail: str = ""


@dataclass(frozen=True)
class CreateModel:
    session_id: str
    model_seq_id: int
    base_model: str
    lora: bus.LoraConfig
    optimizer: str = "adamw"
    user_metadata: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class LoadState:
    """A new run from a checkpoint (``create_training_client_from_state*``)."""

    session_id: str
    model_seq_id: int
    path: str
    with_optimizer: bool = False
    base_model: str = ""
    user_metadata: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class LoadWeights:
    """A checkpoint loaded into a run (the SDK's deprecated ``TrainingClient.load_state*``)."""

    model_id: str
    seq_id: int
    path: str
    with_optimizer: bool = False


@dataclass(frozen=True)
class ModelRef:
    model_id: str


@dataclass(frozen=True)
class ForwardBackward:
    """A forward or forward_backward chunk, as the SDK's protobuf carries it."""

    request: tp.ForwardBackwardRequest


@dataclass(frozen=True)
class OptimStep:
    model_id: str
    seq_id: int
    adam: bus.AdamParams


@dataclass(frozen=True)
class SaveWeights:
    model_id: str
    seq_id: int
    kind: bus.CheckpointKind
    name: str = ""
    overwrite: bool = False
    ttl_seconds: int | None = None
    sampling_session_seq_id: int | None = None
    user_metadata: dict[str, str] = field(default_factory=dict)
    encrypted: bool = False  # the caller asked for age encryption, which is not offered


@dataclass(frozen=True)
class CreateSampler:
    session_id: str
    sampling_session_seq_id: int
    base_model: str = ""
    model_path: str = ""


@dataclass(frozen=True)
class SamplerRef:
    sampler_id: str


@dataclass(frozen=True)
class Sample:
    """A sample request: what it asks (``command``, without the sampler's base model and
    adapter, which the operation fills in) of which sampler."""

    sampler_id: str
    seq_id: int
    command: bus.Sample
    stream: bool = False


@dataclass(frozen=True)
class RequestRef:
    request_id: str


# -- sessions ----------------------------------------------------------------------------------


def create_session(call: Call, request: CreateSession) -> Decision[str]:
    _check_metadata(
        call,
        request.tags,
        request.user_metadata,
        request.project_id,
        request.display_name,
        request.sdk_version,
    )
    active = _open_sessions(call, call.tenant.name)
    quota = call.tenant.quotas.max_sessions
    if active >= quota:
        raise QuotaExceeded(
            f"tenant {call.tenant.name} has {active} open sessions, its quota (max_sessions, "
            f"TINSMITH_TENANT_MAX_SESSIONS) is {quota}: close the sessions it no longer uses "
            "(ServiceClient.close); an unfinished session stops counting after "
            f"{SESSION_ACTIVE_S / 3600:g} h without requests"
        )
    session_id = subjects.check_id("session id", call.new_id)
    created = bus.SessionCreated(
        session_id=session_id,
        owner=call.tenant.name,
        tags=list(request.tags),
        user_metadata=request.user_metadata,
        project_id=request.project_id,
        display_name=request.display_name,
        sdk_version=request.sdk_version,
    )
    return Append(events.make(session_created=created), session_id, aggregate="session")


def heartbeat(call: Call, request: SessionRef) -> Done[jobs.SessionState]:
    return Done(session(call, request.session_id))


def finish_session(call: Call, request: SessionRef) -> Decision[None]:
    found = session(call, request.session_id)
    _check_metadata(call, request.reason, request.detail)
    finished = bus.SessionFinished(
        session_id=found.session_id, reason=request.reason, detail=request.detail
    )
    return Append(events.make(session_finished=finished), None, aggregate="session")


def _open_sessions(call: Call, tenant: str) -> int:
    """The tenant's sessions that count against its quota: not finished, and active lately."""
    sessions = call.state.sessions
    return sum(
        1
        for sid in call.state.usage(tenant).session_ids
        if not sessions[sid].finished and sessions[sid].last_active >= call.now - SESSION_ACTIVE_S
    )


def _loaded_runs(call: Call, tenant: str) -> int:
    """The tenant's runs that count against its quota: loaded, in a session not finished."""
    state = call.state
    return sum(
        1
        for model_id in state.usage(tenant).run_ids
        if state.runs[model_id].snapshot is None
        and not state.sessions[state.runs[model_id].session_id].finished
    )


def usage(call: Call) -> Done[dict[str, Any]]:
    """What each tenant holds against its quotas: the caller's own, or every tenant's for an
    admin (with the caller's quotas; another tenant's depend on the key it calls with)."""
    names = sorted(call.state.tenants) if call.tenant.admin else [call.tenant.name]
    rows = []
    for name in names:
        held = call.state.usage(name)
        row: dict[str, Any] = {
            "tenant": name,
            "sessions": _open_sessions(call, name),
            "runs": _loaded_runs(call, name),
            "checkpoint_bytes": held.checkpoint_bytes,
            "inflight": held.inflight,
            "queued_samples": held.queued_samples,
        }
        if name == call.tenant.name:
            row["quotas"] = asdict(call.tenant.quotas)
        rows.append(row)
    return Done({"tenants": rows})


# -- training ----------------------------------------------------------------------------------


def create_model(call: Call, request: CreateModel) -> Decision[Future]:
    owner, model_id = _new_run(call, request.session_id, request.model_seq_id)
    existing = _existing(call, model_id, 0)
    if existing is not None:
        return Done(existing)
    spec = models.get(request.base_model)
    lora = request.lora
    checks.check_lora(call.limits, lora)
    lora_layout.target_modules(
        spec.arch, attn=lora.train_attn, mlp=lora.train_mlp, unembed=lora.train_unembed
    )
    if request.optimizer != "adamw":
        raise InvalidRequest(
            f"optimizer_config type {request.optimizer!r:.60} is not supported; accepted: 'adamw'"
        )
    _check_metadata(call, request.user_metadata)
    _check_runs_quota(call)
    command = bus.CreateModel(
        session_id=owner.session_id,
        base_model=spec.name,
        lora=lora,
        optimizer="adamw",
        user_metadata=request.user_metadata,
    )
    if not command.lora.HasField("seed"):
        # Drawn here, so the log holds everything the adapter's initialisation depends on: a
        # run rebuilt from its creation after a crash gets the very same adapter.
        command.lora.seed = int(hashlib.sha256(call.new_id.encode()).hexdigest()[:15], 16)
    return _accept_new_run(call, model_id, command)


def load_state(call: Call, request: LoadState) -> Decision[Future]:
    owner, model_id = _new_run(call, request.session_id, request.model_seq_id)
    existing = _existing(call, model_id, 0)
    if existing is not None:
        return Done(existing)
    checkpoint = _loadable(call, request.path, request.with_optimizer, request.base_model)
    _check_metadata(call, request.user_metadata)
    _check_runs_quota(call)
    lora = bus.LoraConfig()
    if checkpoint.HasField("lora"):
        lora.CopyFrom(checkpoint.lora)
    else:
        lora.MergeFrom(bus.LoraConfig(train_mlp=True, train_attn=True, train_unembed=True))
    lora.rank = checkpoint.lora_rank
    command = bus.CreateModel(
        session_id=owner.session_id,
        base_model=checkpoint.base_model,
        lora=lora,
        optimizer="adamw",
        user_metadata=request.user_metadata or dict(checkpoint.user_metadata),
        load_key=checkpoint.blob_key,
        load_optimizer=request.with_optimizer,
        load_path=request.path,
    )
    return _accept_new_run(call, model_id, command)


def load_weights(call: Call, request: LoadWeights) -> Decision[Future]:
    held = run(call, request.model_id)

    def build() -> dict[str, Any]:
        checkpoint = _loadable(call, request.path, request.with_optimizer, held.base_model)
        if checkpoint.lora_rank != held.lora_rank:
            raise InvalidRequest(
                f"{request.path} has LoRA rank {checkpoint.lora_rank}, the run has rank "
                f"{held.lora_rank}; create a new client from it instead"
            )
        command = bus.LoadWeights(
            path=request.path, blob_key=checkpoint.blob_key, optimizer=request.with_optimizer
        )
        return {"load_weights": command}

    return _submit(call, held, request.seq_id, build)


def get_info(call: Call, request: ModelRef) -> Done[dict[str, Any]]:
    held = run(call, request.model_id)
    spec = models.get(held.base_model)
    return Done(
        {
            "type": "get_info",
            "model_id": held.model_id,
            "model_data": {
                "arch": spec.arch,
                "model_name": held.base_model,
                "tokenizer_id": models.tokenizer_id(held.base_model),
            },
            "is_lora": True,
            "lora_rank": held.lora_rank,
            "model_name": held.base_model,
            "optimizer_config": {"type": "adamw"},
        }
    )


def forward_backward(call: Call, request: ForwardBackward) -> Decision[Future]:
    chunk = request.request
    held = run(call, chunk.model_id)
    if chunk.seq_id < 1:
        raise InvalidRequest(f"seq_id must be >= 1 for forward_backward, got {chunk.seq_id}")

    def build() -> dict[str, Any]:
        checks.check_forward_backward(call.limits, models.get(held.base_model), chunk)
        return {"forward_backward": chunk}

    return _submit(call, held, chunk.seq_id, build)


def optim_step(call: Call, request: OptimStep) -> Decision[Future]:
    held = run(call, request.model_id)
    return _submit(
        call, held, request.seq_id, lambda: {"optim_step": bus.OptimStep(adam=request.adam)}
    )


def save_weights(call: Call, request: SaveWeights) -> Decision[Future]:
    held = run(call, request.model_id)
    return _submit(
        call, held, request.seq_id, lambda: {"save_weights": _save_command(call, held, request)}
    )


def _save_command(call: Call, held: jobs.RunState, request: SaveWeights) -> bus.SaveWeights:
    if request.kind == bus.CHECKPOINT_KIND_EXTERNAL and request.encrypted:
        raise InvalidRequest(
            "age_encryption_recipients is not supported: external weights are stored "
            "unencrypted; leave it out"
        )
    _check_metadata(call, request.user_metadata)
    may_store_checkpoint(call)
    command = bus.SaveWeights(kind=request.kind, user_metadata=request.user_metadata)
    if request.ttl_seconds is not None:
        command.ttl_seconds = request.ttl_seconds
    if request.name:
        command.name = artifacts.check_name(request.name)
        path = artifacts.TinkerPath(held.model_id, command.kind, command.name)
        if str(path) in call.state.checkpoints:
            if not request.overwrite:
                raise InvalidRequest(f"checkpoint {path} already exists; pass overwrite=True")
            command.blob_key = path.overwrite_key(request.seq_id)  # never rewritten in place
    elif request.kind == bus.CHECKPOINT_KIND_SAMPLER:
        if request.sampling_session_seq_id is None:
            raise InvalidRequest(
                "save_weights_for_sampler needs a name in 'path' or 'sampling_session_seq_id'"
            )
        counter = _counter("sampling_session_seq_id", request.sampling_session_seq_id)
        command.sampler_id = subjects.check_id("sampler id", f"{held.session_id}:sample:{counter}")
    else:
        raise InvalidRequest("save_weights needs a checkpoint name in 'path'")
    return command


def may_store_checkpoint(call: Call) -> None:
    """Refuse a new checkpoint (a save, or a copy) of a tenant at its storage quota."""
    stored = call.state.usage(call.tenant.name).checkpoint_bytes
    quota = call.tenant.quotas.max_checkpoint_bytes
    if stored >= quota:
        raise QuotaExceeded(
            f"tenant {call.tenant.name} stores {mib(stored)} of checkpoints, its quota "
            f"(max_checkpoint_bytes, TINSMITH_TENANT_MAX_CHECKPOINT_MB) is {mib(quota)}: delete "
            "checkpoints it no longer needs (RestClient.delete_checkpoint) or set TTLs"
        )


def _loadable(call: Call, path: str, with_optimizer: bool, base: str) -> bus.WeightsSaved:
    checkpoint = readable_checkpoint(call, path)
    if with_optimizer and checkpoint.kind != bus.CHECKPOINT_KIND_TRAINING:
        raise InvalidRequest(
            f"{path} holds sampler weights only; loading with the optimizer needs a training "
            "checkpoint (tinker://<run>/weights/<name>, from save_state)"
        )
    if base and models.get(base).name != checkpoint.base_model:
        raise InvalidRequest(f"{path} was trained on {checkpoint.base_model}, not {base}")
    return checkpoint


# -- sampling ----------------------------------------------------------------------------------


def create_sampler(call: Call, request: CreateSampler) -> Decision[str]:
    owner = session(call, request.session_id)
    counter = _counter("sampling_session_seq_id", request.sampling_session_seq_id)
    sampler_id = subjects.check_id("sampler id", f"{owner.session_id}:sample:{counter}")
    if sampler_id in call.state.samplers:
        return Done(sampler_id)
    created = bus.SamplerCreated(sampler_id=sampler_id, session_id=owner.session_id)
    if request.model_path:
        checkpoint = readable_checkpoint(call, request.model_path)
        if request.base_model and models.get(request.base_model).name != checkpoint.base_model:
            raise InvalidRequest(
                f"{request.model_path} was trained on {checkpoint.base_model}, not "
                f"{request.base_model}"
            )
        created.base_model = checkpoint.base_model
        created.model_path = request.model_path
        created.adapter_key = checkpoint.blob_key
    elif request.base_model:
        created.base_model = models.get(request.base_model).name
    else:
        raise InvalidRequest("create_sampling_session needs base_model or model_path")
    return Append(events.make(sampler_created=created), sampler_id, aggregate="sampler")


def get_sampler(call: Call, request: SamplerRef) -> Done[dict[str, Any]]:
    held = sampler(call, request.sampler_id)
    return Done(
        {
            "sampler_id": held.sampler_id,
            "base_model": held.base_model,
            "model_path": held.model_path or None,
        }
    )


def sample(call: Call, request: Sample) -> Decision[Future]:
    """Accept a sample request. With ``stream``, the sampler sends its tokens to this replica
    (``Call.stream_id``) as they are generated; a repeat of a request accepted before keeps how
    that one was accepted."""
    held = sampler(call, request.sampler_id)
    if not 0 <= request.seq_id <= limits.INT64_MAX:
        raise InvalidRequest(f"seq_id must be in [0, {limits.INT64_MAX}], got {request.seq_id}")
    request_id = events.request_id(held.sampler_id, request.seq_id)
    command = bus.Sample()
    command.CopyFrom(request.command)
    command.base_model, command.adapter_key = held.base_model, held.adapter_key
    checks.check_sample(call.limits, models.get(held.base_model), command)
    sequence_ids = tuple(f"{request_id}:{i}" for i in range(command.num_samples))
    future = Future(request_id, held.sampler_id, sequence_ids)
    if request_id in call.state.requests:
        return Done(future)
    queued = call.state.pending_samples
    if queued >= call.sampler_queue_limit:
        raise Overloaded(
            f"the sampling queue is full ({queued} requests waiting, the bound is "
            f"{call.sampler_queue_limit}); send it again later"
        )
    usage = call.state.usage(call.tenant.name)
    quota = call.tenant.quotas.max_queued_samples
    if usage.queued_samples >= quota:
        raise Overloaded(
            f"tenant {call.tenant.name} has {usage.queued_samples} sample requests waiting, its "
            f"share of the sampling queue (max_queued_samples, "
            f"TINSMITH_TENANT_MAX_QUEUED_SAMPLES) is {quota}; send it again later"
        )
    _check_inflight(call)
    if request.stream:
        command.stream_to = call.stream_id
    accepted = bus.RequestAccepted(
        request_id=request_id, aggregate_id=held.sampler_id, seq_id=request.seq_id, sample=command
    )
    return Append(
        events.make(request_accepted=accepted), future, aggregate="sampler", msg_id=request_id
    )


def cancel_sample(call: Call, request: RequestRef) -> Done[jobs.RequestState | None]:
    """The sample request to cancel when its caller went away (None: nothing to cancel, it has
    settled). Training requests are never cancelled: a run's requests execute in seq_id order."""
    held = future(call, request.request_id)
    if held.command != "sample" or held.status is not jobs.Status.PENDING:
        return Done(None)
    return Done(held)


# -- futures -----------------------------------------------------------------------------------


def future(call: Call, request_id: str) -> jobs.RequestState:
    """A request of the caller's, as it stands."""
    held = call.state.requests.get(request_id)
    if held is None or not call.owns(call.state.owner_of(held.aggregate_id)):
        raise NotFound(f"no future with request_id {request_id!r:.200}")
    return held


def spend_refused(call: Call, error: TinsmithError, model_id: str, seq_id: int) -> Decision[None]:
    """Spend ``seq_id`` of the caller's run ``model_id`` with ``error``, for a request refused
    before it could be read (too large). A run that is not the caller's, a seq_id spent already
    or one too far ahead is left alone."""
    held = call.state.runs.get(model_id)
    if held is None or not call.owns(held.owner):
        return Done(None)
    if seq_id < 1 or seq_id >= held.next_seq_id + call.limits.seq_window:
        return Done(None)
    request_id = events.request_id(model_id, seq_id)
    if request_id in call.state.requests or request_id in call.state.rejections:
        return Done(None)
    return _rejection(model_id, seq_id, error)


# -- what a caller may touch: the one decision -------------------------------------------------


def session(call: Call, session_id: str) -> jobs.SessionState:
    held = call.state.sessions.get(session_id)
    if held is None or not call.owns(held.owner):
        raise NotFound(f"no session {session_id!r:.200}; create one with create_session")
    return held


def run(call: Call, model_id: str) -> jobs.RunState:
    held = call.state.runs.get(model_id)
    if held is None or not call.owns(held.owner):
        raise NotFound(f"no training run with model_id {model_id!r:.200}")
    return held


def sampler(call: Call, sampler_id: str) -> jobs.SamplerState:
    held = call.state.samplers.get(sampler_id)
    if held is None or not call.owns(held.owner):
        raise NotFound(f"no sampler {sampler_id!r:.200}; create one with create_sampling_session")
    return held


def readable_checkpoint(call: Call, path: str) -> bus.WeightsSaved:
    """A checkpoint the caller may read: its own, or a published one."""
    tinker_path = str(artifacts.parse(path))
    held = call.state.checkpoints.get(tinker_path)
    if held is None or not (
        call.owns(call.state.owner_of(held.model_id)) or tinker_path in call.state.published
    ):
        raise NotFound(f"no checkpoint at {tinker_path}")
    return held


def tenants_usage(call: Call) -> dict[str, dict[str, int]]:
    """What each tenant holds now (sessions, runs, requests in flight, queued samples, bytes
    of checkpoints): the operators' view, for admin keys alone."""
    if not call.tenant.admin:
        raise Forbidden(
            "the engines view is the operators': it needs an admin key (`tinsmith keys create "
            "--tenant NAME --admin`)"
        )
    return {
        tenant: {
            "sessions": len(usage.session_ids),
            "runs": len(usage.run_ids),
            "inflight": usage.inflight,
            "queued_samples": usage.queued_samples,
            "checkpoint_bytes": usage.checkpoint_bytes,
        }
        for tenant, usage in sorted(call.state.tenants.items())
    }


def downloadable(call: Call, blob_key: str) -> str:
    """What is stored at ``blob_key``, if the caller may download it: a checkpoint of its own
    or a published one (its tinker:// path), or the trace of a session of its own (the
    session's id)."""
    traced = artifacts.trace_session(blob_key)
    if traced:
        held_session = call.state.sessions.get(traced)
        if held_session is None or not call.owns(held_session.owner):
            raise NotFound("the trace is not available: its session is not this tenant's")
        return traced
    for path, held in call.state.checkpoints.items():
        if held.blob_key == blob_key and (
            call.owns(call.state.owner_of(held.model_id)) or path in call.state.published
        ):
            return path
    raise NotFound("the file is no longer available: its checkpoint was deleted or unpublished")


# -- helpers -----------------------------------------------------------------------------------


def _new_run(call: Call, session_id: str, model_seq_id: int) -> tuple[jobs.SessionState, str]:
    """The session and model_id of a run being created (the SDK derives the id as
    ``<session_id>:train:<model_seq_id>`` too)."""
    owner = session(call, session_id)
    counter = _counter("model_seq_id", model_seq_id)
    model_id = subjects.check_id("model_id", f"{owner.session_id}:train:{counter}")
    held = call.state.runs.get(model_id)
    if held is not None and held.copied_from:
        raise InvalidRequest(
            f"model_seq_id {counter} of session {owner.session_id} holds a copy of "
            f"{held.copied_from} (copy_weights); create the run with another model_seq_id"
        )
    return owner, model_id


def _counter(name: str, value: int) -> int:
    """A client's counter that becomes part of an id (model_seq_id, sampling_session_seq_id)."""
    if not 0 <= value <= limits.INT32_MAX:
        raise InvalidRequest(f"field {name!r} must be in [0, {limits.INT32_MAX}], got {value}")
    return value


def _check_runs_quota(call: Call) -> None:
    loaded = _loaded_runs(call, call.tenant.name)
    quota = call.tenant.quotas.max_runs
    if loaded >= quota:
        raise QuotaExceeded(
            f"tenant {call.tenant.name} has {loaded} training runs loaded, its quota (max_runs, "
            f"TINSMITH_TENANT_MAX_RUNS) is {quota}: finish sessions it no longer uses "
            "(ServiceClient.close); a run the trainer unloads for idleness stops counting"
        )


def _check_inflight(call: Call) -> None:
    usage = call.state.usage(call.tenant.name)
    quota = call.tenant.quotas.max_inflight
    if usage.inflight >= quota:
        raise Overloaded(
            f"tenant {call.tenant.name} has {usage.inflight} requests accepted and not yet "
            f"finished, its quota (max_inflight, TINSMITH_TENANT_MAX_INFLIGHT) is {quota}; "
            "send it again later"
        )


def _check_metadata(call: Call, *parts: str | Iterable[str] | dict[str, str]) -> None:
    checks.check_metadata(call.limits.max_metadata_bytes, *parts)


def _existing(call: Call, aggregate_id: str, seq_id: int) -> Future | None:
    """The first future of a repeated (aggregate, seq_id): the SDK retries submissions. A repeat
    of a refused request is refused again, as it was the first time."""
    request_id = events.request_id(aggregate_id, seq_id)
    if request_id in call.state.requests:
        return Future(request_id, aggregate_id)
    rejected = call.state.rejections.get(request_id)
    if rejected is not None:
        raise from_kind(rejected.kind, rejected.detail)
    return None


def _accept_new_run(call: Call, model_id: str, command: bus.CreateModel) -> Decision[Future]:
    """A run's creation is its request 0."""
    _check_inflight(call)
    request_id = events.request_id(model_id, 0)
    accepted = bus.RequestAccepted(
        request_id=request_id, aggregate_id=model_id, seq_id=0, create_model=command
    )
    return Append(
        events.make(request_accepted=accepted), Future(request_id, model_id), msg_id=request_id
    )


def _submit(
    call: Call, held: jobs.RunState, seq_id: int, build: Callable[[], dict[str, Any]]
) -> Decision[Future]:
    """Accept one of a run's requests. A repeated seq_id gets the first future (or the first
    refusal); one too far ahead of the run, or beyond the tenant's in-flight quota, is refused
    with 429 and may come again later; otherwise ``build()`` validates and builds the command,
    and a refusal, whatever raised it, spends the seq_id: the run's later requests never wait
    for it."""
    if not 1 <= seq_id <= limits.INT32_MAX:
        raise InvalidRequest(f"field 'seq_id' must be in [1, {limits.INT32_MAX}], got {seq_id}")
    if held.copied_from:
        raise InvalidRequest(
            f"run {held.model_id} holds a copy of {held.copied_from} (copy_weights) and is "
            "never trained on; train on a run made from its checkpoint "
            "(ServiceClient.create_training_client_from_state)"
        )
    existing = _existing(call, held.model_id, seq_id)
    if existing is not None:
        return Done(existing)
    if seq_id < held.next_seq_id:
        # Neither pending nor refused, yet behind the run: settled so long ago that its outcome
        # expired and the projection forgot it (jobs.Projection.prune). Its effect is in the
        # run's weights; accepted again, it would wait for a turn that passed long ago.
        raise Unprocessable(
            f"seq_id {seq_id} of run {held.model_id} was settled long ago and its outcome has "
            f"expired (outcomes are kept for TINSMITH_RESULTS_MAX_AGE_S); a seq_id is used once: "
            f"send new work with seq_id {held.next_seq_id} or later"
        )
    window = call.limits.seq_window
    if seq_id >= held.next_seq_id + window:
        raise Overloaded(
            f"seq_id {seq_id} is {seq_id - held.next_seq_id} ahead of run {held.model_id}'s "
            f"next request ({held.next_seq_id}); at most {window - 1} ahead are accepted "
            "(TINSMITH_SEQ_WINDOW): send the earlier ones first"
        )
    _check_inflight(call)
    try:
        fields = build()
    except TinsmithError as error:
        return _rejection(held.model_id, seq_id, error)
    except Exception as exc:
        failure = InternalError(f"validating the request failed inside the gateway: {exc!r}")
        failure.__cause__ = exc
        return _rejection(held.model_id, seq_id, failure)
    request_id = events.request_id(held.model_id, seq_id)
    accepted = bus.RequestAccepted(
        request_id=request_id, aggregate_id=held.model_id, seq_id=seq_id, **fields
    )
    return Append(
        events.make(request_accepted=accepted),
        Future(request_id, held.model_id),
        msg_id=request_id,
    )


def _rejection(model_id: str, seq_id: int, error: TinsmithError) -> Refuse:
    rejected = bus.RequestRejected(
        aggregate_id=model_id, seq_id=seq_id, kind=error.kind, detail=error.detail
    )
    return Refuse(
        events.make(request_rejected=rejected), error, events.request_id(model_id, seq_id)
    )
