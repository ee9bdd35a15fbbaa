"""A request longer than a slice runs in passes of at most ``slice_tokens`` padded tokens, one at
a time (``TrainerEngine.begin`` and ``advance``), with the one pass's outputs and gradients; other
runs' work between its passes changes neither its results nor theirs; a request abandoned,
failing or cancelled between its passes leaves its run as it was; and in the trainer, a run's
request waits for one slice of another run's large request, not for the whole of it."""

from __future__ import annotations

import asyncio
import dataclasses
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from services.device import Placement
from services.trainer.engine import OutOfBudget, Pass, Passes, TrainerEngine
from services.trainer.fusion import Ask, Fuser
from tests.calls import record_calls
from tests.trainer.test_fusion import FUSED_ADAM, TOLERANCE, _max_gap, _tensor_gap, _tensors
from tests.trainer.test_memory import HUGE, TINY, _create, _request
from tests.trainer.test_work_loop import Harness, _batch
from tinsmith import jobs, models
from tinsmith._proto import bus_pb2 as bus
from tinsmith.eventlog import EventLog
from tinsmith.failures import Unprocessable

# Six datums of 9 to 23 tokens: 138 tokens, 138 padded to 23 each. Slices of 40 padded tokens
# take one or two of them a pass.
LENGTHS = (9, 23, 17, 12, 20, 15)
SLICE = 40


def _engine(slice_tokens: int) -> TrainerEngine:
    placement = Placement(torch.device("cpu"), torch.float32, HUGE)
    return TrainerEngine(
        models.default_cache_dir(),
        placement=placement,
        pass_tokens=HUGE,
        slice_tokens=slice_tokens,
    )


def _engines() -> tuple[TrainerEngine, TrainerEngine]:
    """An engine that cuts requests into slices, and one that runs each in one pass, each with
    the runs "big" (rank 4) and "small" (rank 8)."""
    sliced, whole = _engine(SLICE), _engine(0)
    for engine in (sliced, whole):
        _create(engine, "big", rank=4, seed=1)
        _create(engine, "small", rank=8, seed=2)
    return sliced, whole


def test_a_request_longer_than_a_slice_runs_in_slices_with_the_one_pass_results() -> None:
    sliced, whole = _engines()
    for loss in ("cross_entropy", "ppo"):
        request = _request(3, LENGTHS, loss)
        out = sliced.forward_backward("big", request)
        assert len(sliced.last_plan) > 1
        for step in sliced.last_plan:
            widths = [LENGTHS[i] for i in step.datums]
            assert len(widths) * max(widths) <= SLICE
        assert sorted(i for step in sliced.last_plan for i in step.datums) == list(range(6))
        assert _max_gap(out, whole.forward_backward("big", request)) <= TOLERANCE
        assert whole.last_plan == [Pass(tuple(range(6)))]
        gap = _tensor_gap(_tensors(sliced, "big", True), _tensors(whole, "big", True))
        assert gap <= TOLERANCE
    # A datum longer than a slice is a pass of its own.
    sliced.forward_backward("big", _request(4, (60, 5), "cross_entropy"))
    assert sliced.last_plan == [Pass((0,)), Pass((1,))]


def test_other_runs_work_between_the_passes_changes_neither_runs_results() -> None:
    sliced, whole = _engines()
    earlier = _request(5, (11, 7), "cross_entropy")
    for engine in (sliced, whole):  # gradients accumulated before: set aside, then added
        engine.forward_backward("big", earlier)
    big, small = _request(6, LENGTHS, "importance_sampling"), _request(7, (13, 4), "ppo")
    held = sliced.held_bytes()
    passes = sliced.begin("big", big)
    aside = passes.aside_bytes
    assert aside > 0 and sliced.held_bytes() == held + aside  # counted while the request runs
    assert sliced.advance(passes) is None
    # Another run's whole step between two passes of this request.
    alone_small = sliced.forward_backward("small", small)
    sliced.optim_step("small", FUSED_ADAM)
    while (out := sliced.advance(passes)) is None:
        pass
    assert sliced.held_bytes() == held
    assert _max_gap(out, whole.forward_backward("big", big)) <= TOLERANCE
    assert _tensor_gap(_tensors(sliced, "big", True), _tensors(whole, "big", True)) <= TOLERANCE
    assert _max_gap(alone_small, whole.forward_backward("small", small)) <= TOLERANCE
    whole.optim_step("small", FUSED_ADAM)
    gap = _tensor_gap(_tensors(sliced, "small", False), _tensors(whole, "small", False))
    assert gap <= TOLERANCE


def test_a_request_abandoned_or_failing_between_its_passes_leaves_the_run_as_it_was() -> None:
    sliced, _ = _engines()
    sliced.forward_backward("big", _request(8, (11, 7), "cross_entropy"))
    before, held = _tensors(sliced, "big", True), sliced.held_bytes()

    passes = sliced.begin("big", _request(9, LENGTHS, "cross_entropy"))
    assert sliced.advance(passes) is None
    sliced.abandon(passes)
    assert _tensor_gap(_tensors(sliced, "big", True), before) == 0
    assert sliced.held_bytes() == held and not sliced._in_progress

    # The last datum's sampler logprobs are -1e30, so its importance ratio exp(p - q) is
    # infinite: its pass, the last, fails, after the others went through.
    failing = _request(10, LENGTHS, "importance_sampling")
    failing.data[-1].loss_fn_inputs["logprobs"].dense = np.full(LENGTHS[-1], -1e30, "<f4").tobytes()
    passes = sliced.begin("big", failing)
    assert [step.datums for step in passes.plan] == [(0,), (1,), (2, 3), (4, 5)]
    for _ in range(3):
        assert sliced.advance(passes) is None
    with pytest.raises(Unprocessable, match="not finite"):
        sliced.advance(passes)
    assert _tensor_gap(_tensors(sliced, "big", True), before) == 0
    assert sliced.held_bytes() == held and not sliced._in_progress


