"""Fused training on tinsmith/tiny: runs of different ranks, targets and losses trained in one
pass each get what they get alone (outputs, gradients, and weights after optim_step, to 1e-5 in
float32); a request that is invalid or whose loss is not finite fails alone in the pass; what the
engine will not fuse it hands back to be run alone; and the trainer fuses the forward_backwards
of runs that are ready together."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pytest
import torch

from services import lora_slots
from services.trainer import engine as engine_module
from services.trainer import fusion
from services.trainer.engine import TrainerEngine
from services.trainer.fusion import default_limits
from tests.calls import record_calls
from tests.trainer.test_memory import TINY, _engine, _outputs, _request
from tests.trainer.test_work_loop import Harness, _batch, _diverging
from tinsmith import jobs
from tinsmith._proto import bus_pb2 as bus
from tinsmith._proto import tinker_public_pb2 as tp
from tinsmith.eventlog import EventLog
from tinsmith.failures import InvalidRequest, Unprocessable

TOLERANCE = 1e-5
CPU = torch.device("cpu")
# AdamW's first steps move each weight by about lr * g / (|g| + eps) whatever the size of g, so
# a gradient element near zero carries its float32 rounding (1e-11, where a pass's shapes
# differ) into the weights as lr * 1e-11 / eps: 1e-5 at lr 1e-2 and eps 1e-8. At a LoRA learning
# rate (1e-3 here; the cookbook's are 1e-4 to 5e-4) the weights agree to the tolerance.
FUSED_ADAM = bus.AdamParams(
    learning_rate=1e-3, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.01, grad_clip_norm=1.0
)


@pytest.fixture
async def harness(eventlog: EventLog, nats_url: str, tmp_path: Path) -> Harness:
    harness = Harness(eventlog, nats_url, tmp_path / "blobs")
    await harness.projection.start()
    return harness


@dataclasses.dataclass(frozen=True)
class Tenant:
    model_id: str
    rank: int
    loss_fn: str
    lengths: tuple[int, ...]
    attn: bool = True
    mlp: bool = True
    unembed: bool = True
    k: int = 0  # cross-entropy targets per position (with weights); 0: one, unweighted
    config: tuple[tuple[str, float], ...] = ()  # its loss_fn_config


# Ranks in two rank classes (8 and 16), three losses, and adapters on different modules.
TENANTS = (
    Tenant("four", 4, "cross_entropy", (9, 23)),
    Tenant("eight", 8, "importance_sampling", (5,), mlp=False),
    Tenant("sixteen", 16, "ppo", (17, 3, 11), attn=False),
)
# Ranks of one class (16) with as many datums each: on the CPU, where torch's grouped matmul
# does not run float32, the runs' rows are one batched product, added into the base output in
# one call on the modules that every run trains (the attention), and by ranges elsewhere.
ONE_CLASS = (
    Tenant("twelve", 12, "cross_entropy", (9, 23)),
    Tenant("sixteen", 16, "importance_sampling", (30, 4)),
    Tenant("also sixteen", 16, "ppo", (17, 3), mlp=False),
)
# The losses the others leave out, each with a loss_fn_config of its own where it reads one,
# beside top-2 cross-entropy targets with weights; ranks from 1 to 32.
EVERY_LOSS = (
    Tenant("one", 1, "cross_entropy", (10, 3), k=2),
    Tenant("two", 2, "cispo", (12, 7), mlp=False, config=(("clip_high_threshold", 1.1),)),
    Tenant("eight", 8, "gspo", (6, 15, 4), unembed=False, config=(("clip_low_threshold", 0.9),)),
    Tenant("thirty-two", 32, "dro", (19,), attn=False, config=(("beta", 0.1),)),
)


def _create(engine: TrainerEngine, tenant: Tenant, seed: int) -> None:
    lora = bus.LoraConfig(
        rank=tenant.rank,
        seed=seed,
        train_attn=tenant.attn,
        train_mlp=tenant.mlp,
        train_unembed=tenant.unembed,
    )
    command = bus.CreateModel(session_id="S", base_model=TINY, lora=lora)
    engine.create_run(tenant.model_id, command)


def _engines(tenants: tuple[Tenant, ...] = TENANTS) -> tuple[TrainerEngine, TrainerEngine]:
    fused, alone = _engine(), _engine()
    for engine in (fused, alone):
        for n, tenant in enumerate(tenants):
            _create(engine, tenant, seed=10 + n)
    return fused, alone


def _requests(
    step: int, forward_only: bool = False, tenants: tuple[Tenant, ...] = TENANTS
) -> list[tp.ForwardBackwardRequest]:
    requests = []
    for n, tenant in enumerate(tenants):
        request = _request(100 * step + n, tenant.lengths, tenant.loss_fn, k=tenant.k)
        request.loss_fn_config.update(dict(tenant.config))
        request.forward_only = forward_only
        requests.append(request)
    return requests


def _max_gap(a: bytes, b: bytes) -> float:
    (lp_a, el_a, m_a), (lp_b, el_b, m_b) = _outputs(a), _outputs(b)
    gaps = [float(np.abs(x - y).max()) for x, y in zip([*lp_a, *el_a], [*lp_b, *el_b], strict=True)]
    assert m_a.keys() == m_b.keys()
    gaps += [abs(m_a[k] - m_b[k]) / max(1.0, abs(m_b[k])) for k in m_a]
    return max(gaps)


def _tensors(engine: TrainerEngine, model_id: str, grads: bool) -> dict[str, torch.Tensor | None]:
    params = engine.runs[model_id].params
    if grads:
        return {n: None if p.grad is None else p.grad.clone() for n, p in params.items()}
    return {n: p.detach().clone() for n, p in params.items()}


def _largest(tensors: dict[str, torch.Tensor | None]) -> float:
    return max(float(t.abs().max()) for t in tensors.values() if t is not None)


def _tensor_gap(a: dict[str, torch.Tensor | None], b: dict[str, torch.Tensor | None]) -> float:
    assert a.keys() == b.keys()
    gap = 0.0
    for name, x in a.items():
        y = b[name]
        assert (x is None) == (y is None), name
        if x is not None and y is not None:
            gap = max(gap, float((x - y).abs().max()))
    return gap


@pytest.mark.parametrize(
    "tenants", [TENANTS, ONE_CLASS, EVERY_LOSS], ids=["two rank classes", "one class", "every loss"]
)
def test_runs_trained_in_one_pass_get_what_each_gets_alone(
    tenants: tuple[Tenant, ...], monkeypatch: pytest.MonkeyPatch
) -> None:
    batched = record_calls(monkeypatch, torch.Tensor, "baddbmm_")
    fused, alone = _engines(tenants)
    for step in range(2):
        requests = _requests(step, tenants=tenants)
        together = fused.forward_backward_together(
            [(t.model_id, r) for t, r in zip(tenants, requests, strict=True)]
        )
        assert all(isinstance(out, bytes) for out in together), together  # one pass, no fallback
        for tenant, request, out in zip(tenants, requests, together, strict=True):
            assert isinstance(out, bytes)
            by_itself = alone.forward_backward(tenant.model_id, request)
            assert _max_gap(out, by_itself) <= TOLERANCE, tenant
            grads = _tensors(fused, tenant.model_id, grads=True)
            own = _tensors(alone, tenant.model_id, grads=True)
            # Summed losses give gradients of tens (the CISPO run's reach 60): float32 rounds
            # them relative to their size.
            assert _tensor_gap(grads, own) <= TOLERANCE * max(1.0, _largest(own)), tenant
            # Each run's gradient comes from its own rows: every tensor of its adapter has one.
            assert all(g is not None for g in grads.values())
        stepped = fused.optim_step_together([(t.model_id, FUSED_ADAM) for t in tenants])
        for tenant, metrics in zip(tenants, stepped, strict=True):
            assert isinstance(metrics, dict)
            assert metrics.keys() == alone.optim_step(tenant.model_id, FUSED_ADAM).keys()
            gap = _tensor_gap(
                _tensors(fused, tenant.model_id, grads=False),
                _tensors(alone, tenant.model_id, grads=False),
            )
            assert gap <= TOLERANCE, tenant

    # Forwards go together too, and change no gradient.
    requests = _requests(7, forward_only=True, tenants=tenants)
    together = fused.forward_backward_together(
        [(t.model_id, r) for t, r in zip(tenants, requests, strict=True)]
    )
    for tenant, request, out in zip(tenants, requests, together, strict=True):
        assert isinstance(out, bytes)
        assert _max_gap(out, alone.forward_backward(tenant.model_id, request)) <= TOLERANCE
        assert all(p.grad is None for p in fused.runs[tenant.model_id].params.values())
    # Runs of one rank class with as many rows are one batched product on the CPU, else not.
    assert bool(batched) == (tenants is ONE_CLASS and not lora_slots._grouped_mm_works(CPU))


def _adam_state(engine: TrainerEngine, model_id: str) -> list[torch.Tensor]:
    run = engine.runs[model_id]
    state = [run.optimizer.state.get(p, {}) for p in run.params.values()]
    return [value for entry in state for value in entry.values()]


def _same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


# Each tenant's own AdamW settings: two share them (one parameter group), one does not.
ADAMS = (
    FUSED_ADAM,
    FUSED_ADAM,
    bus.AdamParams(learning_rate=3e-4, beta1=0.8, beta2=0.99, eps=1e-6, weight_decay=0.1),
)


@pytest.fixture(params=["one group", "a group a run"])
def step_groups(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """On the CPU a joint optim_step computes its runs in groups of at most
    ``CPU_STEP_GROUP_BYTES`` of weights: the tiny runs here fit one group, and with a bound of
    one byte each run is a group of its own."""
    if request.param == "a group a run":
        monkeypatch.setattr(engine_module, "CPU_STEP_GROUP_BYTES", 1)
    return str(request.param)


@pytest.mark.usefixtures("step_groups")
def test_optim_steps_taken_together_are_what_each_takes_alone() -> None:
    """Runs at different step counts, with different AdamW settings, stepped at once: the same
    weights, AdamW state and metrics as each stepped alone, bit for bit."""
    fused, alone = _engines()
    for step in range(3):
        stepping = TENANTS if step != 1 else TENANTS[1:]  # "four" skips a step
        for engine in (fused, alone):
            for tenant, request in zip(TENANTS, _requests(step), strict=True):
                if tenant in stepping:
                    engine.forward_backward(tenant.model_id, request)
        adams = [ADAMS[TENANTS.index(t)] for t in stepping]
        together = fused.optim_step_together(
            [(t.model_id, adam) for t, adam in zip(stepping, adams, strict=True)]
        )
        for tenant, adam, metrics in zip(stepping, adams, together, strict=True):
            assert metrics == alone.optim_step(tenant.model_id, adam), tenant
            weights = [_tensors(e, tenant.model_id, grads=False) for e in (fused, alone)]
            assert _tensor_gap(*weights) == 0
            assert _same(_adam_state(fused, tenant.model_id), _adam_state(alone, tenant.model_id))
            assert all(p.grad is None for p in fused.runs[tenant.model_id].params.values())
    counts = {float(s["step"]) for s in fused.runs["eight"].optimizer.state.values()}
    assert counts == {3.0} and {
        float(s["step"]) for s in fused.runs["four"].optimizer.state.values()
    } == {2.0}


@pytest.mark.usefixtures("step_groups")
def test_a_step_that_is_refused_in_a_joint_step_is_refused_alone() -> None:
    """Non-finite gradients, and a learning rate that makes the weights non-finite: each of those
    runs is refused with its weights, AdamW state and gradients as they were, and the third run
    steps as it would alone. A step size torch cannot represent hands every run back."""
    fused, alone = _engines()
    for engine in (fused, alone):
        for tenant, request in zip(TENANTS, _requests(0), strict=True):
            engine.forward_backward(tenant.model_id, request)
        for tenant in TENANTS:
            engine.optim_step(tenant.model_id, FUSED_ADAM)
        for tenant, request in zip(TENANTS, _requests(1), strict=True):
            engine.forward_backward(tenant.model_id, request)
    poisoned = next(iter(fused.runs["four"].params.values()))
    assert poisoned.grad is not None
    poisoned.grad[0, 0] = float("nan")
    before = {
        t.model_id: (_tensors(fused, t.model_id, False), _tensors(fused, t.model_id, True))
        for t in TENANTS
    }
    state = {t.model_id: [s.clone() for s in _adam_state(fused, t.model_id)] for t in TENANTS}
    huge = bus.AdamParams(learning_rate=float("inf"), beta1=0.9, beta2=0.95, eps=1e-8)
    results = fused.optim_step_together(
        [("four", FUSED_ADAM), ("eight", huge), ("sixteen", FUSED_ADAM)]
    )
    assert isinstance(results[0], Unprocessable) and "gradients" in results[0].detail
    assert isinstance(results[1], Unprocessable) and "learning rate inf" in results[1].detail
    for model_id in ("four", "eight"):  # as they were
        weights, grads = before[model_id]
        assert _tensor_gap(_tensors(fused, model_id, False), weights) == 0
        assert _tensor_gap(_tensors(fused, model_id, True), grads) == 0
        assert _same(_adam_state(fused, model_id), state[model_id])
    assert results[2] == alone.optim_step("sixteen", FUSED_ADAM)
    assert _tensor_gap(_tensors(fused, "sixteen", False), _tensors(alone, "sixteen", False)) == 0

    # Beyond float32: torch refuses the step, and it is not known whose step it was.
    overflow = bus.AdamParams(learning_rate=1e39, beta1=0.9, beta2=0.95, eps=1e-8)
    fused.forward_backward("sixteen", _requests(2)[2])
    assert fused.optim_step_together([("eight", FUSED_ADAM), ("sixteen", overflow)]) == [None] * 2
    assert _tensor_gap(_tensors(fused, "eight", True), before["eight"][1]) == 0
    with pytest.raises(Unprocessable, match="learning rate 1e"):
        fused.optim_step("sixteen", overflow)
    # A run named twice, or not here, is handed back too.
    assert fused.optim_step_together([("eight", FUSED_ADAM), ("eight", FUSED_ADAM)])[1] is None
    assert fused.optim_step_together([("eight", FUSED_ADAM), ("gone", FUSED_ADAM)])[1] is None


def test_a_request_that_fails_in_a_pass_fails_alone() -> None:
    fused, alone = _engines()
    first = _requests(0)
    fused.forward_backward_together([(t.model_id, r) for t, r in zip(TENANTS, first, strict=True)])
    before = {t.model_id: _tensors(fused, t.model_id, grads=True) for t in TENANTS}
    for tenant, request in zip(TENANTS, first, strict=True):
        alone.forward_backward(tenant.model_id, request)

    invalid = _request(1, (6,))
    invalid.data[0].loss_fn_inputs["target_tokens"].CopyFrom(
        tp.Tensor(dense=np.full(6, 10_000, "<i8").tobytes(), dtype=tp.DTYPE_INT64, shape=[6])
    )
    clean = _request(2, (8, 4))
    results = fused.forward_backward_together(
        [("four", invalid), ("eight", _diverging(3)), ("sixteen", clean)]
    )

    assert isinstance(results[0], InvalidRequest) and "datum 0" in results[0].detail
    assert isinstance(results[1], Unprocessable) and "not finite" in results[1].detail
    for model_id in ("four", "eight"):  # as they were
        assert _tensor_gap(_tensors(fused, model_id, grads=True), before[model_id]) == 0
    assert isinstance(results[2], bytes)
    assert _max_gap(results[2], alone.forward_backward("sixteen", clean)) <= TOLERANCE
    gap = _tensor_gap(_tensors(fused, "sixteen", grads=True), _tensors(alone, "sixteen", True))
    assert gap <= TOLERANCE


def test_what_the_engine_does_not_fuse_it_hands_back_to_run_alone() -> None:
    fused, _ = _engines()
    request = _request(0, (9, 23))
    # Twice the same run, a forward with a forward_backward, a run that is not here.
    forward = _request(1, (5,))
    forward.forward_only = True
    for asks in (
        [("four", request), ("four", request)],
        [("four", request), ("eight", forward)],
    ):
        assert fused.forward_backward_together(asks) == [None, None]
    assert fused.forward_backward_together([("four", request), ("gone", request)])[1] is None
    # A pass that does not fit what is free of the budget in one go.
    need = fused.activation_bytes(TINY, [9, 23, 9, 23], backward=True)
    fused.placement = dataclasses.replace(
        fused.placement, memory_bytes=fused.held_bytes() + need // 2
    )
    assert fused.forward_backward_together([("four", request), ("eight", request)]) == [None] * 2
    assert all(p.grad is None for run in fused.runs.values() for p in run.params.values())


async def test_the_trainer_fuses_the_runs_that_are_ready_together(harness: Harness) -> None:
    models_ = ("fa", "fb", "fc")
    reference = _engine()
    async with harness.trainer() as trainer:
        created = [await harness.create(m) for m in models_]
        await harness.settled(*created)
        for m in models_:
            reference.create_run(
                m,
                bus.CreateModel(
                    session_id="S",
                    base_model=TINY,
                    lora=bus.LoraConfig(
                        rank=4, seed=1, train_mlp=True, train_attn=True, train_unembed=True
                    ),
                ),
            )
        # The compute thread is busy while the three requests come: they go as one pass.
        async with harness.compute_held(trainer, waiting=3):
            asked = [
                await harness.accept(m, 1, forward_backward=_batch(n))
                for n, m in enumerate(models_)
            ]
        outcomes = await harness.settled(*asked)
        assert all(o.status is jobs.Status.COMPLETED for o in outcomes)
        assert trainer.fuser.fused_passes == 1
        for n, m in enumerate(models_):
            reference.forward_backward(m, _batch(n))
            gap = _tensor_gap(_tensors(trainer.engine, m, True), _tensors(reference, m, True))
            assert gap <= TOLERANCE, m

        # Their optim_steps, ready together, are one AdamW step.
        step = bus.OptimStep(adam=FUSED_ADAM)
        async with harness.compute_held(trainer, waiting=3):
            asked = [await harness.accept(m, 2, optim_step=step) for m in models_]
        outcomes = await harness.settled(*asked)
        assert all(o.status is jobs.Status.COMPLETED for o in outcomes)
        assert trainer.fuser.fused_steps == 1
        for m in models_:
            reference.optim_step(m, FUSED_ADAM)
            gap = _tensor_gap(_tensors(trainer.engine, m, False), _tensors(reference, m, False))
            assert gap <= TOLERANCE, m


async def test_a_trainer_fuses_within_its_devices_limits_unless_told(harness: Harness) -> None:
    async with harness.trainer() as trainer:
        limits = (trainer.fuser.token_budget, trainer.fuser.request_tokens)
        assert limits == default_limits(trainer.engine.placement.device) == (2048, 128)
    async with harness.trainer(fuse_tokens=300, fuse_request_tokens=30) as trainer:
        assert (trainer.fuser.token_budget, trainer.fuser.request_tokens) == (300, 30)


@pytest.mark.parametrize(
    "settings",
    [{"fuse_tokens": 0}, {"fuse_request_tokens": 21}],
    ids=["no budget", "requests larger than fused ones"],
)
async def test_requests_the_settings_keep_apart_run_alone(
    harness: Harness, settings: dict[str, int]
) -> None:
    """Both requests are 22 tokens: with no budget, or fusing up to 21 tokens a request, each
    runs alone."""
    async with harness.trainer(**settings) as trainer:
        created = [await harness.create(m) for m in ("za", "zb")]
        await harness.settled(*created)
        async with harness.compute_held(trainer, waiting=2):
            asked = [await harness.accept(m, 1, forward_backward=_batch(1)) for m in ("za", "zb")]
        outcomes = await harness.settled(*asked)
        assert all(o.status is jobs.Status.COMPLETED for o in outcomes)
        assert trainer.fuser.fused_passes == 0
        step = bus.OptimStep(adam=FUSED_ADAM)
        async with harness.compute_held(trainer, waiting=2):
            asked = [await harness.accept(m, 2, optim_step=step) for m in ("za", "zb")]
        outcomes = await harness.settled(*asked)
        assert all(o.status is jobs.Status.COMPLETED for o in outcomes)
        assert trainer.fuser.fused_steps == (0 if settings.get("fuse_tokens") == 0 else 1)


@pytest.mark.parametrize("fuse_tokens", [0, 44], ids=["each alone", "two a pass"])
async def test_a_runs_optim_step_goes_before_passes_asked_for_after_its_own(
    harness: Harness, fuse_tokens: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two runs ask for a forward_backward and an optim_step, then a third run for a
    forward_backward, while the compute thread is busy. Each run's optim_step keeps its
    forward_backward's place in line, so both runs' steps end before the third run's pass: the
    runs do not wait for every other run's pass before their own step ends (lockstep). With 44
    tokens a pass, the first two passes are fused (22 tokens each), and so are their steps.

    The handlers hand a run's optim_step over some milliseconds after its pass; on a loaded
    machine that can take longer than the fuser's wait for it (``RETURN_WAIT_S``), and the pass
    asked for later goes first. The test waits longer, which costs nothing when the step comes
    at once (the wait ends when it comes): it is about the order, not the machine's speed.
    The order is the fuser's, in which it hands the requests their results: the runs record
    their outcomes concurrently, so the event log's order of outcomes may differ."""
    monkeypatch.setattr(fusion, "RETURN_WAIT_S", 10.0)
    delivered = record_calls(monkeypatch, fusion.Fuser, "_deliver")
    async with harness.trainer(fuse_tokens=fuse_tokens) as trainer:
        created = [await harness.create(m) for m in ("ra", "rb", "rc")]
        await harness.settled(*created)
        step = bus.OptimStep(adam=FUSED_ADAM)
        asked = []
        async with harness.compute_held(trainer, waiting=3):  # the three forward_backwards
            for n, m in enumerate(("ra", "rb")):
                asked.append(await harness.accept(m, 1, forward_backward=_batch(n)))
                asked.append(await harness.accept(m, 2, optim_step=step))
            asked.append(await harness.accept("rc", 1, forward_backward=_batch(2)))
        outcomes = await harness.settled(*asked)
        assert all(o.status is jobs.Status.COMPLETED for o in outcomes)
        order = [
            f"{ask.model_id}:{2 if ask.kind == fusion.OPTIM_STEP else 1}" for _, ask, _ in delivered
        ]
        if fuse_tokens:  # one pass, one step: their results are handed out in either order
            assert [set(order[:2]), set(order[2:4])] == [{"ra:1", "rb:1"}, {"ra:2", "rb:2"}]
        else:
            assert order[:4] == ["ra:1", "ra:2", "rb:1", "rb:2"]
        assert order[4] == "rc:1"
        assert (trainer.fuser.fused_passes, trainer.fuser.fused_steps) == (
            (1, 1) if fuse_tokens else (0, 0)
        )
