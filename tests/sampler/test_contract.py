"""The contract every sampling engine keeps, run against each one in-process.

The engines are listed in ``TINSMITH_TEST_ENGINES`` (default ``torch``); ``make test-vllm`` runs
this file with ``vllm`` in vLLM's own virtual environment. Expected values come from a plain
transformers float32 forward of the same sequence, with each adapter merged into the weights by
hand (W + alpha/r * B @ A): a reference that shares no code with either engine. The adapters are
written in PEFT's on-disk format here, without peft, so that the vLLM environment needs none.

The torch engine must match the reference within 1e-4 (it computes in float32); vLLM within
``VLLM_LOGPROB_TOLERANCE`` (its kernels differ), and its measured gap is printed.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM

from services.sampler.config import SamplerConfig
from services.sampler.engine import AdapterMissing, Engine, make_engine, run_all
from tinsmith import models
from tinsmith._proto import bus_pb2 as bus
from tinsmith._proto import tinker_public_pb2 as tp
from tinsmith.failures import InvalidRequest

BASE = os.environ.get("TINSMITH_TEST_BASE", models.TINY)
ENGINES = os.environ.get("TINSMITH_TEST_ENGINES", "torch").split(",")
TOLERANCE = {"torch": 1e-4, "vllm": float(os.environ.get("VLLM_LOGPROB_TOLERANCE", "2e-2"))}
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
RANK, ALPHA = 4, 32


# --- adapters and the reference ------------------------------------------------------------


def _linear_shapes(model: torch.nn.Module) -> dict[str, tuple[int, int]]:
    """(out, in) of every Linear the adapters target, by module path."""
    return {
        name: (module.out_features, module.in_features)
        for name, module in model.named_modules()
        if isinstance(module, torch.nn.Linear) and name.rsplit(".", 1)[-1] in TARGETS
    }


def _write_adapter(
    directory: Path, seed: int, shapes: dict[str, tuple[int, int]]
) -> dict[str, torch.Tensor]:
    """A rank-4 adapter on every attention and MLP projection, in PEFT's format; returns each
    module's ``(A, B)``."""
    generator = torch.Generator().manual_seed(seed)
    tensors, pairs = {}, {}
    for name, (out_features, in_features) in shapes.items():
        a = torch.randn(RANK, in_features, generator=generator) * 0.3
        b = torch.randn(out_features, RANK, generator=generator) * 0.3
        tensors[f"base_model.model.{name}.lora_A.weight"] = a.contiguous()
        tensors[f"base_model.model.{name}.lora_B.weight"] = b.contiguous()
        pairs[name] = (a, b)
    directory.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(directory / "adapter_model.safetensors"))
    config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": BASE,
        "r": RANK,
        "lora_alpha": ALPHA,
        "lora_dropout": 0.0,
        "target_modules": TARGETS,
        "bias": "none",
        "fan_in_fan_out": False,
        "use_rslora": False,
        "modules_to_save": None,
    }
    (directory / "adapter_config.json").write_text(json.dumps(config))
    return pairs