def test_a_pass_that_no_longer_fits_is_refused_and_runs_once_there_is_room() -> None:
    sliced, whole = _engines()
    request = _request(11, LENGTHS, "cross_entropy")
    passes = sliced.begin("big", request)
    assert sliced.advance(passes) is None
    done = passes.done
    roomy = sliced.placement
    # Other work took the memory the next pass planned on.
    sliced.placement = dataclasses.replace(roomy, memory_bytes=sliced.held_bytes())
    with pytest.raises(OutOfBudget) as refused:
        sliced.advance(passes)
    assert refused.value.short > 0 and passes.done == done and sliced._in_progress == [passes]
    sliced.placement = roomy
    while (out := sliced.advance(passes)) is None:
        pass
    assert _max_gap(out, whole.forward_backward("big", request)) <= TOLERANCE
    assert _tensor_gap(_tensors(sliced, "big", True), _tensors(whole, "big", True)) <= TOLERANCE


@pytest.fixture
async def harness(eventlog: EventLog, nats_url: str, tmp_path: Path) -> Harness:
    harness = Harness(eventlog, nats_url, tmp_path / "blobs")
    await harness.projection.start()
    return harness


@pytest.mark.parametrize("slice_tokens", [0, 44], ids=["whole", "in slices"])
async def test_a_runs_request_waits_for_one_slice_of_anothers_not_the_whole(
    harness: Harness, slice_tokens: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """While the compute thread is busy, run "sa" asks for a forward_backward of 8 datums of 11
    tokens (88 tokens), then run "sb" for one of 22 (not fused: each runs alone). In slices of 44
    tokens, the first pass of "sa" runs, then "sb"'s request, then the rest of "sa"'s: "sb" is
    answered first. In one pass, "sa" first (the order in which the fuser hands out results:
    the runs record their outcomes concurrently). Each run's gradients are what it gets alone."""
    delivered = record_calls(monkeypatch, Fuser, "_deliver")
    reference = TrainerEngine(models.default_cache_dir(), slice_tokens=0)
    big, small = _batch(1, datums=8), _batch(2)
    async with harness.trainer(slice_tokens=slice_tokens, fuse_tokens=0) as trainer:
        assert trainer.engine.slice_tokens == slice_tokens
        await harness.settled(*[await harness.create(m) for m in ("sa", "sb")])
        async with harness.compute_held(trainer, waiting=2):
            asked = [
                await harness.accept("sa", 1, forward_backward=big),
                await harness.accept("sb", 1, forward_backward=small),
            ]
        outcomes = await harness.settled(*asked)
        assert all(o.status is jobs.Status.COMPLETED for o in outcomes)
        order = [ask.model_id for _, ask, _ in delivered]
        assert order == (["sb", "sa"] if slice_tokens else ["sa", "sb"])
        for model_id, request in (("sa", big), ("sb", small)):
            _create_like_harness(reference, model_id)
            reference.forward_backward(model_id, request)
            gap = _tensor_gap(
                _tensors(trainer.engine, model_id, True), _tensors(reference, model_id, True)
            )
            assert gap <= TOLERANCE, model_id


def _create_like_harness(engine: TrainerEngine, model_id: str) -> None:
    lora = bus.LoraConfig(rank=4, seed=1, train_mlp=True, train_attn=True, train_unembed=True)
    engine.create_run(model_id, bus.CreateModel(session_id="S", base_model=TINY, lora=lora))


async def test_a_request_cancelled_between_its_passes_gives_its_run_back(
    harness: Harness, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A request whose caller went away after its first pass (its future cancelled, as when the
    trainer lets go of its run) is abandoned when its turn comes again: the run's gradients are
    those it had before, and nothing stays set aside."""
    async with harness.trainer(slice_tokens=11, fuse_tokens=0) as trainer:
        await harness.settled(await harness.create("sc"))
        await harness.settled(await harness.accept("sc", 1, forward_backward=_batch(3)))
        before = _tensors(trainer.engine, "sc", True)
        first = threading.Event()
        advance = trainer.engine.advance

        def slowed(passes: Passes) -> bytes | None:
            output = advance(passes)
            if passes.done == 1:  # hold the thread after the first of the 8 passes
                first.set()
                time.sleep(0.3)
            return output

        monkeypatch.setattr(trainer.engine, "advance", slowed)
        ask = Ask("sc", TINY, _batch(4, datums=8), 88, {})
        waiting = asyncio.ensure_future(trainer.fuser.forward_backward(ask))
        assert await asyncio.to_thread(first.wait, 10.0)
        waiting.cancel()
        for _ in range(100):
            if not trainer.engine._in_progress:
                break
            await asyncio.sleep(0.05)
        assert not trainer.engine._in_progress
        assert ask.passes is not None and ask.passes.done == 1
        assert _tensor_gap(_tensors(trainer.engine, "sc", True), before) == 0
