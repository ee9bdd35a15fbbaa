"""The torch engine's memory budget (TINSMITH_DEVICE_MEMORY_MB), on tinsmith/tiny on the CPU with
small budgets: the KV cache is counted exactly, rows wait for room and then get what they get
without a budget, a request that holds the line is not overtaken, one that could never fit is
refused with what it needs, and a step that runs out of device memory (a forward hook raises
torch.OutOfMemoryError, as CUDA's allocator does) fails the requests of that step alone."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from services import device
from services.device import Placement
from services.sampler.engine import run_all
from services.sampler.memory import Ask, Plan, Rows
from services.sampler.torch_engine import TorchEngine
from tests.sampler.test_engine import BASE, _assert_same, _command, _decode, _prompt
from tinsmith import models
from tinsmith._proto import bus_pb2 as bus
from tinsmith.failures import InvalidRequest, Unavailable
from tinsmith.limits import mib

UNBOUNDED = 1 << 40


def _engine(budget: int = UNBOUNDED, **options: int) -> TorchEngine:
    placement = Placement(torch.device("cpu"), torch.float32, budget)
    return TorchEngine(models.default_cache_dir(), placement=placement, **options)  # type: ignore[arg-type]


def _room_for(*commands: bus.Sample) -> int:
    """The budget that admits exactly these requests, whole, in one step beside the weights."""
    probe = _engine()
    probe.load_base(BASE)
    base = probe.bases[BASE]
    plan = Plan(UNBOUNDED, base.weight_bytes, probe.rows_per_request, {})
    for command in commands:
        n, max_tokens = command.num_samples, command.params.max_tokens
        ask = Ask(
            prompt=len(command.prompt), max_tokens=max_tokens, fresh=True, scores=False, left=n
        )
        plan.take(BASE, base.costs, ask, n)
    return plan.total()


def _fixed(max_tokens: int, *seeds: int, n: int = 6, length: int = 8) -> list[bus.Sample]:
    """Requests that all run to ``max_tokens`` (no stops), one per seed."""
    return [
        _command(_prompt(seed, length), n=n, max_tokens=max_tokens, seed=seed, stop_tokens=[])
        for seed in seeds
    ]


def test_the_kv_cache_is_counted_exactly_and_reserved_to_the_last_token() -> None:
    engine = _engine()
    commands = [
        _command(_prompt(1, 5), n=3, max_tokens=6, seed=1, stop_tokens=[]),
        _command(_prompt(2, 11), n=2, max_tokens=9, seed=2, temperature=0.7, stop_tokens=[]),
    ]
    for ticket, command in enumerate(commands):
        engine.add(ticket, command)
    engine.step()  # prefilled, merged (left-padded to 11 columns), one token on
    batch = engine._batches[BASE]
    costs = engine.bases[BASE].costs
    held = engine.memory()
    # What the tensors take is what the count from the config and dtype says: the rows' cached
    # columns, and the columns a cache that grows takes to spare (the average of the tokens the
    # rows have still to sample: services/sampler/decoder.py), within what the rows reserved.
    rows, width = len(batch.rows), batch.mask.shape[1]
    assert (rows, width) == (5, 12)
    remaining = 3 * (6 - 1) + 2 * (9 - 1)
    spare = rows * (remaining // rows) * costs.layer_column * len(batch.cache.layers)
    assert spare > 0
    exact = Rows(costs, rows=rows, width=width).parts(64)["kv"]
    assert held["kv"] == exact + spare
    assert held["kv"] <= Rows(costs, rows=rows, width=width, remaining=remaining).parts(64)["kv"]
    # No later step holds more than what was planned once the rows were admitted.
    planned = held["planned"]
    while engine.has_work():
        now = engine.memory()
        assert now["weights"] + now["adapters"] + now["prompts"] + now["kv"] <= planned
        assert now["planned"] <= planned
        engine.step()
    assert engine.memory()["kv"] == 0


def test_rows_wait_for_room_and_get_what_they_get_without_a_budget() -> None:
    commands = _fixed(8, 11, 12, 13)  # 18 sequences
    unbounded = run_all(_engine(), commands)
    budget = _room_for(*_fixed(8, 0, n=5))  # five rows of one request
    engine = _engine(budget)
    for ticket, command in enumerate(commands):
        engine.add(ticket, command)
    outcomes: dict[int, bytes | Exception] = {}
    most = 0
    while engine.has_work():
        outcomes.update(engine.step())
        most = max(most, sum(engine.batch_rows(BASE).values()))
        assert engine.memory()["planned"] <= budget
    assert 3 <= most <= 5  # held back: never all 18 at once
    for ticket, want in enumerate(unbounded):
        # Tokens and stops exactly, logprobs to float32 rounding (batches of other sizes).
        _assert_same(_decode(outcomes[ticket]), _decode(want))


def test_a_request_without_room_holds_the_line() -> None:
    """A request that gets no rows for want of memory keeps its place, and a smaller one that
    came after it does not take the room that frees up before it."""
    running = _fixed(10, 21)[0]  # six rows, most of the budget
    budget = _room_for(running) + 50_000  # and some room beside them
    engine = _engine(budget)
    engine.add(0, running)
    engine.step()
    assert engine.batch_rows(BASE) == {0: 6}
    # A long prompt widens every row of the batch: it does not fit beside it; a short one does.
    wide = _command(_prompt(22, 40), n=2, max_tokens=4, seed=22, stop_tokens=[])
    small = _command(_prompt(23, 3), n=1, max_tokens=2, seed=23, stop_tokens=[])
    plan, costs = engine._plan(), engine.bases[BASE].costs
    assert plan.fitting(BASE, costs, Ask(40, 4, True, False, 2), 1) < 1
    assert plan.fitting(BASE, costs, Ask(3, 2, True, False, 1), 1) == 1
    engine.add(1, wide)
    engine.add(2, small)
    order: list[int] = []
    outcomes: dict[int, bytes | Exception] = {}
    while engine.has_work():
        outcomes.update(engine.step())
        order.extend(t for t in engine.batch_rows(BASE) if t not in order)
    assert order == [0, 1, 2]
    for ticket, command in enumerate([running, wide, small]):
        _assert_same(_decode(outcomes[ticket]), _decode(run_all(_engine(), [command])[0]))


def test_a_prompt_prefilled_in_chunks_keeps_its_room_until_its_rows_run_or_it_is_cancelled() -> (
    None
):
    """A 60-token prompt in a budget that holds exactly its request, prefilled 16 tokens a
    step: from its first chunk the plan holds all it was admitted with (its prefill and its
    rows), so a small request that comes meanwhile waits for it, not the other way round, and
    both get what they get without a budget. Cancelled between two chunks, it gives all of it
    back, and the small request is admitted at the next step."""
    long = _command(_prompt(24, 60), n=2, max_tokens=4, seed=24, stop_tokens=[])
    small = _command(_prompt(25, 3), n=1, max_tokens=2, seed=25, stop_tokens=[])
    budget = _room_for(long)
    engine = _engine(budget, prefill_tokens=16)
    engine.load_base(BASE)
    idle = engine.memory()["planned"]
    engine.add(0, long)
    engine.step()
    held = engine.memory()
    assert held["planned"] == budget  # what its whole admission plans
    # Its cache after the first chunk, in a buffer with room for the whole prompt, and logits.
    costs = engine.bases[BASE].costs
    assert held["prompts"] == 60 * costs.kept_position + costs.kept_logits
    engine.add(1, small)
    outcomes: dict[int, bytes | Exception] = {}
    rows = []
    while engine.has_work():
        outcomes.update(engine.step())
        rows.append(engine.batch_rows(BASE))
        assert engine.memory()["planned"] <= budget
    # Three more chunks, the last with the rows of ``long``; ``small`` joins them once what the
    # prefill took is free.
    assert rows[:3] == [{}, {}, {0: 2}] and {0: 2, 1: 1} in rows
    for ticket, command in enumerate([long, small]):
        _assert_same(_decode(outcomes[ticket]), _decode(run_all(_engine(), [command])[0]))

    engine.add(2, long)
    engine.step()
    engine.step()
    engine.add(3, small)
    engine.cancel(2)
    assert not engine._chunked() and engine.memory()["planned"] == idle
    assert engine.step() == [] and engine.batch_rows(BASE) == {3: 1}


def test_a_request_that_could_never_fit_is_refused_with_what_it_needs() -> None:
    budget = _room_for(*_fixed(16, 0, n=4))
    engine = _engine(budget)
    huge = _command(_prompt(31, 8), n=2, max_tokens=4000, seed=31)
    scored = _command(_prompt(32, 900), max_tokens=1, prompt_logprobs=True)
    details = []
    for command in (huge, scored):
        with pytest.raises(InvalidRequest) as refused:
            engine.add(0, command)
        details.append(refused.value.detail)
    for detail in details:
        assert "this sample request needs" in detail and "even alone" in detail
        assert f"more than its budget of {mib(budget)} (TINSMITH_DEVICE_MEMORY_MB)" in detail
    assert "KV cache for 1 sequence of 8 prompt + 4000 sampled tokens" in details[0]
    assert "keeping the logits of all 900 prompt positions" in details[1]
    assert not engine.has_work()  # nothing of them stayed
    # What fits is served as ever.
    small = _fixed(16, 33, n=4)
    assert _decode(run_all(engine, small)[0]) == _decode(run_all(_engine(), small)[0])


def _raise_once_at(model: torch.nn.Module, call: int) -> list[int]:
    """Make the model's output layer raise torch.OutOfMemoryError at its ``call``-th forward
    (one per forward of the model), once; returns the count of calls so far."""
    calls = [0]

    def hook(*_: object) -> None:
        calls[0] += 1
        if calls[0] == call:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

    output = model.get_output_embeddings()
    assert isinstance(output, torch.nn.Module)
    output.register_forward_hook(hook)
    return calls


def test_a_step_that_runs_out_of_memory_fails_its_requests_and_the_engine_goes_on(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    released: list[torch.device] = []
    monkeypatch.setattr(device, "release", released.append)
    first, second, waiting = _fixed(6, 41, 42, 43, n=3)
    engine = _engine(_room_for(first, second))  # the first two requests, not the third
    for ticket, command in enumerate([first, second, waiting]):
        engine.add(ticket, command)
    engine.load_base(BASE)
    calls = _raise_once_at(engine.bases[BASE].model, 3)  # the prefill, two decoding forwards
    assert engine.step() == []
    assert engine.batch_rows(BASE) == {0: 3, 1: 3}
    outcomes = dict(engine.step())
    assert calls[0] == 3 and set(outcomes) == {0, 1}
    for outcome in outcomes.values():
        assert isinstance(outcome, Unavailable)
        assert "cpu ran out of memory while decoding 6 sequences of tinsmith/tiny" in str(outcome)
        assert "can be sent again" in outcome.detail and "TINSMITH_DEVICE_MEMORY_MB" in str(outcome)
    assert released == [torch.device("cpu")]
    assert engine.batch_rows(BASE) == {} and engine.memory()["kv"] == 0  # rows and cache gone
    # The engine goes on: the request that waited runs, exactly as it does on a fresh engine.
    while engine.has_work():
        outcomes.update(engine.step())
    _assert_same(_decode(outcomes[2]), _decode(run_all(_engine(), [waiting])[0]))
    # And the failed requests, sent again, get what they get on a fresh engine.
    again = run_all(engine, [first, second])
    for got, command in zip(again, [first, second], strict=True):
        _assert_same(_decode(got), _decode(run_all(_engine(), [command])[0]))


def test_a_prefill_that_runs_out_of_memory_is_retried_prompt_by_prompt(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    released: list[torch.device] = []
    monkeypatch.setattr(device, "release", released.append)
    commands = [*_fixed(5, 51, n=2), *_fixed(5, 52, n=3, length=12)]
    engine = _engine()
    engine.load_base(BASE)
    _raise_once_at(engine.bases[BASE].model, 1)  # the prefill of both prompts
    outcomes = run_all(engine, commands)
    assert released  # given back before the prompts ran one by one
    for got, command in zip(outcomes, commands, strict=True):
        _assert_same(_decode(got), _decode(run_all(_engine(), [command])[0]))


def test_idle_adapters_make_room(tmp_path: Path) -> None:
    """Adapters no request uses are evicted when a request needs their memory."""
    from tests.sampler.test_engine import _save_adapter

    directory = tmp_path / "adapter"
    _save_adapter(directory, 1, ["q_proj", "v_proj", "down_proj", "up_proj", "gate_proj"])
    probe = _engine()
    probe.load_adapter(BASE, "adapter/a", directory)
    adapter = probe.memory()["adapters"]
    command = _fixed(6, 61, n=4)[0]
    # Room for the request, or for the adapter and part of it, not both.
    budget = _room_for(command) + adapter // 2
    engine = _engine(budget)
    engine.load_adapter(BASE, "adapter/a", directory)
    outcome = run_all(engine, [command])[0]
    assert not engine.has_adapter(BASE, "adapter/a")
    _assert_same(_decode(outcome), _decode(run_all(_engine(), [command])[0]))


def test_a_request_waiting_for_memory_does_not_hold_up_a_prompt_being_prefilled_in_chunks(
    tmp_path: Path,
) -> None:
    """A request of one row with 600 tokens to sample fits the budget alone, but not beside an
    adapter that a smaller request uses: it waits. The smaller one's 40-token prompt is
    prefilled in chunks of 16, which go on while the large one holds the line for new
    admissions; once it is done, its adapter is evicted and the large one runs. (Held up by
    the large one, the chunks waited for ever, and so did the large one, for the adapter.)"""
    from tests.sampler.test_engine import _save_adapter

    _save_adapter(tmp_path, 7, ["q_proj", "v_proj", "up_proj", "down_proj", "lm_head"], rank=16)
    large = _command(_prompt(26, 12), n=1, max_tokens=600, seed=26, stop_tokens=[])
    chunked = _command(_prompt(27, 40), "adapter/big", n=1, max_tokens=2, seed=27)
    budget = _room_for(large)
    engine = _engine(budget, prefill_tokens=16)
    engine.load_adapter(BASE, "adapter/big", tmp_path)
    engine.add(0, large)
    engine.add(1, chunked)
    outcomes: dict[int, bytes | Exception] = {}
    rows = []
    for _ in range(700):
        outcomes.update(engine.step())
        rows.append(engine.batch_rows(BASE))
        assert engine.memory()["planned"] <= budget
        if not engine.has_work():
            break
    assert rows[:5] == [{}, {}, {1: 1}, {}, {0: 1}]  # chunks, the last with its row; evicted
    assert set(outcomes) == {0, 1} and engine.memory()["adapters"] == 0
    _assert_same(_decode(outcomes[0]), _decode(run_all(_engine(), [large])[0]))