class Reference:
    """Logprobs from a plain float32 forward of the base model, or of a copy with an adapter's
    path added to each projection it targets, unmerged, as PEFT computes it (its ``B (A x)``
    times the scale added to the projection's output). Merged into the weights instead, these
    adapters, far larger than the weights, round differently enough to move a logprob by 1e-4
    now and then."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.models: dict[str, torch.nn.Module] = {"": self._load()}

    def _load(self) -> torch.nn.Module:
        model = AutoModelForCausalLM.from_pretrained(self.directory, dtype=torch.float32)
        return model.eval()

    def add(self, key: str, pairs: dict[str, tuple[torch.Tensor, torch.Tensor]]) -> None:
        model = self._load()
        modules = dict(model.named_modules())
        for name, (a, b) in pairs.items():

            def adapted(
                module: torch.nn.Module,
                inputs: tuple[torch.Tensor, ...],
                out: torch.Tensor,
                a: torch.Tensor = a,
                b: torch.Tensor = b,
            ) -> torch.Tensor:
                return out + (inputs[0] @ a.T) @ b.T * (ALPHA / RANK)

            modules[name].register_forward_hook(adapted)
        self.models[key] = model

    @torch.inference_mode()
    def logprobs(self, adapter: str, tokens: list[int]) -> torch.Tensor:
        """[len(tokens), vocab]: row i is the distribution of token i + 1."""
        logits = self.models[adapter](torch.tensor([tokens])).logits[0].float()
        return torch.log_softmax(logits, dim=-1)


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Reference, dict[str, Path]]:
    cache_dir = models.default_cache_dir()
    reference = Reference(models.materialize(BASE, cache_dir))
    shapes = _linear_shapes(reference.models[""])
    adapters = {}
    # a and b for most tests; eight in all, as many as the vLLM engine runs in one batch.
    for seed, key in enumerate(["adapter/a", "adapter/b"] + [f"adapter/{c}" for c in "cdefgh"], 1):
        directory = tmp_path_factory.mktemp(key.replace("/", "-"))
        reference.add(key, _write_adapter(directory, seed, shapes))
        adapters[key] = directory
    return cache_dir, reference, adapters


@pytest.fixture(scope="module", params=ENGINES)
def engine(
    request: pytest.FixtureRequest, setup: tuple[Path, Reference, dict[str, Path]]
) -> Iterator[Engine]:
    cache_dir, _, adapters = setup
    config = SamplerConfig(
        blob_url="memory://", cache_dir=cache_dir, engine=request.param, torch_threads=2
    )
    engine = make_engine(config)
    engine.init_compute_thread()
    engine.load_base(BASE)
    for ticket, (key, directory) in enumerate(adapters.items()):  # load each through ``add``
        engine.add(-1 - ticket, _command([1, 2, 3], key, max_tokens=0), directory)
    while engine.has_work():
        engine.step()
    yield engine


@pytest.fixture
def reference(setup: tuple[Path, Reference, dict[str, Path]]) -> Reference:
    return setup[1]


@pytest.fixture
def tolerance(request: pytest.FixtureRequest) -> float:
    return TOLERANCE[request.node.callspec.params["engine"]]


# --- requests ------------------------------------------------------------------------------


def _command(
    prompt: list[int],
    adapter: str = "",
    n: int = 1,
    prompt_logprobs: bool = False,
    last_n: int | None = None,
    topk_prompt: int = 0,
    topk_sample: int = 0,
    **params: object,
) -> bus.Sample:
    stop_strs = params.pop("stop_strs", None)
    stop_tokens = params.pop("stop_tokens", None)
    params = {"temperature": 1.0, "top_k": -1, "top_p": 1.0, "max_tokens": 16, **params}
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
        topk_prompt_logprobs=topk_prompt,
        topk_sample_logprobs=topk_sample,
    )
    if last_n is not None:
        command.prompt_logprobs_last_n = last_n
    return command


def _run(engine: Engine, *commands: bus.Sample) -> list[tp.SampleResponse]:
    responses = []
    for body in run_all(engine, commands):
        assert isinstance(body, bytes), body
        responses.append(tp.SampleResponse.FromString(body))
    return responses


def _tokens(sequence: tp.SampledSequence) -> list[int]:
    return np.frombuffer(sequence.tokens, "<i4").tolist()


def _logprobs(sequence: tp.SampledSequence) -> np.ndarray:
    return np.frombuffer(sequence.logprobs, "<f4")


def _topk(message: tp.TopkLogprobs) -> tuple[np.ndarray, np.ndarray]:
    shape = (message.length, message.k)
    return (
        np.frombuffer(message.token_ids, "<i4").reshape(shape),
        np.frombuffer(message.logprobs, "<f4").reshape(shape),
    )


def _prompt(seed: int, length: int) -> list[int]:
    return [int(t) for t in np.random.default_rng(seed).integers(3, 500, size=length)]


def _gap(
    reference: Reference, adapter: str, prompt: list[int], sequence: tp.SampledSequence
) -> float:
    """The largest difference between the engine's logprobs of its sampled tokens and the
    reference's on the same sequence."""
    tokens = _tokens(sequence)
    table = reference.logprobs(adapter, prompt + tokens)
    want = table[len(prompt) - 1 : -1].gather(-1, torch.tensor(tokens)[:, None])[:, 0].numpy()
    return float(np.abs(_logprobs(sequence) - want).max())


