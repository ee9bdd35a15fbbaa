"""The official tinker SDK trains and samples through gateway, NATS, trainer and sampler."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pytest
import tinker
import torch
from tinker import types

from tests.conftest import RunningSystem

SENTENCES = [
    "the cat sat on the mat.",
    "a dog ran in the park.",
    "hello world, how are you?",
    "pig latin is fun to speak.",
]


@pytest.fixture(scope="module")
def service(system: RunningSystem) -> Iterator[tinker.ServiceClient]:
    client = tinker.ServiceClient(base_url=system.url, api_key="tml-e2e")
    yield client
    client.close("success").result(timeout=30)


@pytest.fixture(scope="module")
def trained(service: tinker.ServiceClient) -> dict[str, object]:
    """Train tinsmith/tiny for 30 steps; later tests look at what came out of it."""
    training = service.create_lora_training_client(base_model="tinsmith/tiny", rank=8, seed=1)
    training = training.result() if hasattr(training, "result") else training
    tokenizer = training.get_tokenizer()
    data = []
    for text in SENTENCES:
        ids = tokenizer.encode(text)
        data.append(
            types.Datum(
                model_input=types.ModelInput.from_ints(ids[:-1]),
                loss_fn_inputs={"target_tokens": ids[1:], "weights": [1.0] * (len(ids) - 1)},
            )
        )
    losses = []
    for _ in range(30):
        fb = training.forward_backward(data, "cross_entropy")
        step = training.optim_step(types.AdamParams(learning_rate=5e-3))
        losses.append(fb.result().metrics["loss:sum"])
        assert step.result().metrics["grad_norm:mean"] > 0
    return {"training": training, "tokenizer": tokenizer, "data": data, "losses": losses}


def test_loss_falls_by_half_over_30_steps(trained: dict[str, object]) -> None:
    losses = trained["losses"]
    assert isinstance(losses, list)
    assert losses[-1] <= 0.5 * losses[0], losses


def test_forward_returns_per_token_logprobs_and_losses(trained: dict[str, object]) -> None:
    training, data = trained["training"], trained["data"]
    assert isinstance(training, tinker.TrainingClient) and isinstance(data, list)
    out = training.forward(data, "cross_entropy").result()
    assert len(out.loss_fn_outputs) == len(data)
    for datum, result in zip(data, out.loss_fn_outputs, strict=True):
        logprobs = result["logprobs"].to_numpy()
        loss = result["elementwise_loss"].to_numpy()
        assert logprobs.shape == (datum.model_input.length,)
        np.testing.assert_allclose(loss, -logprobs, rtol=1e-6)
    total = sum(float(r["elementwise_loss"].to_numpy().sum()) for r in out.loss_fn_outputs)
    assert out.metrics["loss:sum"] == pytest.approx(total, rel=1e-5)


def test_sampler_logprobs_match_trainer_forward(trained: dict[str, object]) -> None:
    """Same weights, two services: compute_logprobs and forward agree within 1e-4 (fp32, CPU)."""
    training, data = trained["training"], trained["data"]
    assert isinstance(training, tinker.TrainingClient) and isinstance(data, list)
    sampler = training.save_weights_and_get_sampling_client().result()
    forward = training.forward(data, "cross_entropy").result()
    for datum, result in zip(data, forward.loss_fn_outputs, strict=True):
        tokens = [*datum.model_input.to_ints(), int(datum.loss_fn_inputs["target_tokens"].data[-1])]
        prompt_lp = sampler.compute_logprobs(types.ModelInput.from_ints(tokens)).result()
        assert prompt_lp[0] is None
        trainer_lp = result["logprobs"].to_numpy()
        assert np.max(np.abs(np.asarray(prompt_lp[1:], np.float32) - trainer_lp)) <= 1e-4


def test_samples_respect_their_parameters(trained: dict[str, object]) -> None:
    training, tokenizer = trained["training"], trained["tokenizer"]
    assert isinstance(training, tinker.TrainingClient)
    sampler = training.save_weights_and_get_sampling_client().result()
    prompt = types.ModelInput.from_ints(tokenizer.encode("the cat"))

    def sample(n: int = 1, **params: object) -> types.SampleResponse:
        return sampler.sample(prompt, n, types.SamplingParams(**params)).result()

    # max_tokens, with no stop at all: exactly max_tokens, each with a logprob.
    free = sample(3, max_tokens=20, seed=7, temperature=1.0, stop=[])
    assert len(free.sequences) == 3
    for seq in free.sequences:
        assert len(seq.tokens) == 20 and seq.stop_reason == "length"
        assert seq.logprobs is not None and len(seq.logprobs) == 20
        assert all(lp <= 0 for lp in seq.logprobs)

    # The same seed gives the same tokens; another seed gives others.
    again = sample(3, max_tokens=20, seed=7, temperature=1.0, stop=[])
    assert [s.tokens for s in again.sequences] == [s.tokens for s in free.sequences]
    other = sample(3, max_tokens=20, seed=8, temperature=1.0, stop=[])
    assert [s.tokens for s in other.sequences] != [s.tokens for s in free.sequences]

    # temperature 0 is greedy, and top_k=1 is greedy at any temperature.
    greedy = sample(max_tokens=10, temperature=0.0, stop=[]).sequences[0].tokens
    assert (
        sample(max_tokens=10, temperature=1.0, top_k=1, seed=3, stop=[]).sequences[0].tokens
        == greedy
    )
    # A tiny top_p keeps only the most likely token too.
    assert (
        sample(max_tokens=10, temperature=1.0, top_p=1e-6, seed=4, stop=[]).sequences[0].tokens
        == greedy
    )

    # A stop token id ends the sequence at its first occurrence, that token included.
    tokens = free.sequences[0].tokens
    stop_id = tokens[5]
    first = tokens.index(stop_id)
    stopped = sample(max_tokens=20, seed=7, temperature=1.0, stop=[stop_id]).sequences[0]
    assert stopped.tokens == tokens[: first + 1] and stopped.stop_reason == "stop"

    # A stop string ends the text: the text ends where the string first completes.
    text = tokenizer.decode(tokens)
    stop_str = text[len(text) // 2 : len(text) // 2 + 2]
    stopped = sample(max_tokens=20, seed=7, temperature=1.0, stop=[stop_str]).sequences[0]
    out = tokenizer.decode(stopped.tokens)
    assert stopped.stop_reason == "stop"
    assert stop_str in out and stop_str not in tokenizer.decode(stopped.tokens[:-1])
    assert text.startswith(tokenizer.decode(stopped.tokens))


def test_named_sampler_weights_serve_a_new_sampling_client(
    service: tinker.ServiceClient, trained: dict[str, object]
) -> None:
    training, tokenizer = trained["training"], trained["tokenizer"]
    assert isinstance(training, tinker.TrainingClient)
    path = training.save_weights_for_sampler("e2e-final").result().path
    assert path == f"tinker://{training.model_id}/sampler_weights/e2e-final"
    sampler = service.create_sampling_client(model_path=path)
    sampler = sampler.result() if hasattr(sampler, "result") else sampler
    assert sampler.get_base_model() == "tinsmith/tiny"
    prompt = types.ModelInput.from_ints(tokenizer.encode("the cat"))
    params = types.SamplingParams(max_tokens=8, temperature=0.0, stop=[])
    fresh = sampler.sample(prompt, 1, params).result().sequences[0].tokens
    ephemeral = training.save_weights_and_get_sampling_client().result()
    assert ephemeral.sample(prompt, 1, params).result().sequences[0].tokens == fresh


def test_the_sdk_reads_top_k_target_and_alternative_logprobs(trained: dict[str, object]) -> None:
    training, tokenizer = trained["training"], trained["tokenizer"]
    assert isinstance(training, tinker.TrainingClient)
    sampler = training.save_weights_and_get_sampling_client().result()
    ids = tokenizer.encode("the cat sat on")
    prompt = types.ModelInput.from_ints(ids)
    params = types.SamplingParams(max_tokens=5, temperature=1.0, seed=2, stop=[])
    result = sampler.sample(
        prompt,
        2,
        params,
        include_prompt_logprobs=True,
        topk_prompt_logprobs=3,
        topk_sample_logprobs=2,
        prompt_alt_tokens_k=4,
        target_prompt_logprobs=types.TensorData.from_torch_sparse(
            torch.tensor([[ids[1], -1]] + [[-1, -1]] * (len(ids) - 3) + [[ids[-1], 7]]),
            pad_value=-1,
        ),
    ).result()
    prompt_lps = result.prompt_logprobs
    assert prompt_lps is not None and prompt_lps[0] is None
    top = result.topk_prompt_logprobs
    assert top is not None and len(top) == len(ids) and top[0] is None
    for i in range(1, len(ids)):
        entries = top[i]
        assert entries is not None and len(entries) == 3
        # The prompt token's logprob is within the top 3 exactly when its token is.
        if ids[i] in [token for token, _ in entries]:
            assert dict(entries)[ids[i]] == pytest.approx(prompt_lps[i], abs=1e-5)
        else:
            assert prompt_lps[i] <= entries[-1][1] + 1e-6
    for sequence in result.sequences:
        assert sequence.topk_logprobs is not None
        assert len(sequence.topk_logprobs) == len(sequence.tokens) == 5
    # Target ids: row i is scored at prompt position i + 1; CSR in, CSR out.
    targets = result.target_prompt_logprobs
    assert targets is not None and targets.sparse_crow_indices is not None
    values = targets.to_torch().to_dense()
    assert values[0, 0].item() == pytest.approx(prompt_lps[1], abs=1e-5)
    assert values[-1, 0].item() == pytest.approx(prompt_lps[-1], abs=1e-5)
    assert values[-1, 1].item() < 0 and values[1:-1].abs().sum().item() == 0
    alt = result.prompt_alt_tokens
    assert alt is not None
    tokens, logprobs = alt.tokens.to_numpy(), alt.logprobs.to_numpy()
    assert tokens.shape == logprobs.shape == (len(ids) - 1, 4)
    assert (logprobs <= 0).all() and ((tokens >= 0) & (tokens < 512)).all()
