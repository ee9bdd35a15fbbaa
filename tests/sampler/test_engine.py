"""The sampler engine in-process on tinsmith/tiny: a batch of requests with different prompt
lengths, adapters and sampling parameters gives each request what it gets alone."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from peft import LoraConfig, get_peft_model
from transformers import AutoModelForCausalLM

from services.sampler.engine import evictions, run_all
from services.sampler.torch_engine import TorchEngine, _choose, _inverse_cdf
from tinsmith import models
from tinsmith._proto import bus_pb2 as bus
from tinsmith._proto import tinker_public_pb2 as tp
from tinsmith.failures import InvalidRequest

BASE = "tinsmith/tiny"


def _save_adapter(directory: Path, seed: int, modules: list[str], rank: int = 4) -> None:
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_pretrained(
        models.materialize(BASE, models.default_cache_dir()), dtype=torch.float32
    )
    config = LoraConfig(r=rank, lora_alpha=32, target_modules=modules, init_lora_weights=False)
    peft_model = get_peft_model(model, config)
    with torch.no_grad():  # big enough to change what is sampled
        for name, param in peft_model.named_parameters():
            if "lora_B" in name:
                param.normal_(0.0, 0.01)
    peft_model.save_pretrained(str(directory))


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory) -> TorchEngine:
    engine = TorchEngine(models.default_cache_dir())
    # Of two ranks, so that a mixed batch holds rows of both.
    for key, seed, modules, rank in (
        ("adapter/a", 1, ["q_proj", "v_proj", "down_proj"], 4),
        ("adapter/b", 2, ["q_proj", "k_proj", "o_proj", "up_proj", "lm_head"], 16),
    ):
        directory = tmp_path_factory.mktemp(key.replace("/", "-"))
        _save_adapter(directory, seed, modules, rank)
        engine.load_adapter(BASE, key, directory)
    return engine


def _command(
    prompt: list[int],
    adapter: str = "",
    n: int = 1,
    prompt_logprobs: bool = False,
    last_n: int | None = None,
    **params: object,
) -> bus.Sample:
    stop_strs = params.pop("stop_strs", None)
    stop_tokens = params.pop("stop_tokens", None)
    # The gateway's defaults.
    params = {"temperature": 1.0, "top_k": -1, "top_p": 1.0, **params}
    sampling = tp.SamplingParams(**params)  # type: ignore[arg-type]
    if stop_strs is not None:
        sampling.stop_strs.values.extend(stop_strs)  # type: ignore[arg-type]
        sampling.stop_strs.SetInParent()
    if stop_tokens is not None:
        sampling.stop_tokens.values.extend(stop_tokens)  # type: ignore[arg-type]
        sampling.stop_tokens.SetInParent()
    command = bus.Sample(
        base_model=BASE,
        adapter_key=adapter,
        prompt=prompt,
        params=sampling,
        num_samples=n,
        prompt_logprobs=prompt_logprobs,
    )
    if last_n is not None:
        command.prompt_logprobs_last_n = last_n
    return command


def _one(engine: TorchEngine, command: bus.Sample) -> bytes | Exception:
    return run_all(engine, [command])[0]


def _decode(body: bytes | Exception) -> tp.SampleResponse:
    assert isinstance(body, bytes), body
    response = tp.SampleResponse()
    response.ParseFromString(body)
    return response


def _prompt(seed: int, length: int) -> list[int]:
    return [int(t) for t in np.random.default_rng(seed).integers(3, 512, size=length)]


def _assert_same(batched: tp.SampleResponse, alone: tp.SampleResponse) -> None:
    assert len(batched.sequences) == len(alone.sequences)
    for got, want in zip(batched.sequences, alone.sequences, strict=True):
        assert (
            np.frombuffer(got.tokens, "<i4").tolist() == np.frombuffer(want.tokens, "<i4").tolist()
        )
        assert got.stop_reason == want.stop_reason
        np.testing.assert_allclose(
            np.frombuffer(got.logprobs, "<f4"), np.frombuffer(want.logprobs, "<f4"), atol=1e-5
        )
    if alone.prompt_logprobs or batched.prompt_logprobs:
        np.testing.assert_allclose(
            np.frombuffer(batched.prompt_logprobs, "<f4"),
            np.frombuffer(alone.prompt_logprobs, "<f4"),
            atol=1e-5,
        )


def _mixed_batch() -> list[bus.Sample]:
    return [
        _command(_prompt(1, 5), "adapter/a", n=2, max_tokens=12, seed=7, temperature=1.0),
        _command(_prompt(2, 23), "adapter/b", n=3, max_tokens=9, seed=8, temperature=0.7, top_k=20),
        _command(_prompt(3, 1), "", n=1, max_tokens=15, seed=9, temperature=1.3, top_p=0.9),
        _command(_prompt(4, 11), "adapter/a", n=1, max_tokens=6, temperature=0.0),
        _command(_prompt(5, 17), "adapter/b", n=2, max_tokens=10, seed=3, stop_tokens=[]),
        _command(_prompt(6, 8), "", n=2, max_tokens=4, seed=4, top_k=5, top_p=0.5),
    ]


def test_a_mixed_batch_gives_each_request_what_it_gets_alone(engine: TorchEngine) -> None:
    commands = _mixed_batch()
    batched = [_decode(body) for body in run_all(engine, commands)]
    for command, response in zip(commands, batched, strict=True):
        _assert_same(response, _decode(_one(engine, command)))
    # The adapters matter: the same request on another adapter samples something else.
    a = _decode(_one(engine, _command(_prompt(1, 5), "adapter/a", max_tokens=12, seed=7)))
    b = _decode(_one(engine, _command(_prompt(1, 5), "adapter/b", max_tokens=12, seed=7)))
    base = _decode(_one(engine, _command(_prompt(1, 5), "", max_tokens=12, seed=7)))
    assert len({a.sequences[0].logprobs, b.sequences[0].logprobs, base.sequences[0].logprobs}) == 3


def test_sequence_i_does_not_depend_on_num_samples_or_the_batch(engine: TorchEngine) -> None:
    one = _decode(_one(engine, _command(_prompt(1, 5), "adapter/a", n=1, max_tokens=12, seed=7)))
    batched = _decode(run_all(engine, _mixed_batch())[0])
    assert batched.sequences[0].tokens == one.sequences[0].tokens


def test_prompt_logprobs_in_a_batch_equal_those_alone(engine: TorchEngine) -> None:
    commands = [
        _command(_prompt(11, 19), "adapter/b", prompt_logprobs=True, max_tokens=1, seed=1),
        _command(_prompt(12, 4), "", prompt_logprobs=True, max_tokens=3, seed=2),
        _command(_prompt(13, 9), "adapter/a", prompt_logprobs=True, last_n=4, max_tokens=1, seed=4),
        _command(_prompt(14, 30), "adapter/a", n=2, max_tokens=5, seed=3),
    ]
    batched = [_decode(body) for body in run_all(engine, commands)]
    for command, response in zip(commands, batched, strict=True):
        _assert_same(response, _decode(_one(engine, command)))
    values = np.frombuffer(batched[2].prompt_logprobs, "<f4")
    assert np.isnan(values[:5]).all() and not np.isnan(values[5:]).any()
    values = np.frombuffer(batched[0].prompt_logprobs, "<f4")
    assert np.isnan(values[0]) and not np.isnan(values[1:]).any()


def test_stops_work_inside_a_batch(engine: TorchEngine) -> None:
    probe = _command(_prompt(21, 6), "adapter/a", max_tokens=20, seed=5, stop_tokens=[])
    free = np.frombuffer(_decode(_one(engine, probe)).sequences[0].tokens, "<i4").tolist()
    stop_token = free[3]
    first = free.index(stop_token)
    stop_text = engine.bases[BASE].tokenizer.decode(free[:5])[-3:]
    commands = [
        _command(_prompt(21, 6), "adapter/a", max_tokens=20, seed=5, stop_tokens=[stop_token]),
        _command(_prompt(21, 6), "adapter/a", max_tokens=20, seed=5, stop_strs=[stop_text]),
        _command(_prompt(22, 13), "adapter/b", n=2, max_tokens=20, seed=6, stop_tokens=[]),
        _command(_prompt(23, 3), "", max_tokens=20, seed=7, stop_tokens=[]),
    ]
    batched = [_decode(body) for body in run_all(engine, commands)]
    by_token = batched[0].sequences[0]
    assert np.frombuffer(by_token.tokens, "<i4").tolist() == free[: first + 1]
    assert by_token.stop_reason == tp.STOP_REASON_STOP
    by_text = batched[1].sequences[0]
    got = np.frombuffer(by_text.tokens, "<i4").tolist()
    assert by_text.stop_reason == tp.STOP_REASON_STOP and got == free[: len(got)]
    assert stop_text in engine.bases[BASE].tokenizer.decode(got)
    assert stop_text not in engine.bases[BASE].tokenizer.decode(got[:-1])
    for response in batched[2:]:
        for sequence in response.sequences:
            assert len(np.frombuffer(sequence.tokens, "<i4")) == 20
            assert sequence.stop_reason == tp.STOP_REASON_LENGTH
    for command, response in zip(commands, batched, strict=True):
        _assert_same(response, _decode(_one(engine, command)))


def test_a_bad_request_fails_alone(engine: TorchEngine) -> None:
    good = _command(_prompt(31, 7), "adapter/b", max_tokens=5, seed=1)
    outcomes = run_all(
        engine,
        [
            _command([], "adapter/a", max_tokens=5),
            good,
            _command([1, 100000], "", max_tokens=5),
            _command(_prompt(32, 4), "adapter/missing", max_tokens=5),
        ],
    )
    assert isinstance(outcomes[0], InvalidRequest)
    assert isinstance(outcomes[2], InvalidRequest)
    assert isinstance(outcomes[3], Exception) and "not loaded" in str(outcomes[3])
    _assert_same(_decode(outcomes[1]), _decode(_one(engine, good)))


def test_the_adapter_cache_keeps_to_its_memory_bound(tmp_path: Path) -> None:
    directories = {}
    for i, key in enumerate(("x/1", "x/2", "x/3", "x/4")):
        directories[key] = tmp_path / str(i)
        _save_adapter(directories[key], 10 + i, ["q_proj", "v_proj"])
    probe = TorchEngine(models.default_cache_dir())
    probe.load_adapter(BASE, "x/1", directories["x/1"])
    size = probe.adapter_bytes(BASE)
    assert size > 0

    engine = TorchEngine(models.default_cache_dir(), adapter_cache_bytes=int(2.5 * size))
    for key in ("x/1", "x/2", "x/3"):
        engine.load_adapter(BASE, key, directories[key])
    assert [engine.has_adapter(BASE, k) for k in ("x/1", "x/2", "x/3")] == [False, True, True]
    assert engine.adapter_bytes(BASE) <= 2.5 * size

    # An adapter that a queued request uses is not evicted, even when it is the oldest.
    engine.add(0, _command(_prompt(41, 4), "x/2", max_tokens=3, seed=1))
    engine.add(1, _command(_prompt(42, 4), "x/4", max_tokens=3, seed=1), directories["x/4"])
    assert [engine.has_adapter(BASE, k) for k in ("x/2", "x/3", "x/4")] == [True, False, True]
    outcomes = dict(engine.step())
    while engine.has_work():
        outcomes.update(engine.step())
    assert all(isinstance(outcomes[t], bytes) for t in (0, 1))


def test_evictions_drop_what_a_runs_newer_sampler_weights_supersede() -> None:
    old, older = "runs/r1/ephemeral/r1:sample:1", "runs/r1/ephemeral/r1:sample:0"
    named, other = "runs/r1/sampler_weights/best", "runs/r2/ephemeral/r2:sample:0"
    new = "runs/r1/ephemeral/r1:sample:2"
    sizes = dict.fromkeys([older, named, old, other, new], 10)
    # Far under the bound: only the same run's earlier unnamed weights go, never what is in use.
    assert evictions(sizes, 1000, keep={new}, loaded=new) == [older, old]
    assert evictions(sizes, 1000, keep={new, old}, loaded=new) == [older]
    # A named checkpoint, another run's weights, or a base-model key supersede nothing.
    assert evictions(sizes, 1000, keep={named}, loaded=named) == []
    assert evictions(sizes, 1000, keep={"adapter/a"}, loaded="adapter/a") == []
    # Over the bound, least recently used next, counting what was already dropped.
    assert evictions(sizes, 20, keep={new}, loaded=new) == [older, old, named]


def test_a_runs_newer_sampler_weights_replace_its_older_ones_in_the_engine(
    tmp_path: Path,
) -> None:
    engine = TorchEngine(models.default_cache_dir())
    keys = [f"runs/r1/ephemeral/r1:sample:{i}" for i in range(3)]
    for i, key in enumerate(keys[:2]):
        _save_adapter(tmp_path / key, 20 + i, ["q_proj", "v_proj"])
    engine.load_adapter(BASE, keys[0], tmp_path / keys[0])
    # The older weights are in use by a queued request: they stay until it is done.
    engine.add(0, _command(_prompt(44, 4), keys[0], max_tokens=3, seed=1))
    engine.add(1, _command(_prompt(45, 4), keys[1], max_tokens=3, seed=1), tmp_path / keys[1])
    assert [engine.has_adapter(BASE, k) for k in keys[:2]] == [True, True]
    while engine.has_work():
        engine.step()
    _save_adapter(tmp_path / keys[2], 22, ["q_proj", "v_proj"])
    engine.load_adapter(BASE, keys[2], tmp_path / keys[2])
    assert [engine.has_adapter(BASE, k) for k in keys] == [False, False, True]
    assert engine.loaded() == {BASE: 1}


def test_a_cancelled_request_leaves_and_the_others_go_on(engine: TorchEngine) -> None:
    kept = _command(_prompt(51, 6), "adapter/a", n=2, max_tokens=10, seed=2, stop_tokens=[])
    engine.add(0, kept)
    engine.add(1, _command(_prompt(52, 9), "adapter/b", n=3, max_tokens=10, seed=3))
    engine.add(2, _command(_prompt(53, 3), "", max_tokens=10, seed=4))
    engine.cancel(2)  # still queued
    outcomes = dict(engine.step())
    engine.cancel(1)  # decoding
    while engine.has_work():
        outcomes.update(engine.step())
    assert set(outcomes) == {0}
    _assert_same(_decode(outcomes[0]), _decode(_one(engine, kept)))


def test_top_k_tables_agree_with_the_logprobs(engine: TorchEngine) -> None:
    command = _command(_prompt(61, 9), "adapter/b", n=2, max_tokens=7, seed=5, stop_tokens=[])
    command.topk_sample_logprobs = 4
    command.topk_prompt_logprobs = 2
    command.prompt_logprobs = True
    command.prompt_logprobs_last_n = 3
    response = _decode(_one(engine, command))
    prompt = list(command.prompt)
    ids = np.frombuffer(response.topk_prompt_logprobs.token_ids, "<i4").reshape(-1, 2)
    values = np.frombuffer(response.topk_prompt_logprobs.logprobs, "<f4").reshape(-1, 2)
    assert ids.shape == (len(prompt), 2)
    assert (values[:6] == -99999.0).all() and (values[6:] > -99999.0).all()
    scored = np.frombuffer(response.prompt_logprobs, "<f4")[6:]
    for i, (row_ids, row_values) in enumerate(zip(ids[6:], values[6:], strict=True)):
        # The prompt token's logprob is at most the best one, and equal when it is the best.
        assert scored[i] <= row_values[0] + 1e-6
        if prompt[6 + i] == row_ids[0]:
            assert abs(scored[i] - row_values[0]) < 1e-6
    for sequence in response.sequences:
        ids = np.frombuffer(sequence.topk_sampled_logprobs.token_ids, "<i4").reshape(-1, 4)
        values = np.frombuffer(sequence.topk_sampled_logprobs.logprobs, "<f4").reshape(-1, 4)
        logprobs = np.frombuffer(sequence.logprobs, "<f4")
        for token, lp, row_ids, row_values in zip(
            np.frombuffer(sequence.tokens, "<i4"), logprobs, ids, values, strict=True
        ):
            if token in row_ids:
                assert abs(row_values[list(row_ids).index(token)] - lp) < 1e-6
            else:
                assert lp <= row_values[-1] + 1e-6


def test_target_ids_and_alternative_tokens_of_the_prompt(engine: TorchEngine) -> None:
    prompt = _prompt(71, 6)
    targets = np.array([[prompt[1], -1], [-1, -1], [3, prompt[3]], [-1, 9], [prompt[5], 4]])
    command = _command(prompt, "adapter/a", prompt_logprobs=True, max_tokens=1, seed=3)
    command.topk_prompt_logprobs = 1
    command.prompt_alt_tokens_k = 3
    command.target_prompt_logprobs.CopyFrom(
        tp.Tensor(dense=targets.astype("<i8").tobytes(), dtype=tp.DTYPE_INT64, shape=[5, 2])
    )
    response = _decode(_one(engine, command))
    scored = np.frombuffer(response.prompt_logprobs, "<f4")
    values = np.frombuffer(response.target_prompt_logprobs.dense, "<f4").reshape(5, 2)
    assert list(response.target_prompt_logprobs.shape) == [5, 2]
    np.testing.assert_allclose(
        [values[0, 0], values[2, 1], values[4, 0]], scored[[1, 3, 5]], atol=1e-6
    )
    assert values[0, 1] == values[1].sum() == 0.0 and values[3, 1] < 0 and values[2, 0] < 0
    alt = response.prompt_alt_tokens
    tokens = np.frombuffer(alt.tokens.dense, "<i8").reshape(5, 3)
    logprobs = np.frombuffer(alt.logprobs.dense, "<f4").reshape(5, 3)
    assert (logprobs <= 0).all() and (logprobs > -50).all()
    assert _decode(_one(engine, command)).prompt_alt_tokens == alt  # the seed fixes the draws
    command.params.temperature = 0.0  # then every draw is the most likely token
    greedy = _decode(_one(engine, command))
    best = np.frombuffer(greedy.topk_prompt_logprobs.token_ids, "<i4")[1:]
    drawn = np.frombuffer(greedy.prompt_alt_tokens.tokens.dense, "<i8").reshape(5, 3)
    assert (drawn == best[:, None]).all()
    assert tokens.shape == (5, 3)


def _frequencies(logits: list[float], params: tp.SamplingParams, draws: int) -> torch.Tensor:
    """How often each token is drawn from ``logits`` in ``draws`` rows, each row with its own
    generator, as the engine draws them."""
    rows = torch.tensor([logits]).expand(draws, -1).contiguous()
    generators = [torch.Generator().manual_seed(seed) for seed in range(draws)]
    picks = _choose(rows, rows.amax(dim=-1), params, generators)
    # Each row's draw is its generator's: the same in any order, and in any company.
    order = torch.randperm(draws, generator=torch.Generator().manual_seed(1))[:500]
    again = [torch.Generator().manual_seed(int(seed)) for seed in order]
    assert torch.equal(_choose(rows[order], rows[order].amax(dim=-1), params, again), picks[order])
    return torch.bincount(picks, minlength=len(logits)).double() / draws


@pytest.mark.parametrize(
    ("params", "expected"),
    [
        # The softmax at temperature 0.5: logits 2, 1, 0.5, 0, -1 doubled.
        (tp.SamplingParams(temperature=0.5, top_k=-1, top_p=1.0), None),
        # The three largest, renormalised.
        (tp.SamplingParams(temperature=1.0, top_k=3, top_p=1.0), [3]),
        # The smallest prefix reaching 0.75 of the mass: 0.563 + 0.207 (0.126 and after cut).
        (tp.SamplingParams(temperature=1.0, top_k=-1, top_p=0.75), [2]),
    ],
)
def test_each_token_is_drawn_at_its_probability_and_a_cut_one_never(
    params: tp.SamplingParams, expected: list[int] | None
) -> None:
    logits = [2.0, 1.0, 0.5, 0.0, -1.0]
    draws = 20000
    probs = torch.softmax(torch.tensor(logits, dtype=torch.float64) / params.temperature, -1)
    if expected is not None:  # the tokens kept
        probs[expected[0] :] = 0
        probs /= probs.sum()
    seen = _frequencies(logits, params, draws)
    # Within 4.5 standard deviations of a binomial count (the draws are seeded: no flakes).
    sigma = (probs * (1 - probs) / draws).sqrt()
    assert ((seen - probs).abs() <= 4.5 * sigma + 1e-12).all(), (seen, probs)
    assert (seen[probs == 0] == 0).all()


def test_a_uniform_at_the_top_draws_a_token_with_mass_never_past_the_end() -> None:
    """Should a uniform times a row's total come to the total (past every index of the
    cumulative sums), the token at which they reach it is drawn: one with a mass."""
    probs = torch.tensor(
        [[0.25, 0.0, 0.75, 0.0, 0.0], [0.5, 0.5, 0.0, 0.0, 0.0], [0.0, 0.0, 0.0, 0.0, 1.0]]
    )
    assert _inverse_cdf(probs, torch.ones(3)).tolist() == [2, 1, 4]  # the rounding case
    assert _inverse_cdf(probs, torch.zeros(3)).tolist() == [0, 0, 4]
    assert _inverse_cdf(probs, torch.full((3,), 0.3)).tolist() == [2, 0, 4]