# --- the contract ----------------------------------------------------------------------------


def test_sampled_logprobs_match_the_reference(
    engine: Engine, reference: Reference, tolerance: float
) -> None:
    gaps = []
    for i, adapter in enumerate(("", "adapter/a", "adapter/b")):
        prompt = _prompt(i, 7 + 5 * i)
        (response,) = _run(engine, _command(prompt, adapter, n=3, seed=11, max_tokens=24))
        assert len(response.sequences) == 3
        for sequence in response.sequences:
            assert len(_tokens(sequence)) == len(_logprobs(sequence)) > 0
            gaps.append(_gap(reference, adapter, prompt, sequence))
    print(f"max |engine - reference| logprob gap over {len(gaps)} sequences: {max(gaps):.2e}")
    assert max(gaps) <= tolerance


def test_greedy_follows_the_reference_argmax(engine: Engine, reference: Reference) -> None:
    prompt = _prompt(20, 9)
    (response,) = _run(
        engine, _command(prompt, "adapter/a", temperature=0.0, max_tokens=12, stop_tokens=[])
    )
    tokens = _tokens(response.sequences[0])
    table = reference.logprobs("adapter/a", prompt + tokens)
    assert tokens == table[len(prompt) - 1 : -1].argmax(-1).tolist()


def test_a_seed_fixes_the_tokens(engine: Engine) -> None:
    command = _command(_prompt(30, 6), "adapter/b", n=2, seed=1234, max_tokens=20, stop_tokens=[])
    first, again = _run(engine, command, command)
    assert [_tokens(s) for s in first.sequences] == [_tokens(s) for s in again.sequences]
    (other,) = _run(
        engine, _command(_prompt(30, 6), "adapter/b", n=2, seed=99, max_tokens=20, stop_tokens=[])
    )
    assert [_tokens(s) for s in other.sequences] != [_tokens(s) for s in first.sequences]


def test_top_k_and_top_p_restrict_the_choice(engine: Engine, reference: Reference) -> None:
    prompt = _prompt(40, 5)
    (top1,) = _run(engine, _command(prompt, "", top_k=1, seed=3, max_tokens=8, stop_tokens=[]))
    (greedy,) = _run(engine, _command(prompt, "", temperature=0.0, max_tokens=8, stop_tokens=[]))
    assert _tokens(top1.sequences[0]) == _tokens(greedy.sequences[0])
    (nucleus,) = _run(
        engine, _command(prompt, "", n=4, top_p=0.3, seed=5, max_tokens=6, stop_tokens=[])
    )
    for sequence in nucleus.sequences:
        tokens = _tokens(sequence)
        table = reference.logprobs("", prompt + tokens)[len(prompt) - 1 : -1]
        for row, token in zip(table, tokens, strict=True):
            probs = row.exp()
            # The token is inside the smallest set of most likely tokens holding 30% of the mass.
            assert float(probs[probs > probs[token]].sum()) < 0.3 + 1e-4


def test_max_tokens_and_an_empty_stop_list_run_to_the_length(engine: Engine) -> None:
    (response,) = _run(
        engine, _command(_prompt(50, 4), "adapter/a", n=2, seed=1, max_tokens=13, stop_tokens=[])
    )
    for sequence in response.sequences:
        assert len(_tokens(sequence)) == 13 and sequence.stop_reason == tp.STOP_REASON_LENGTH


def test_stop_token_ids_and_stop_strings(engine: Engine) -> None:
    prompt = _prompt(60, 6)
    (free,) = _run(engine, _command(prompt, "adapter/b", seed=5, max_tokens=20, stop_tokens=[]))
    tokens = _tokens(free.sequences[0])
    stop_token = tokens[4]
    (by_id,) = _run(
        engine, _command(prompt, "adapter/b", seed=5, max_tokens=20, stop_tokens=[stop_token])
    )
    assert _tokens(by_id.sequences[0]) == tokens[: tokens.index(stop_token) + 1]
    assert by_id.sequences[0].stop_reason == tp.STOP_REASON_STOP

    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(
        str(models.materialize(BASE, models.default_cache_dir()) / "tokenizer.json")
    )
    text = tokenizer.decode(tokens[:8])
    stop_text = text[-3:]  # usually spans a token boundary
    (by_text,) = _run(
        engine, _command(prompt, "adapter/b", seed=5, max_tokens=20, stop_strs=[stop_text])
    )
    got = _tokens(by_text.sequences[0])
    assert by_text.sequences[0].stop_reason == tp.STOP_REASON_STOP
    assert got == tokens[: len(got)]
    assert stop_text in tokenizer.decode(got) and stop_text not in tokenizer.decode(got[:-1])


