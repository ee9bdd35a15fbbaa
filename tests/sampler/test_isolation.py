"""A request that fails in the torch engine fails alone, on tinsmith/tiny: its rows leave the
running batch and its KV cache, and the requests that shared its steps get exactly (bit for bit,
seeded) what they get without it. Each story runs the bad request with others first, then the
others without it on the same engine, so it also shows the engine serving on after a failure.

Bit for bit needs batches whose arithmetic does not change with the bad request's rows: the bad
prompts are no longer than the others' (left padding to a longer one moves float32 sums by an
ulp), sample no more tokens, and use no adapter the others use; and every forward has at least 8
rows with or without them, because CPU matrix kernels take another path below that (measured
here: a 176 -> 64 linear layer's results differ in the last bit for 1 to 7 rows, and not from 8
rows on, wherever a row sits in the batch)."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

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
from tinsmith import models
from tinsmith._proto import bus_pb2 as bus
from tinsmith._proto import tinker_public_pb2 as tp
from tinsmith.failures import InvalidRequest, Unprocessable


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory) -> TorchEngine:
    engine = TorchEngine(models.default_cache_dir())
    good = tmp_path_factory.mktemp("good")
    _save_adapter(good, 1, ["q_proj", "v_proj", "down_proj"])
    engine.load_adapter(BASE, "adapter/a", good)
    nan = tmp_path_factory.mktemp("nan")
    save_nan_adapter(nan)
    engine.load_adapter(BASE, "adapter/nan", nan)
    return engine


def save_nan_adapter(directory: Path) -> None:
    """A PEFT adapter whose weights are all NaN, as a diverged training run leaves them."""
    _save_adapter(directory, 2, ["q_proj", "v_proj", "down_proj"])
    path = directory / "adapter_model.safetensors"
    save_file({k: torch.full_like(v, math.nan) for k, v in load_file(path).items()}, path)


def _others() -> list[bus.Sample]:
    """Requests that share the bad one's steps, 16 rows: no stops, so all run to max_tokens."""
    scored = _command(_prompt(81, 14), "adapter/a", n=4, max_tokens=8, seed=1, stop_tokens=[])
    scored.prompt_logprobs = True
    scored.topk_sample_logprobs = 3
    return [
        scored,
        _command(_prompt(82, 20), "", n=8, max_tokens=8, seed=2, temperature=0.8, stop_tokens=[]),
        _command(_prompt(83, 9), "adapter/a", n=4, max_tokens=8, seed=3, top_k=7, stop_tokens=[]),
    ]


def _with_and_without(
    engine: TorchEngine, bad: bus.Sample
) -> tuple[bytes | Exception, list[bytes | Exception], list[bytes | Exception]]:
    """The bad request's outcome, the others' beside it, and the others' without it."""
    others = _others()
    beside = run_all(engine, [others[0], bad, *others[1:]])
    alone = run_all(engine, others)
    return beside[1], [beside[0], *beside[2:]], alone


def _assert_same_outcomes(beside: list[bytes | Exception], alone: list[bytes | Exception]) -> None:
    """The others got what they get without the bad request: every one a response, the same
    tokens and stops, and the same logprobs up to float32 rounding (a forward of other rows
    may round in the last bits: the matrix products' blocking depends on how many there are)."""
    assert len(beside) == len(alone)
    for got, want in zip(beside, alone, strict=True):
        assert isinstance(got, bytes) and isinstance(want, bytes), (got, want)
        _assert_same(_decode(got), _decode(want))


def test_a_nan_temperature_is_refused_and_the_others_go_on(engine: TorchEngine) -> None:
    bad, beside, alone = _with_and_without(
        engine, _command(_prompt(84, 6), "", n=2, max_tokens=8, temperature=math.nan)
    )
    assert isinstance(bad, InvalidRequest) and "temperature" in bad.detail
    assert "nan" in bad.detail
    _assert_same_outcomes(beside, alone)
    assert all(isinstance(outcome, bytes) for outcome in alone)


def test_a_denormal_temperature_samples_the_most_likely_tokens(engine: TorchEngine) -> None:
    # What the SDK sends for 1e-45: the smallest float32 denormal, which passes every check.
    params = tp.SamplingParams(temperature=1e-45)
    assert 0 < params.temperature < 1.5e-45
    tiny = _command(_prompt(85, 6), "", n=2, max_tokens=8, seed=4, stop_tokens=[])
    tiny.params.temperature = params.temperature
    outcome, beside, alone = _with_and_without(engine, tiny)
    _assert_same_outcomes(beside, alone)
    greedy = _command(_prompt(85, 6), "", max_tokens=8, temperature=0.0, stop_tokens=[])
    want = _decode(run_all(engine, [greedy])[0]).sequences[0]
    for sequence in _decode(outcome).sequences:
        assert sequence.tokens == want.tokens
        # Logprobs stay the raw ones, not the temperature's (which are all 0 here).
        np.testing.assert_allclose(
            np.frombuffer(sequence.logprobs, "<f4"), np.frombuffer(want.logprobs, "<f4")
        )
        assert (np.frombuffer(sequence.logprobs, "<f4") < -0.01).any()


