"""The whole system with its sampler on vLLM, through the official SDK: an RL-style step (train,
save for the sampler, sample, score the samples with the trainer) and the fidelity gap between
vLLM's logprobs and the trainer's forward on the same sequences.

Runs only where vLLM is installed and asked for (``TINSMITH_TEST_ENGINES`` names ``vllm``):
``make test-vllm`` runs it in vLLM's own environment, on SmolLM2-135M. The adapters are the
SDK's default layout, which includes the unembedding (``lm_head``), so this also checks that
vLLM applies an lm_head LoRA (it does for Llama models, not for Qwen2 ones, whose adapters it
refuses with a 400-class error that says so).
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import numpy as np
import pytest
import tinker
from tinker import types

from tests.conftest import RunningSystem, start_system, stop_system

if "vllm" not in os.environ.get("TINSMITH_TEST_ENGINES", "torch").split(","):
    pytest.skip("the vLLM sampler runs under `make test-vllm`", allow_module_level=True)

pytestmark = pytest.mark.e2e
# A Llama model: vLLM serves LoRA on lm_head for Llama, not for Qwen2 (tinsmith/small).
BASE = "HuggingFaceTB/SmolLM2-135M-Instruct"
TOLERANCE = float(os.environ.get("VLLM_LOGPROB_TOLERANCE", "2e-2"))


@pytest.fixture(scope="module")
def system(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningSystem]:
    env = {"TINSMITH_SAMPLER_ENGINE": "vllm", "TINSMITH_BASE_MODELS": BASE}
    running = start_system(tmp_path_factory.mktemp("vllm-system"), env=env)
    yield running
    stop_system(running)


def test_an_rl_step_on_the_vllm_sampler(system: RunningSystem) -> None:
    service = tinker.ServiceClient(base_url=system.url, api_key="tml-e2e")
    training = service.create_lora_training_client(base_model=BASE, rank=8, seed=5).result()
    data = [
        types.Datum(
            model_input=types.ModelInput.from_ints(list(range(10 + i, 40 + i))),
            loss_fn_inputs={"target_tokens": list(range(11 + i, 41 + i)), "weights": [1.0] * 30},
        )
        for i in range(4)
    ]
    for _ in range(5):  # enough to move every LoRA weight, lm_head's included, off its start
        training.forward_backward(data, "cross_entropy").result()
        training.optim_step(types.AdamParams(learning_rate=1e-2)).result()
    sampler = training.save_weights_and_get_sampling_client().result()
    prompt = [3, 17, 29, 41, 5, 8]
    result = sampler.sample(
        types.ModelInput.from_ints(prompt),
        4,
        types.SamplingParams(max_tokens=24, temperature=1.0, seed=7, stop=[]),
        topk_sample_logprobs=3,
    ).result()
    assert len(result.sequences) == 4

    # Score the samples three ways at once: the trainer's forward, and the sampler's prompt
    # logprobs (compute_logprobs, all four in flight together, which also checks that vLLM's
    # prompt logprobs with an lm_head adapter hold up with several requests in one step).
    sequences = [prompt + list(s.tokens) for s in result.sequences]
    scored = [sampler.compute_logprobs(types.ModelInput.from_ints(t)) for t in sequences]
    gaps, prompt_gaps = [], []
    for sequence, tokens, future in zip(result.sequences, sequences, scored, strict=True):
        assert len(sequence.tokens) == len(sequence.logprobs) == 24
        datum = types.Datum(
            model_input=types.ModelInput.from_ints(tokens[:-1]),
            loss_fn_inputs={"target_tokens": tokens[1:], "weights": [1.0] * (len(tokens) - 1)},
        )
        forward = training.forward([datum], "cross_entropy").result()
        trainer = np.asarray(forward.loss_fn_outputs[0]["logprobs"].tolist())
        gaps.append(float(np.abs(np.asarray(sequence.logprobs) - trainer[len(prompt) - 1 :]).max()))
        prompt_lps = future.result()
        assert prompt_lps[0] is None
        prompt_gaps.append(float(np.abs(np.asarray(prompt_lps[1:], dtype=float) - trainer).max()))
    print(
        f"vLLM sampler vs trainer forward, max |logprob gap|: sampled tokens {max(gaps):.2e}, "
        f"compute_logprobs {max(prompt_gaps):.2e}"
    )
    assert max(gaps) <= TOLERANCE and max(prompt_gaps) <= TOLERANCE

    # The same request on the bare base model samples something else: the adapter was applied.
    base = service.create_sampling_client(base_model=BASE)
    plain = base.sample(
        types.ModelInput.from_ints(prompt),
        4,
        types.SamplingParams(max_tokens=24, temperature=1.0, seed=7, stop=[]),
    ).result()
    assert [s.logprobs for s in plain.sequences] != [s.logprobs for s in result.sequences]
    service.close("success").result(timeout=30)
