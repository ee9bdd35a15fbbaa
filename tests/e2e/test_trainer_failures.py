"""A training request that fails in the trainer, through the SDK: the call raises with the
trainer's detail, and its run goes on exactly as if the request had never been sent."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pytest
import tinker
from tinker import types

from tests.conftest import RunningSystem

ADAM = types.AdamParams(learning_rate=1e-2, weight_decay=0.01, grad_clip_norm=5.0)


@pytest.fixture(scope="module")
def service(system: RunningSystem) -> Iterator[tinker.ServiceClient]:
    client = tinker.ServiceClient(base_url=system.url, api_key="tml-e2e")
    yield client
    client.close("success").result(timeout=30)


def _batch(seed: int, **extra: float) -> list[types.Datum]:
    """Cross-entropy data; with ``extra``, each named loss_fn_input set to that value."""
    rng = np.random.default_rng(seed)
    data = []
    for length in (12, 7):
        ids = rng.integers(3, 512, size=length + 1).tolist()
        inputs: dict[str, list[int] | list[float]] = {"target_tokens": ids[1:]}
        inputs.update({key: [value] * length for key, value in extra.items()})
        data.append(
            types.Datum(
                model_input=types.ModelInput.from_ints(ids[:-1]),
                loss_fn_inputs=inputs,  # type: ignore[arg-type]
            )
        )
    return data


def test_a_forward_backward_with_a_non_finite_loss_fails_alone(
    service: tinker.ServiceClient,
) -> None:
    hit, clean = (
        service.create_lora_training_client(base_model="tinsmith/tiny", rank=4, seed=5).result()
        for _ in range(2)
    )
    for client in (hit, clean):
        client.forward_backward(_batch(0), "cross_entropy").result()
    # Sampler logprobs of -1e30: the importance ratio exp(p - q) is infinite.
    diverging = _batch(1, logprobs=-1e30, advantages=1.0)

    with pytest.raises(tinker.RequestFailedError, match="importance ratio"):
        hit.forward_backward(diverging, "importance_sampling").result(timeout=120)

    for client in (hit, clean):
        client.forward_backward(_batch(2), "cross_entropy").result()
        client.optim_step(ADAM).result()
    probes = [c.forward(_batch(3), "cross_entropy").result() for c in (hit, clean)]
    logprobs = [[o["logprobs"].data for o in probe.loss_fn_outputs] for probe in probes]
    assert logprobs[0] == logprobs[1]  # bit for bit, as if the bad request never came