def test_prompt_logprobs_and_their_window(
    engine: Engine, reference: Reference, tolerance: float
) -> None:
    prompt = _prompt(70, 12)
    full, window = _run(
        engine,
        _command(prompt, "adapter/a", prompt_logprobs=True, max_tokens=1),
        _command(prompt, "adapter/a", prompt_logprobs=True, last_n=4, max_tokens=1),
    )
    table = reference.logprobs("adapter/a", prompt)
    want = table[:-1].gather(-1, torch.tensor(prompt[1:])[:, None])[:, 0].numpy()
    values = np.frombuffer(full.prompt_logprobs, "<f4")
    assert len(values) == len(prompt) and np.isnan(values[0])
    assert np.abs(values[1:] - want).max() <= tolerance
    values = np.frombuffer(window.prompt_logprobs, "<f4")
    assert np.isnan(values[:8]).all() and np.abs(values[8:] - want[7:]).max() <= tolerance


def test_top_k_logprobs_of_the_prompt_and_the_samples(
    engine: Engine, reference: Reference, tolerance: float
) -> None:
    prompt = _prompt(80, 10)
    (response,) = _run(
        engine,
        _command(
            prompt,
            "adapter/b",
            n=2,
            seed=8,
            max_tokens=6,
            topk_prompt=5,
            topk_sample=3,
            stop_tokens=[],
        ),
    )
    ids, values = _topk(response.topk_prompt_logprobs)
    assert ids.shape == (len(prompt), 5)
    assert (ids[0] == 0).all() and (values[0] == -99999.0).all()  # position 0 has no context
    table = reference.logprobs("adapter/b", prompt)
    want = table[:-1].topk(5, dim=-1)
    np.testing.assert_allclose(values[1:], want.values.numpy(), atol=tolerance)
    assert (ids[1:] == want.indices.numpy()).mean() > 0.95  # near-ties may swap
    for sequence in response.sequences:
        tokens = _tokens(sequence)
        ids, values = _topk(sequence.topk_sampled_logprobs)
        assert ids.shape == (len(tokens), 3)
        table = reference.logprobs("adapter/b", prompt + tokens)[len(prompt) - 1 : -1]
        np.testing.assert_allclose(values, table.topk(3, dim=-1).values.numpy(), atol=tolerance)
        assert (np.diff(values, axis=1) <= 0).all()


def test_adapters_change_the_output_and_mix_in_one_batch(engine: Engine, tolerance: float) -> None:
    prompt = _prompt(90, 8)
    commands = [
        _command(prompt, key, seed=4, max_tokens=10, stop_tokens=[])
        for key in ("", "adapter/a", "adapter/b")
    ]
    together = _run(engine, *commands)
    alone = [_run(engine, command)[0] for command in commands]
    logprobs = [_logprobs(r.sequences[0]) for r in together]
    assert not np.allclose(logprobs[0], logprobs[1]) and not np.allclose(logprobs[1], logprobs[2])
    for mixed, single in zip(together, alone, strict=True):
        assert _tokens(mixed.sequences[0]) == _tokens(single.sequences[0])
        assert (
            np.abs(_logprobs(mixed.sequences[0]) - _logprobs(single.sequences[0])).max()
            <= tolerance
        )


