"""SDK methods that docs/sdk-methods.md lists and no other test drives, through the official SDK
against the running system: a custom loss made with ``create_custom_loss`` (traced on the
client, which tinsmith's client config asks to run it there), and a SamplingClient passed on as
a handle or a pickle (its base model and tokenizer read back), which another tenant's key
cannot use."""

from __future__ import annotations

import pickle
import uuid

import pytest
import tinker
import torch
from tinker import types

from tests.conftest import RunningSystem

pytestmark = pytest.mark.e2e

PROMPT = types.ModelInput.from_ints([5, 6, 7, 8])
GREEDY = types.SamplingParams(max_tokens=5, temperature=0.0, seed=3, stop=[])


def _service(system: RunningSystem) -> tuple[str, tinker.ServiceClient]:
    key = f"tml-methods-{uuid.uuid4().hex[:8]}"
    return key, tinker.ServiceClient(base_url=system.url, api_key=key)


def test_a_custom_loss_handle_trains_like_the_built_in_loss(system: RunningSystem) -> None:
    _, service = _service(system)

    def neg_ll(
        logprobs: torch.Tensor, weights: torch.Tensor
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        loss = -(logprobs * weights).sum()
        return loss, {"custom/neg_ll:sum": loss}

    handle = service.create_custom_loss(neg_ll, {"logprobs": 1, "weights": 1}).result()
    datum = types.Datum(
        model_input=types.ModelInput.from_ints([1, 2, 3, 4]),
        loss_fn_inputs={"target_tokens": [2, 3, 4, 5], "weights": [1.0, 1.0, 0.0, 1.0]},
    )
    custom = service.create_lora_training_client("tinsmith/tiny", rank=4, seed=5).result()
    builtin = service.create_lora_training_client("tinsmith/tiny", rank=4, seed=5).result()
    out = custom.forward_backward_custom([datum], handle).result(timeout=120)
    expected = builtin.forward_backward([datum], "cross_entropy").result(timeout=120)
    assert out.metrics["custom/neg_ll:sum"] == pytest.approx(expected.metrics["loss:sum"], rel=1e-5)
    service.close("success").result(timeout=30)


def test_a_sampler_handle_and_a_pickle_sample_on_the_same_sampler(system: RunningSystem) -> None:
    key, service = _service(system)
    sampler = service.create_sampling_client(base_model="tinsmith/tiny").result()
    expected = sampler.sample(PROMPT, 1, GREEDY).result(timeout=120).sequences[0].tokens

    handle = sampler.get_sampler_handle()
    again = tinker.SamplingClient.from_sampler_handle(handle, api_key=key)
    assert again.sample(PROMPT, 1, GREEDY).result(timeout=120).sequences[0].tokens == expected
    unpickled = pickle.loads(pickle.dumps(sampler))
    assert unpickled.sample(PROMPT, 1, GREEDY).result(timeout=120).sequences[0].tokens == expected
    assert unpickled.get_base_model() == "tinsmith/tiny"
    assert unpickled.get_tokenizer().encode("the cat sat") == sampler.get_tokenizer().encode(
        "the cat sat"
    )

    stranger = tinker.SamplingClient.from_sampler_handle(handle, api_key="tml-not-the-owner")
    with pytest.raises(tinker.NotFoundError):
        stranger.sample(PROMPT, 1, GREEDY).result(timeout=120)
    service.close("success").result(timeout=30)
    # A client made from a handle or a pickle has a holder of its own that heart-beats the
    # session until the server answers 410 or it is closed: the stranger's is answered 404.
    for client in (again, unpickled, stranger):
        client.holder.close()