def test_an_adapter_with_nan_weights_fails_its_request_alone(engine: TorchEngine) -> None:
    bad = _command(_prompt(86, 11), "adapter/nan", n=3, max_tokens=8, seed=5)
    outcome, beside, alone = _with_and_without(engine, bad)
    assert isinstance(outcome, Unprocessable)
    assert "NaN in 3 of this request's 3 running sequences" in outcome.detail
    assert "'adapter/nan'" in outcome.detail and "adapter's weights" in outcome.detail
    _assert_same_outcomes(beside, alone)


def test_an_adapter_with_nan_weights_fails_its_prompt_scores(engine: TorchEngine) -> None:
    bad = _command(_prompt(87, 12), "adapter/nan", prompt_logprobs=True, max_tokens=0)
    outcome, beside, alone = _with_and_without(engine, bad)
    assert isinstance(outcome, Unprocessable)
    assert "NaN over this request's prompt" in outcome.detail
    _assert_same_outcomes(beside, alone)


def test_its_rows_leave_the_batch_and_its_cache_at_once(engine: TorchEngine) -> None:
    others = _others()
    for ticket, command in enumerate(others):
        engine.add(ticket, command)
    engine.add(9, _command(_prompt(88, 5), "adapter/nan", n=4, max_tokens=8, seed=6))
    first = dict(engine.step())  # the prefill, then the first sampling finds its NaN logits
    assert isinstance(first.pop(9), Unprocessable) and not first
    assert engine.batch_rows(BASE) == {0: 4, 1: 8, 2: 4}
    outcomes = {}
    while engine.has_work():
        outcomes.update(engine.step())
    assert [outcomes[t] for t in range(3)] == run_all(engine, others)


def test_a_request_that_raises_in_the_prefill_fails_alone(engine: TorchEngine) -> None:
    # A real input that raises mid-step: target ids for rows past the prompt's end, found out
    # when the step scores the prompt (the gateway refuses it at the door; the engine still must
    # not let it take the others down).
    bad = _command(_prompt(89, 4), "adapter/a", n=2, max_tokens=8, seed=7)
    targets = np.arange(10, dtype="<i8").reshape(5, 2)
    bad.target_prompt_logprobs.CopyFrom(
        tp.Tensor(dense=targets.tobytes(), dtype=tp.DTYPE_INT64, shape=[5, 2])
    )
    outcome, beside, alone = _with_and_without(engine, bad)
    assert isinstance(outcome, InvalidRequest) and "does not fit the prompt" in outcome.detail
    _assert_same_outcomes(beside, alone)


def test_a_request_that_raises_while_it_decodes_fails_alone(
    engine: TorchEngine, monkeypatch: pytest.MonkeyPatch
) -> None:
    """No real input is known to raise while decoding (each that did is refused or handled
    now), so torch's sampling raises for one request's generator at its third token, as a bug or
    a fault in the sampling would."""
    bad = _command(_prompt(90, 7), "", n=2, max_tokens=8, seed=8, stop_tokens=[])
    poisoned = {torch.Generator().manual_seed(s).initial_seed() for s in _seeds_of(bad)}
    draws: dict[int, int] = {}
    rand = torch.rand

    def faulty(*args: object, **kwargs: object) -> torch.Tensor:
        generator = kwargs.get("generator")
        if isinstance(generator, torch.Generator) and generator.initial_seed() in poisoned:
            seed = generator.initial_seed()
            draws[seed] = draws.get(seed, 0) + 1
            if draws[seed] == 3:
                raise RuntimeError("injected: the sampling of this request broke")
        return rand(*args, **kwargs)  # type: ignore[call-overload,no-any-return]

    monkeypatch.setattr(torch, "rand", faulty)
    outcome, beside, alone = _with_and_without(engine, bad)
    assert isinstance(outcome, RuntimeError) and "injected" in str(outcome)
    # It failed mid-way, at its third token (drawn once more when the requests sampled with
    # the same parameters were chosen again one by one to find which one raised).
    assert max(draws.values()) in (3, 4)
    _assert_same_outcomes(beside, alone)


def _seeds_of(command: bus.Sample) -> list[int]:
    """The seeds of a seeded request's sequences' generators (as the engine derives them)."""
    from services.sampler.torch_engine import _stream_seed

    return [_stream_seed(command.params.seed, n) for n in range(command.num_samples)]