def test_requests_join_a_batch_that_is_running(engine: Engine, tolerance: float) -> None:
    """Requests with and without adapters, added while others decode, each get what they get
    alone: an adapter's request joining base-model rows, and base-model rows joining adapter
    ones (vLLM's CPU LoRA ops once gave such rows another request's adapter)."""
    early = [
        _command(_prompt(100, 5), "adapter/a", n=2, seed=1, max_tokens=20, stop_tokens=[]),
        _command(_prompt(102, 7), "", n=1, seed=3, max_tokens=18, stop_tokens=[]),
    ]
    late = [
        _command(_prompt(101, 13), "adapter/b", n=1, seed=2, max_tokens=8, stop_tokens=[]),
        _command(_prompt(103, 4), "", n=2, seed=4, max_tokens=10, stop_tokens=[]),
    ]
    alone = {t: _run(engine, command)[0] for t, command in enumerate(early + late)}
    for ticket, command in enumerate(early):
        engine.add(ticket, command)
    outcomes: dict[int, bytes | Exception] = {}
    for _ in range(5):
        outcomes.update(engine.step())
    for ticket, command in enumerate(late, start=len(early)):
        engine.add(ticket, command)
    while engine.has_work():
        outcomes.update(engine.step())
    assert sorted(outcomes) == sorted(alone)
    for ticket, body in outcomes.items():
        assert isinstance(body, bytes)
        response = tp.SampleResponse.FromString(body)
        for got, want in zip(response.sequences, alone[ticket].sequences, strict=True):
            assert _tokens(got) == _tokens(want), ticket
            assert np.abs(_logprobs(got) - _logprobs(want)).max() <= tolerance


def test_a_base_model_request_beside_a_full_set_of_adapters(
    engine: Engine, tolerance: float
) -> None:
    """Every adapter slot busy, and a base-model request in the same batch: it must get no
    adapter (vLLM 0.32's CPU LoRA ops gave such rows the last slot's)."""
    keys = ["adapter/a", "adapter/b"] + [f"adapter/{c}" for c in "cdefgh"]
    commands = [_command(_prompt(140 + i, 6), k, seed=i, max_tokens=6) for i, k in enumerate(keys)]
    base = _command(_prompt(150, 6), "", n=2, seed=9, max_tokens=12, stop_tokens=[])
    (alone,) = _run(engine, base)
    together = _run(engine, *commands, base)
    for got, want in zip(together[-1].sequences, alone.sequences, strict=True):
        assert _tokens(got) == _tokens(want)
        assert np.abs(_logprobs(got) - _logprobs(want)).max() <= tolerance


def test_bad_requests_fail_alone(engine: Engine) -> None:
    good = _command(_prompt(110, 4), "adapter/a", seed=1, max_tokens=5)
    outcomes = run_all(
        engine,
        [
            _command([], "adapter/a"),
            good,
            _command([1, 10**7], ""),
            _command(_prompt(111, 4), "adapter/never-loaded"),
        ],
    )
    assert isinstance(outcomes[0], InvalidRequest)
    assert isinstance(outcomes[1], bytes)
    assert isinstance(outcomes[2], InvalidRequest)
    assert isinstance(outcomes[3], AdapterMissing)


def test_end_of_sequence_stops_unless_the_stop_list_is_empty(engine: Engine) -> None:
    directory = models.materialize(BASE, models.default_cache_dir())
    eos = json.loads((directory / "config.json").read_text())["eos_token_id"]
    prompt = _prompt(120, 5)
    for seed in range(40):  # find a seeded sequence that ends at end-of-sequence
        (free,) = _run(engine, _command(prompt, "adapter/a", n=8, seed=seed, max_tokens=64))
        ended = [i for i, s in enumerate(free.sequences) if s.stop_reason == tp.STOP_REASON_STOP]
        if ended:
            break
    else:
        pytest.skip("no sampled sequence reached end-of-sequence")
    sequence = free.sequences[ended[0]]
    assert _tokens(sequence)[-1] == eos
    for empty in ({"stop_tokens": []}, {"stop_strs": []}):  # [] in either form: no stop at all
        (longer,) = _run(
            engine, _command(prompt, "adapter/a", n=8, seed=seed, max_tokens=64, **empty)
        )
        went_on = longer.sequences[ended[0]]
        assert went_on.stop_reason == tp.STOP_REASON_LENGTH and len(_tokens(went_on)) == 64
        assert _tokens(went_on)[: len(_tokens(sequence))] == _tokens(sequence)


