"""Fair sharing of the torch engine's batch, on tinsmith/tiny: a request holds at most
``rows_per_request`` rows at a time and gets the rest in slices, with exactly the result it gets
when admitted at once; a short request that arrives while a long one decodes joins at the next
step instead of waiting for it.

Bit for bit where every forward has at least 8 rows, sliced or not: below that, CPU matrix
kernels take another path and the last bit of a logprob may change (tests/sampler/
test_isolation.py), though not, here, a sampled token."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from google.protobuf.message import Message

from services.sampler.engine import run_all
from services.sampler.torch_engine import TorchEngine
from tests.sampler.test_engine import (
    BASE,
    _assert_same,
    _command,
    _decode,
    _prompt,
    _save_adapter,
)
from tests.sampler.test_isolation import save_nan_adapter
from tinsmith import models
from tinsmith._proto import bus_pb2 as bus
from tinsmith._proto import tinker_public_pb2 as tp
from tinsmith.failures import Unprocessable


def _long() -> bus.Sample:
    """Many samples with every prompt score: computed once, whatever the slices."""
    command = _command(_prompt(91, 12), "", n=24, max_tokens=6, seed=11, stop_tokens=[])
    command.prompt_logprobs = True
    command.topk_prompt_logprobs = 2
    command.topk_sample_logprobs = 3
    command.prompt_alt_tokens_k = 2
    return command


def _steps(
    engine: TorchEngine, ticket: int, on_step: Callable[[], None] = lambda: None
) -> tuple[int, bytes]:
    """Step until ``ticket`` finishes: how many steps it took, and its result."""
    steps = 0
    while True:
        steps += 1
        outcomes = dict(engine.step())
        on_step()
        if ticket in outcomes:
            outcome = outcomes[ticket]
            assert isinstance(outcome, bytes), outcome
            return steps, outcome


def test_a_request_admitted_in_slices_gets_what_it_gets_at_once() -> None:
    at_once = TorchEngine(models.default_cache_dir(), rows_per_request=64)
    sliced = TorchEngine(models.default_cache_dir(), rows_per_request=8)
    whole = run_all(at_once, [_long()])[0]
    sliced.add(0, _long())
    held = []
    steps, in_slices = _steps(sliced, 0, lambda: held.append(sliced.batch_rows(BASE).get(0, 0)))
    assert max(held) == 8  # never more rows than its share
    assert steps == 3 * 6  # three slices of 8 sequences, one after the other
    # Tokens, top-k ids and prompt alternatives exactly; logprobs to float32 rounding (a batch
    # of 8 rows and one of 24 may take different matmul kernels on some CPUs).
    response = _decode(in_slices)
    _assert_equivalent(response, _decode(whole))
    assert len(response.sequences) == 24 and response.prompt_alt_tokens.tokens.shape == [11, 2]
    # Sequence i is sequence i: the slices did not renumber the generators.
    single = _command(_prompt(91, 12), "", n=1, max_tokens=6, seed=11, stop_tokens=[])
    assert _decode(run_all(sliced, [single])[0]).sequences[0].tokens == response.sequences[0].tokens


def _assert_equivalent(got: Message, want: Message, where: str = "response") -> None:
    """Every field equal, except float32 logprobs (bytes named ``*logprobs``, or a FLOAT32
    tensor's data), which agree to 1e-5."""
    assert got.DESCRIPTOR is want.DESCRIPTOR
    assert [f.name for f, _ in got.ListFields()] == [f.name for f, _ in want.ListFields()], where
    floats = isinstance(got, tp.Tensor) and got.dtype == tp.DTYPE_FLOAT32
    for field, value in got.ListFields():
        other, at = getattr(want, field.name), f"{where}.{field.name}"
        if field.message_type is not None:
            pairs = zip(value, other, strict=True) if field.is_repeated else [(value, other)]
            for i, (a, b) in enumerate(pairs):
                _assert_equivalent(a, b, f"{at}[{i}]")
        elif field.name.endswith("logprobs") or (floats and field.name == "dense"):
            np.testing.assert_allclose(
                np.frombuffer(value, "<f4"), np.frombuffer(other, "<f4"), atol=1e-5, err_msg=at
            )
        else:
            assert value == other, at


def test_slices_with_stops_and_others_joining_keep_each_requests_tokens() -> None:
    """Rows stop at different steps here, so slices join a batch that has moved on (left-padded
    to it): tokens stay exact, logprobs within float32 rounding."""
    commands = [
        _command(_prompt(92, 9), "", n=7, max_tokens=10, seed=12, temperature=1.5),
        _command(_prompt(93, 4), "", n=5, max_tokens=8, seed=13, stop_strs=["e"]),
        _command(_prompt(94, 15), "", n=2, max_tokens=12, seed=14, top_p=0.9),
    ]
    whole = run_all(TorchEngine(models.default_cache_dir()), commands)
    sliced = run_all(TorchEngine(models.default_cache_dir(), rows_per_request=2), commands)
    for got, want in zip(sliced, whole, strict=True):
        _assert_same(_decode(got), _decode(want))  # tokens and stops exact, logprobs to 1e-5
    assert any(s.stop_reason == tp.STOP_REASON_STOP for s in _decode(whole[1]).sequences)


def test_a_short_request_joins_while_a_long_one_decodes() -> None:
    long = _command(_prompt(95, 10), "", n=64, max_tokens=12, seed=15, stop_tokens=[])
    short = _command(_prompt(96, 6), "", n=8, max_tokens=3, seed=16, stop_tokens=[])
    taken = {}
    for cap in (16, 32):  # a share of half the batch, then the whole batch (no share)
        engine = TorchEngine(models.default_cache_dir(), max_rows=32, rows_per_request=cap)
        engine.add(0, long)
        for _ in range(3):
            assert not engine.step()
        engine.add(1, short)
        short_steps, short_result = _steps(engine, 1)
        long_steps, long_result = _steps(engine, 0)
        taken[cap] = (short_steps, 3 + short_steps + long_steps)
        # Each gets what it gets alone (up to the last bit: rows that join a batch that has
        # moved on are left-padded to it).
        _assert_same(_decode(short_result), _decode(run_all(engine, [short])[0]))
        _assert_same(_decode(long_result), _decode(run_all(engine, [long])[0]))
    # With a share, the short request is done three steps after it came (one per token), and
    # the long one decodes in four slices of 16 rows, twelve steps each. Without, the short one
    # waits for the long one's first 32 rows to finish (it then goes before its next slice).
    assert taken[16] == (3, 4 * 12)
    assert taken[32] == (12 - 3 + 3, 12 + 3 + 12)


def test_a_burst_is_prefilled_a_budget_at_a_time_while_the_running_rows_decode(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """With 40 prompt tokens a step, a burst of five requests with 20-token prompts and one
    with a 50-token prompt (longer than the budget: prefilled in chunks, each what is left of a
    step) is prefilled over four steps, in the order the requests came, and a request already
    decoding advances a token at every one of them. Each request gets what it gets from an
    engine that prefills the burst at once."""
    running = _command(_prompt(97, 8), "", n=2, max_tokens=12, seed=17, stop_tokens=[])
    burst = [_command(_prompt(n, 20), "", n=2, max_tokens=5, seed=n) for n in range(5)]
    burst.insert(2, _command(_prompt(98, 50), "", max_tokens=4, seed=18))
    results = {}
    for budget in (40, 0):
        engine = TorchEngine(models.default_cache_dir(), prefill_tokens=budget)
        engine.add(0, running)
        assert not engine.step()
        waves = _record_prefills(monkeypatch)
        for ticket, command in enumerate(burst, start=1):
            engine.add(ticket, command)
        outcomes: dict[int, bytes | Exception] = {}
        decoded = [len(engine._requests[0].sequences[0].tokens)]
        while len(outcomes) < len(burst) + 1:
            waves.append([])
            outcomes.update(engine.step())
            if 0 not in outcomes:
                decoded.append(len(engine._requests[0].sequences[0].tokens))
        results[budget] = outcomes
        assert np.all(np.diff(decoded) == 1)  # a token at every step, prefills or not
        prefilled = [wave for wave in waves if wave]
        if budget:  # (prompt length, tokens prefilled) of each step's prefills
            assert prefilled == [
                [(20, 20), (20, 20)],
                [(50, 40)],
                [(50, 10), (20, 20)],
                [(20, 20), (20, 20)],
            ]
        else:
            assert prefilled == [[(20, 20), (20, 20), (50, 50), (20, 20), (20, 20), (20, 20)]]
    for ticket in range(len(burst) + 1):
        bounded, whole = results[40][ticket], results[0][ticket]
        assert isinstance(bounded, bytes) and isinstance(whole, bytes)
        _assert_same(_decode(bounded), _decode(whole))


def _record_prefills(monkeypatch: pytest.MonkeyPatch) -> list[list[tuple[int, int]]]:
    """Each step's prefills (the caller appends a list before each step), as (prompt length,
    tokens prefilled): a prompt prefilled whole, or a chunk of one prefilled in chunks."""
    waves: list[list[tuple[int, int]]] = [[]]
    prefill, chunk = TorchEngine._prefill, TorchEngine._prefill_chunk

    def whole(engine: TorchEngine, slices: list[tuple[Any, int]]) -> Any:
        waves[-1].extend((len(r.command.prompt), len(r.command.prompt)) for r, _ in slices)
        return prefill(engine, slices)

    def chunked(engine: TorchEngine, request: Any, tokens: int, finished: Any) -> bool:
        waves[-1].append((len(request.command.prompt), tokens))
        return chunk(engine, request, tokens, finished)

    monkeypatch.setattr(TorchEngine, "_prefill", whole)
    monkeypatch.setattr(TorchEngine, "_prefill_chunk", chunked)
    return waves


def _scored(command: bus.Sample) -> bus.Sample:
    """``command`` asking for every prompt score."""
    command.prompt_logprobs = True
    command.topk_prompt_logprobs = 3
    command.prompt_alt_tokens_k = 2
    cells = 2 * (len(command.prompt) - 1)  # two target ids for each token after the first
    command.target_prompt_logprobs.CopyFrom(
        tp.Tensor(
            dense=(np.arange(cells, dtype="<i8") * 7 % 500).tobytes(),
            dtype=tp.DTYPE_INT64,
            shape=[cells // 2, 2],
        )
    )
    return command


def test_a_long_prompt_is_prefilled_in_chunks_while_the_running_rows_decode(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """With 16 prompt tokens a step, a 70-token prompt is prefilled in chunks of 16, 16, 16,
    16 and 6 tokens, one a step, while a request already decoding advances a token at every
    step; it gets what it gets prefilled whole: its prompt scores, its 12 sequences in slices of
    4 rows (from the prompt kept after its last chunk), through an adapter. So does a request
    that only scores a 40-token prompt (no tokens to sample): it is finished by its last chunk.
    While the chunks are prefilled, the memory plan keeps what the long request was admitted
    with: its whole prefill and its first 4 rows."""
    _save_adapter(tmp_path, 3, ["q_proj", "v_proj", "down_proj", "lm_head"])
    long = _scored(_command(_prompt(99, 70), "adapter/c", n=12, max_tokens=5, seed=19))
    only_scored = _scored(_command(_prompt(90, 40), "", max_tokens=0, seed=20))
    running = _command(_prompt(97, 8), "", n=2, max_tokens=14, seed=17, stop_tokens=[])
    results = {}
    for budget in (16, 0):
        engine = TorchEngine(models.default_cache_dir(), rows_per_request=4, prefill_tokens=budget)
        engine.load_adapter(BASE, "adapter/c", tmp_path)
        engine.add(0, running)
        assert not engine.step()
        waves = _record_prefills(monkeypatch)
        engine.add(1, long)
        outcomes: dict[int, bytes | Exception] = {}
        decoded = [len(engine._requests[0].sequences[0].tokens)]
        planned = []
        while 1 not in outcomes:
            waves.append([])
            outcomes.update(engine.step())
            if 0 not in outcomes:
                decoded.append(len(engine._requests[0].sequences[0].tokens))
            planned.append(engine.memory()["planned"])
            kept = engine._requests[1].prompt if 1 in engine._requests else None
            if kept is not None:  # for its later slices: it holds no more than is counted
                held = {t.untyped_storage().nbytes() for t in (kept.logits, *kept.layers[0])}
                assert held == {kept.logits.nbytes, kept.layers[0][0].nbytes}
        assert np.all(np.diff(decoded) == 1)  # a token at every step, chunks or not
        prefilled = [wave for wave in waves if wave]
        if budget:
            assert prefilled == [[(70, 16)], [(70, 16)], [(70, 16)], [(70, 16)], [(70, 6)]]
            # What is planned while it is chunked: the same as when its last chunk is done and
            # its rows run, give or take the running request's rows.
            assert max(planned[:4]) >= planned[4]
        else:
            assert prefilled == [[(70, 70)]]
        results["long", budget] = outcomes[1]
        engine.add(2, only_scored)
        waves.append([])
        outcome = _steps(engine, 2)[1]
        assert waves[-1] == ([(40, 16), (40, 16), (40, 8)] if budget else [(40, 40)])
        results["scored", budget] = outcome
        while engine.has_work():
            engine.step()
    for which in ("long", "scored"):
        chunked, whole = results[which, 16], results[which, 0]
        assert isinstance(chunked, bytes) and isinstance(whole, bytes)
        _assert_equivalent(_decode(chunked), _decode(whole))


def test_a_request_that_fails_or_is_cancelled_gives_up_its_waiting_slices(
    tmp_path: Path,
) -> None:
    engine = TorchEngine(models.default_cache_dir(), rows_per_request=2)
    save_nan_adapter(tmp_path)
    engine.load_adapter(BASE, "adapter/nan", tmp_path)
    for ticket, adapter in enumerate(["", "", "adapter/nan"]):
        engine.add(ticket, _command(_prompt(97, 5), adapter, n=8, max_tokens=5, seed=ticket))
    first = dict(engine.step())  # the NaN adapter's request fails at its first sampling
    assert isinstance(first.pop(2), Unprocessable) and not first
    assert engine.batch_rows(BASE) == {0: 2, 1: 2}
    engine.cancel(0)
    seen, outcomes = set(), {}
    while engine.has_work():
        outcomes.update(engine.step())
        seen |= set(engine.batch_rows(BASE))
    # Neither got rows again: their waiting sequences left the line with them.
    assert seen == {1} and set(outcomes) == {1}
    assert len(_decode(outcomes[1]).sequences) == 8


def test_seeded_random_mixes_get_what_they_get_prefilled_whole_and_at_once(
    tmp_path: Path,
) -> None:
    """Eight seeded mixes of one to five requests (prompts of 1 to 120 tokens, plain or through
    one of two adapters of ranks 4 and 16, 1 to 6 samples of 0 to 8 tokens, greedy or sampled,
    some asking for every prompt score), coming at random steps, on an engine with a random
    prefill bound of 4 to 60 tokens and a share of 1 to 6 rows: each request gets what it gets
    on an engine that prefills every prompt whole and admits every request at once."""
    directories = {"a": tmp_path / "a", "b": tmp_path / "b"}
    _save_adapter(directories["a"], 1, ["q_proj", "v_proj", "down_proj"], rank=4)
    _save_adapter(directories["b"], 2, ["k_proj", "o_proj", "up_proj", "lm_head"], rank=16)
    rng = np.random.default_rng(25)

    def engine(bound: int, share: int) -> TorchEngine:
        made = TorchEngine(models.default_cache_dir(), rows_per_request=share, prefill_tokens=bound)
        for key, directory in directories.items():
            made.load_adapter(BASE, key, directory)
        return made

    def play(made: TorchEngine, commands: list[bus.Sample], arrivals: list[int]) -> dict:
        outcomes: dict[int, bytes | Exception] = {}
        step = 0
        while len(outcomes) < len(commands):
            for ticket, at in enumerate(arrivals):
                if at == step:
                    made.add(ticket, commands[ticket])
            outcomes.update(made.step())
            step += 1
        return outcomes

    chunked_mixes = 0
    for _ in range(8):
        commands = []
        for _ in range(int(rng.integers(1, 6))):
            command = _command(
                _prompt(int(rng.integers(10**6)), int(rng.integers(1, 121))),
                str(rng.choice(["", "a", "b"])),
                n=int(rng.integers(1, 7)),
                max_tokens=int(rng.choice([0, 1, 3, 8])),
                seed=int(rng.integers(1000)),
                temperature=float(rng.choice([0.0, 0.7, 1.0])),
            )
            commands.append(_scored(command) if rng.random() < 0.4 else command)
        arrivals = sorted(int(a) for a in rng.integers(0, 7, len(commands)))
        bound, share = int(rng.integers(4, 61)), int(rng.integers(1, 7))
        chunked_mixes += any(len(c.prompt) > bound for c in commands)
        mixed = play(engine(bound, share), commands, arrivals)
        whole = play(engine(0, 64), commands, arrivals)
        for ticket in range(len(commands)):
            _assert_equivalent(_decode(mixed[ticket]), _decode(whole[ticket]), f"request {ticket}")
    assert chunked_mixes >= 4  # most mixes hold a prompt prefilled in chunks
