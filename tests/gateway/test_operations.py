"""Every operation's decisions, against a projection folded from a hand-written log: who may do
what (the owner, another tenant), quotas, and what is appended. Pure: milliseconds each."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import pytest

from services.gateway import operations as ops
from tinsmith import events, jobs
from tinsmith._proto import bus_pb2 as bus
from tinsmith._proto import tinker_public_pb2 as tp
from tinsmith.failures import (
    InvalidRequest,
    NotFound,
    Overloaded,
    QuotaExceeded,
    TinsmithError,
    Unprocessable,
)
from tinsmith.limits import Limits
from tinsmith.tenants import Quotas, Tenant

NOW = 1_000_000.0
ALICE = Tenant("alice", Quotas())
BOB = Tenant("bob", Quotas())
ADMIN = Tenant("ops", Quotas(), admin=True)
BASE = "tinsmith/tiny"
RUN = "SA:train:0"
SAMPLER = "SA:sample:0"
PRIVATE = f"tinker://{RUN}/weights/private"
PUBLIC = f"tinker://{RUN}/sampler_weights/public"


def _at(time: float, **kind: Any) -> bus.Event:
    event = events.make(**kind)
    event.time = time
    return event


def _log() -> list[bus.Event]:
    """Alice: a session SA with a run, a sampler, a private and a published checkpoint, and a
    pending sample request. Bob: an empty session SB."""
    accepted = bus.RequestAccepted(
        request_id=f"{RUN}:0",
        aggregate_id=RUN,
        seq_id=0,
        create_model=bus.CreateModel(
            session_id="SA", base_model=BASE, lora=bus.LoraConfig(rank=8, train_mlp=True)
        ),
    )
    saved = [
        bus.WeightsSaved(
            model_id=RUN,
            tinker_path=path,
            blob_key=f"key/{name}",
            kind=kind,
            base_model=BASE,
            lora_rank=8,
            size_bytes=1000,
        )
        for path, name, kind in (
            (PRIVATE, "private", bus.CHECKPOINT_KIND_TRAINING),
            (PUBLIC, "public", bus.CHECKPOINT_KIND_SAMPLER),
        )
    ]
    sample = bus.RequestAccepted(
        request_id=f"{SAMPLER}:0",
        aggregate_id=SAMPLER,
        seq_id=0,
        sample=bus.Sample(base_model=BASE, prompt=[1, 2], num_samples=1),
    )
    return [
        _at(NOW, session_created=bus.SessionCreated(session_id="SA", owner="alice")),
        _at(NOW, session_created=bus.SessionCreated(session_id="SB", owner="bob")),
        _at(NOW, request_accepted=accepted),
        _at(NOW, run_created=bus.RunCreated(model_id=RUN, tokenizer_id=BASE)),
        _at(
            NOW,
            request_completed=bus.RequestCompleted(request_id=f"{RUN}:0", aggregate_id=RUN),
        ),
        *(_at(NOW, weights_saved=s) for s in saved),
        _at(
            NOW,
            checkpoint_published=bus.CheckpointPublished(
                model_id=RUN, tinker_path=PUBLIC, public=True
            ),
        ),
        _at(
            NOW,
            sampler_created=bus.SamplerCreated(
                sampler_id=SAMPLER, session_id="SA", base_model=BASE
            ),
        ),
        _at(NOW, request_accepted=sample),
    ]


def _state(*more: bus.Event) -> jobs.Projection:
    state = jobs.Projection()
    for seq, event in enumerate([*_log(), *more], start=1):
        state.apply(seq, event)
    return state


def _call(tenant: Tenant, state: jobs.Projection | None = None, **changes: Any) -> ops.Call:
    call = ops.Call(
        tenant=tenant,
        state=state or _state(),
        limits=Limits(),
        sampler_queue_limit=100,
        now=NOW,
        new_id="new-session",
        stream_id="replica",
    )
    return replace(call, **changes)


def _detail(fn: Any, *args: Any) -> tuple[type[TinsmithError], str]:
    with pytest.raises(TinsmithError) as raised:
        fn(*args)
    return type(raised.value), raised.value.detail


def _optim(model_id: str = RUN, seq_id: int = 1) -> ops.OptimStep:
    return ops.OptimStep(model_id, seq_id, bus.AdamParams(learning_rate=1e-4, eps=1e-12))


def _fwdbwd(model_id: str = RUN, seq_id: int = 1, tokens: tuple[int, ...] = (1, 2, 3)) -> Any:
    request = tp.ForwardBackwardRequest(model_id=model_id, seq_id=seq_id, loss_fn="cross_entropy")
    datum = request.data.add()
    datum.model_input.add().encoded_text.tokens = b"".join(t.to_bytes(4, "little") for t in tokens)
    for name, dtype, values in (
        ("target_tokens", tp.DTYPE_INT64, b"".join(t.to_bytes(8, "little") for t in tokens)),
        ("weights", tp.DTYPE_FLOAT32, b"\x00\x00\x80\x3f" * len(tokens)),
    ):
        tensor = datum.loss_fn_inputs[name]
        tensor.dtype = dtype
        tensor.shape.append(len(tokens))
        tensor.dense = values
    return ops.ForwardBackward(request)


def _sample(sampler_id: str = SAMPLER, seq_id: int = 1) -> ops.Sample:
    command = bus.Sample(prompt=[1, 2, 3], params=tp.SamplingParams(max_tokens=4), num_samples=1)
    return ops.Sample(sampler_id, seq_id, command)


# Every operation on something of Alice's, as Bob calls it, and as anyone calls it on an id that
# does not exist: the same 404 with the same detail.
CROSS_TENANT = {
    "heartbeat": (ops.heartbeat, ops.SessionRef("SA"), ops.SessionRef("SX")),
    "finish_session": (ops.finish_session, ops.SessionRef("SA"), ops.SessionRef("SX")),
    "create_model": (
        ops.create_model,
        ops.CreateModel("SA", 1, BASE, bus.LoraConfig(rank=8, train_mlp=True)),
        ops.CreateModel("SX", 1, BASE, bus.LoraConfig(rank=8, train_mlp=True)),
    ),
    "load_state": (
        ops.load_state,
        ops.LoadState("SA", 1, PUBLIC),
        ops.LoadState("SX", 1, PUBLIC),
    ),
    "load_weights": (
        ops.load_weights,
        ops.LoadWeights(RUN, 1, PRIVATE),
        ops.LoadWeights("SX:train:0", 1, PRIVATE),
    ),
    "get_info": (ops.get_info, ops.ModelRef(RUN), ops.ModelRef("SX:train:0")),
    "forward_backward": (ops.forward_backward, _fwdbwd(), _fwdbwd("SX:train:0")),
    "optim_step": (ops.optim_step, _optim(), _optim("SX:train:0")),
    "save_weights": (
        ops.save_weights,
        ops.SaveWeights(RUN, 1, bus.CHECKPOINT_KIND_TRAINING, name="mine"),
        ops.SaveWeights("SX:train:0", 1, bus.CHECKPOINT_KIND_TRAINING, name="mine"),
    ),
    "create_sampler": (
        ops.create_sampler,
        ops.CreateSampler("SA", 5, BASE),
        ops.CreateSampler("SX", 5, BASE),
    ),
    "get_sampler": (ops.get_sampler, ops.SamplerRef(SAMPLER), ops.SamplerRef("SX:sample:0")),
    "sample": (ops.sample, _sample(), _sample("SX:sample:0")),
    "future": (ops.future, f"{SAMPLER}:0", "SX:sample:0:0"),
    "cancel_sample": (
        ops.cancel_sample,
        ops.RequestRef(f"{SAMPLER}:0"),
        ops.RequestRef("SX:sample:0:0"),
    ),
    "private checkpoint": (ops.readable_checkpoint, PRIVATE, f"tinker://{RUN}/weights/none"),
    "private download": (ops.downloadable, "key/private", "key/none"),
}


@pytest.mark.parametrize("name", CROSS_TENANT)
def test_another_tenant_is_told_nothing_exists(name: str) -> None:
    op, theirs, missing = CROSS_TENANT[name]
    state = _state()
    kind, detail = _detail(op, _call(BOB, state), theirs)
    assert kind is NotFound
    alike = _detail(op, _call(BOB, state), missing)
    assert alike == (NotFound, detail.replace(_id_in(theirs), _id_in(missing)))
    assert state.position == len(_log())  # nothing was appended or changed


def _id_in(request: Any) -> str:
    """The id a request names (the only difference a 404 detail may show)."""
    if isinstance(request, str):
        return request
    if isinstance(request, ops.ForwardBackward):
        return request.request.model_id
    for field in ("session_id", "model_id", "sampler_id", "request_id"):
        if hasattr(request, field):
            return str(getattr(request, field))
    raise AssertionError(request)


@pytest.mark.parametrize("name", [n for n in CROSS_TENANT if n not in ("private download",)])
def test_the_owner_gets_past_the_owner_check(name: str) -> None:
    op, theirs, _ = CROSS_TENANT[name]
    try:
        op(_call(ALICE), theirs)
    except NotFound as error:  # pragma: no cover - the assertion says which
        pytest.fail(f"{name}: the owner was refused: {error.detail}")
    except TinsmithError:
        pass  # a later check of the request itself; the owner check passed


def test_front_running_another_tenants_run_spends_none_of_its_seq_ids() -> None:
    state = _state()
    for request in (_optim(seq_id=1), _fwdbwd(seq_id=1)):
        op = ops.optim_step if isinstance(request, ops.OptimStep) else ops.forward_backward
        with pytest.raises(NotFound):
            op(_call(BOB, state), request)
    decision = ops.spend_refused(
        _call(BOB, state), InvalidRequest("too large"), RUN, state.runs[RUN].next_seq_id
    )
    assert isinstance(decision, ops.Done)
    mine = ops.optim_step(_call(ALICE, state), _optim(seq_id=1))
    assert isinstance(mine, ops.Append)


def test_a_published_checkpoint_is_readable_by_any_tenant_and_nothing_else_of_its_run() -> None:
    state = _state()
    assert ops.readable_checkpoint(_call(BOB, state), PUBLIC).blob_key == "key/public"
    assert ops.downloadable(_call(BOB, state), "key/public") == PUBLIC
    created = ops.create_sampler(_call(BOB, state), ops.CreateSampler("SB", 0, "", PUBLIC))
    assert isinstance(created, ops.Append)
    assert created.event.sampler_created.adapter_key == "key/public"
    assert created.answer == "SB:sample:0"
    with pytest.raises(NotFound):
        ops.create_sampler(_call(BOB, state), ops.CreateSampler("SB", 0, "", PRIVATE))
    with pytest.raises(NotFound):
        ops.get_info(_call(BOB, state), ops.ModelRef(RUN))


def test_unpublishing_or_deleting_closes_it_again() -> None:
    unpublished = _at(
        NOW,
        checkpoint_published=bus.CheckpointPublished(
            model_id=RUN, tinker_path=PUBLIC, public=False
        ),
    )
    with pytest.raises(NotFound):
        ops.readable_checkpoint(_call(BOB, _state(unpublished)), PUBLIC)
    deleted = _at(
        NOW,
        checkpoint_deleted=bus.CheckpointDeleted(
            model_id=RUN, tinker_path=PUBLIC, blob_key="key/public"
        ),
    )
    state = _state(deleted)
    with pytest.raises(NotFound):
        ops.downloadable(_call(ALICE, state), "key/public")
    assert PUBLIC not in state.published
    assert state.usage("alice").checkpoint_bytes == 1000


def test_loading_another_tenants_private_checkpoint_into_a_run_spends_the_seq_id() -> None:
    state = _state(_at(NOW, session_created=bus.SessionCreated(session_id="SC", owner="bob")))
    bob_run = bus.RequestAccepted(
        request_id="SC:train:0:0",
        aggregate_id="SC:train:0",
        seq_id=0,
        create_model=bus.CreateModel(
            session_id="SC", base_model=BASE, lora=bus.LoraConfig(rank=8, train_mlp=True)
        ),
    )
    state.apply(state.position + 1, _at(NOW, request_accepted=bob_run))
    decision = ops.load_weights(_call(BOB, state), ops.LoadWeights("SC:train:0", 1, PRIVATE))
    assert isinstance(decision, ops.Refuse)
    assert isinstance(decision.error, NotFound)
    assert decision.event.request_rejected.seq_id == 1
    assert decision.msg_id == "SC:train:0:1"


def test_create_session_records_its_tenant() -> None:
    decision = ops.create_session(_call(ALICE), ops.CreateSession(tags=("a",)))
    assert isinstance(decision, ops.Append)
    assert decision.answer == "new-session"
    assert decision.event.session_created.owner == "alice"
    assert decision.aggregate == "session"


def test_the_sessions_quota_counts_open_and_active_sessions() -> None:
    tenant = Tenant("alice", Quotas(max_sessions=1))
    kind, detail = _detail(ops.create_session, _call(tenant), ops.CreateSession())
    assert kind is QuotaExceeded
    assert "max_sessions" in detail and "TINSMITH_TENANT_MAX_SESSIONS" in detail
    finished = _at(NOW, session_finished=bus.SessionFinished(session_id="SA"))
    assert isinstance(
        ops.create_session(_call(tenant, _state(finished)), ops.CreateSession()), ops.Append
    )
    later = NOW + 2 * 3600  # SA has been idle for two hours
    assert isinstance(ops.create_session(_call(tenant, now=later), ops.CreateSession()), ops.Append)


def test_the_runs_quota_counts_loaded_runs_in_open_sessions() -> None:
    tenant = Tenant("alice", Quotas(max_runs=1))
    create = ops.CreateModel("SA", 1, BASE, bus.LoraConfig(rank=8, train_mlp=True))
    kind, detail = _detail(ops.create_model, _call(tenant), create)
    assert kind is QuotaExceeded and "max_runs" in detail
    unloaded = _at(NOW, run_unloaded=bus.RunUnloaded(model_id=RUN, snapshot_key="s"))
    decision = ops.create_model(_call(tenant, _state(unloaded)), create)
    assert isinstance(decision, ops.Append)
    assert decision.answer == ops.Future("SA:train:1:0", "SA:train:1")


def test_the_checkpoint_bytes_quota_refuses_saves_and_spends_the_seq_id() -> None:
    tenant = Tenant("alice", Quotas(max_checkpoint_bytes=2000))
    save = ops.SaveWeights(RUN, 1, bus.CHECKPOINT_KIND_TRAINING, name="more")
    decision = ops.save_weights(_call(tenant), save)
    assert isinstance(decision, ops.Refuse)
    assert isinstance(decision.error, QuotaExceeded)
    assert "2000 bytes" in decision.error.detail or "MiB" in decision.error.detail
    roomy = Tenant("alice", Quotas(max_checkpoint_bytes=2001))
    assert isinstance(ops.save_weights(_call(roomy), save), ops.Append)


def test_in_flight_and_sampling_queue_shares_are_429() -> None:
    busy = Tenant("alice", Quotas(max_inflight=1))
    kind, detail = _detail(ops.optim_step, _call(busy), _optim())
    assert kind is Overloaded and "max_inflight" in detail
    share = Tenant("alice", Quotas(max_queued_samples=1))
    kind, detail = _detail(ops.sample, _call(share), _sample())
    assert kind is Overloaded and "max_queued_samples" in detail
    # Bob's share is his own: Alice's queued request takes nothing of it.
    state = _state()
    bob = Tenant("bob", Quotas(max_queued_samples=1))
    created = ops.create_sampler(_call(bob, state), ops.CreateSampler("SB", 0, BASE))
    assert isinstance(created, ops.Append)
    state.apply(state.position + 1, created.event)
    assert isinstance(ops.sample(_call(bob, state), _sample("SB:sample:0")), ops.Append)
    kind, _ = _detail(ops.sample, _call(bob, state, sampler_queue_limit=1), _sample("SB:sample:0"))
    assert kind is Overloaded  # the global queue: one request waits already


def test_a_repeated_request_gets_its_first_future_and_a_refused_one_its_refusal() -> None:
    state = _state()
    assert ops.create_model(
        _call(ALICE, state), ops.CreateModel("SA", 0, BASE, bus.LoraConfig(rank=8, train_mlp=True))
    ) == ops.Done(ops.Future(f"{RUN}:0", RUN))
    refused = ops.optim_step(_call(ALICE, state), _optim(seq_id=1))
    assert isinstance(refused, ops.Append)
    rejected = bus.RequestRejected(aggregate_id=RUN, seq_id=2, kind="invalid_request", detail="d")
    state.apply(state.position + 1, _at(NOW, request_rejected=rejected))
    assert _detail(ops.optim_step, _call(ALICE, state), _optim(seq_id=2)) == (InvalidRequest, "d")


def test_a_repeat_of_a_request_forgotten_since_is_refused_not_run_again() -> None:
    """Completed, its result expired and the projection pruned it: its seq_id is behind the run,
    and a repeat is a 422 that names the next seq_id (accepted again, it would wait forever)."""
    accepted = bus.RequestAccepted(
        request_id=f"{RUN}:1",
        aggregate_id=RUN,
        seq_id=1,
        optim_step=bus.OptimStep(adam=bus.AdamParams(learning_rate=1e-4)),
    )
    done = bus.RequestCompleted(request_id=f"{RUN}:1", aggregate_id=RUN, result_seq=5)
    snapshot = bus.RunSnapshotted(model_id=RUN, snapshot_key="runs/x", next_seq_id=2)
    state = _state(
        _at(NOW, request_accepted=accepted),
        _at(NOW, request_completed=done),
        _at(NOW, run_snapshotted=snapshot),
    )
    assert ops.optim_step(_call(ALICE, state), _optim(seq_id=1)) == ops.Done(
        ops.Future(f"{RUN}:1", RUN)
    )
    assert state.prune(results_from=6) == 1
    kind, detail = _detail(ops.optim_step, _call(ALICE, state), _optim(seq_id=1))
    assert kind is Unprocessable
    assert "seq_id 1 of run SA:train:0 was settled long ago" in detail
    assert "send new work with seq_id 2 or later" in detail
    assert isinstance(ops.optim_step(_call(ALICE, state), _optim(seq_id=2)), ops.Append)


def test_a_request_too_far_ahead_is_429_and_spends_nothing() -> None:
    kind, detail = _detail(ops.optim_step, _call(ALICE), _optim(seq_id=500))
    assert kind is Overloaded and "TINSMITH_SEQ_WINDOW" in detail


def test_validation_after_the_owner_check_spends_the_seq_id() -> None:
    decision = ops.forward_backward(_call(ALICE), _fwdbwd(tokens=(1, 99999)))
    assert isinstance(decision, ops.Refuse)
    assert "outside the vocabulary" in decision.error.detail
    assert decision.event.request_rejected.aggregate_id == RUN


def test_lora_rank_is_bounded_by_the_server() -> None:
    create = ops.CreateModel("SA", 3, BASE, bus.LoraConfig(rank=4096, train_mlp=True))
    kind, detail = _detail(ops.create_model, _call(ALICE), create)
    assert kind is InvalidRequest and "TINSMITH_MAX_LORA_RANK" in detail


def test_a_stream_is_relayed_to_the_replica_that_accepted_it() -> None:
    request = replace(_sample(seq_id=7), stream=True)
    decision = ops.sample(_call(ALICE), request)
    assert isinstance(decision, ops.Append)
    command = decision.event.request_accepted.sample
    assert command.stream_to == "replica" and command.base_model == BASE
    assert decision.answer.sequence_ids == (f"{SAMPLER}:7:0",)


def test_usage_shows_a_tenant_its_own_and_an_admin_everyones() -> None:
    own = ops.usage(_call(ALICE)).answer["tenants"]
    assert [row["tenant"] for row in own] == ["alice"]
    assert own[0]["runs"] == 1 and own[0]["checkpoint_bytes"] == 2000
    assert own[0]["queued_samples"] == 1 and own[0]["quotas"]["max_runs"] == Quotas().max_runs
    everyone = ops.usage(_call(ADMIN)).answer["tenants"]
    assert {row["tenant"] for row in everyone} >= {"alice", "bob"}
    assert "quotas" not in next(row for row in everyone if row["tenant"] == "alice")


def test_rows_without_an_owner_belong_to_no_one() -> None:
    state = _state(_at(NOW, session_created=bus.SessionCreated(session_id="SO")))
    for tenant in (ALICE, BOB, Tenant("", Quotas())):
        with pytest.raises(NotFound):
            ops.heartbeat(_call(tenant, state), ops.SessionRef("SO"))