def test_target_prompt_logprobs_score_the_named_ids(
    engine: Engine, reference: Reference, tolerance: float
) -> None:
    prompt = _prompt(130, 7)
    ids = np.full((6, 3), -1, dtype=np.int64)
    ids[0, 0], ids[2, :] = prompt[1], [5, prompt[3], 77]
    ids[5, 1] = 9
    command = _command(prompt, "adapter/b", max_tokens=1, seed=1)
    command.target_prompt_logprobs.CopyFrom(
        tp.Tensor(dense=ids.tobytes(), dtype=tp.DTYPE_INT64, shape=[6, 3])
    )
    (outcome,) = run_all(engine, [command])
    if isinstance(outcome, InvalidRequest) and "model runner" in outcome.detail:
        pytest.skip(outcome.detail)  # vLLM scores ids only with its V2 model runner (GPU)
    assert isinstance(outcome, bytes), outcome
    response = tp.SampleResponse.FromString(outcome)
    values = np.frombuffer(response.target_prompt_logprobs.dense, "<f4").reshape(6, 3)
    table = reference.logprobs("adapter/b", prompt)[:-1]  # row i scores position i + 1
    for (row, col), token in np.ndenumerate(ids):
        want = 0.0 if token < 0 else float(table[row, token])
        assert abs(values[row, col] - want) <= tolerance, (row, col)


def test_a_streamed_request_reports_its_tokens_step_by_step(engine: Engine) -> None:
    """``progress`` reports a streamed request's tokens (``stream_to``) as they come, and they
    add up to exactly its answer, which streaming does not change; a request that does not
    stream reports nothing."""
    plain = _command(_prompt(160, 6), "adapter/a", n=2, seed=8, max_tokens=12, stop_tokens=[])
    streamed = bus.Sample()
    streamed.CopyFrom(plain)
    streamed.stream_to = "gateway"
    (alone,) = _run(engine, plain)
    engine.add(0, streamed)
    engine.add(1, plain)
    outcomes: dict[int, bytes | Exception] = {}
    got: dict[int, tuple[list[int], list[float]]] = {0: ([], []), 1: ([], [])}
    steps_with_news = 0
    while engine.has_work():
        outcomes.update(engine.step())
        deltas = engine.progress()
        steps_with_news += bool(deltas)
        for delta in deltas:
            assert delta.ticket == 0
            tokens, logprobs = got[delta.index]
            assert delta.offset == len(tokens)
            tokens.extend(delta.tokens)
            logprobs.extend(delta.logprobs)
    assert engine.progress() == []
    assert steps_with_news >= 6  # step by step, not all at the end
    for ticket in (0, 1):
        body = outcomes[ticket]
        assert isinstance(body, bytes)
        response = tp.SampleResponse.FromString(body)
        assert len(response.sequences) == 2
        for index, (sequence, want) in enumerate(
            zip(response.sequences, alone.sequences, strict=True)
        ):
            assert _tokens(sequence) == _tokens(want)
            if ticket == 0:
                assert got[index][0] == _tokens(sequence)
                np.testing.assert_array_equal(np.asarray(got[index][1], "<f4"), _logprobs(sequence))


def test_a_cancelled_request_leaves_the_engine(engine: Engine) -> None:
    """Cancelling drops a running request at the next step and a queued one at once; it is
    never answered, and the others go on unchanged."""
    long = _command(_prompt(170, 5), "adapter/b", n=2, seed=1, max_tokens=200, stop_tokens=[])
    long.stream_to = "gateway"
    short = _command(_prompt(171, 5), "", seed=2, max_tokens=8, stop_tokens=[])
    (alone,) = _run(engine, short)
    engine.add(0, long)
    engine.add(1, short)
    outcomes: dict[int, bytes | Exception] = {}
    for _ in range(3):
        outcomes.update(engine.step())
    engine.progress()
    engine.add(2, _command(_prompt(172, 5), "adapter/a", seed=3, max_tokens=50))
    engine.cancel(2)  # before it started
    engine.cancel(0)  # while it runs
    engine.cancel(99)  # never held: ignored
    steps = 0
    while engine.has_work():
        outcomes.update(engine.step())
        assert all(delta.ticket != 0 for delta in engine.progress())
        steps += 1
    assert sorted(outcomes) == [1]
    assert steps <= 8  # the short one's remaining tokens, not the long one's 200
    body = outcomes[1]
    assert isinstance(body, bytes)
    assert _tokens(tp.SampleResponse.FromString(body).sequences[0]) == _tokens(alone.sequences[0])
