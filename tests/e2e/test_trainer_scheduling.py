"""How the trainer schedules work: a run's operations in seq_id order even when the SDK sends
chunks out of order, runs that do not wait on each other, custom losses computed on the client,
and several base models loaded on demand."""

from __future__ import annotations

import asyncio
import re
from collections.abc import Iterator

import httpx
import numpy as np
import pytest
import tinker
import torch
from tinker import types

from tests.conftest import RunningSystem
from tinsmith import events, models, subjects
from tinsmith.bus import Bus


@pytest.fixture(scope="module")
def service(system: RunningSystem) -> Iterator[tinker.ServiceClient]:
    client = tinker.ServiceClient(base_url=system.url, api_key="tml-e2e")
    yield client
    client.close("success").result(timeout=30)


def _datum(ids: list[int], weights: list[float] | None = None) -> types.Datum:
    return types.Datum(
        model_input=types.ModelInput.from_ints(ids[:-1]),
        loss_fn_inputs={
            "target_tokens": ids[1:],
            "weights": weights if weights is not None else [1.0] * (len(ids) - 1),
        },
    )


async def _completion_order(system: RunningSystem, model_id: str) -> list[int]:
    """The seq_ids of the run's requests, in the order the trainer completed them."""
    match = re.search(r"listen: (\S+)", (system.data_dir / "nats-server.conf").read_text())
    assert match
    bus = await Bus.connect(f"nats://{match.group(1)}", name="test-reader")
    try:
        order = []
        for seq in range(1, await bus.last_seq(subjects.EVENTS_STREAM) + 1):
            event = events.decode(await bus.get(subjects.EVENTS_STREAM, seq))
            if events.kind_of(event) == "request_completed":
                done = event.request_completed
                if done.aggregate_id == model_id:
                    order.append(int(done.request_id.rsplit(":", 1)[1]))
        return order
    finally:
        await bus.close()


def test_chunked_forward_backward_runs_in_seq_id_order(
    system: RunningSystem, service: tinker.ServiceClient
) -> None:
    training = service.create_lora_training_client("tinsmith/tiny", rank=4, seed=2).result()
    rng = np.random.default_rng(0)
    data = [_datum(rng.integers(3, 512, size=4).tolist()) for _ in range(2500)]  # 3 chunks
    whole = training.forward(data, "cross_entropy").result()
    out = training.forward_backward(data, "cross_entropy").result()
    assert len(out.loss_fn_outputs) == len(data)
    assert out.metrics["loss:sum"] == pytest.approx(whole.metrics["loss:sum"], rel=1e-5)
    order = asyncio.run(_completion_order(system, training.model_id))
    assert order == sorted(order) and len(order) == 1 + 3 + 3  # create, 3 forward, 3 backward


def test_a_run_waiting_for_a_seq_id_does_not_hold_up_another_run(
    system: RunningSystem, service: tinker.ServiceClient
) -> None:
    stuck = service.create_lora_training_client("tinsmith/tiny", rank=4).result()
    adam = {"learning_rate": 1e-3, "beta1": 0.9, "beta2": 0.95, "eps": 1e-8}
    with httpx.Client(base_url=system.url + "/api/v1", headers={"X-API-Key": "tml-e2e"}) as http:
        later = http.post(
            "/optim_step", json={"model_id": stuck.model_id, "seq_id": 2, "adam_params": adam}
        ).json()
        # seq_id 1 has not arrived: the stuck run waits, and another run goes ahead.
        other = service.create_lora_training_client("tinsmith/tiny", rank=4).result()
        result = other.forward_backward([_datum([1, 2, 3, 4])], "cross_entropy").result(timeout=60)
        assert result.metrics["loss:sum"] > 0
        pending = http.post(
            "/retrieve_future", json={"request_id": later["request_id"]}, timeout=60
        )
        assert pending.status_code == 408 and pending.json()["type"] == "try_again"
        first = http.post(
            "/optim_step", json={"model_id": stuck.model_id, "seq_id": 1, "adam_params": adam}
        ).json()
        for future in (first, later):
            done = http.post(
                "/retrieve_future", json={"request_id": future["request_id"]}, timeout=60
            )
            assert done.json()["type"] == "optim_step"


def test_forward_backward_custom_trains(service: tinker.ServiceClient) -> None:
    """A custom loss runs on the client as forward, then cross_entropy with weights
    -dLoss/dlogprobs. Equal to the built-in loss when it is the same loss; a DPO-style loss on
    preference pairs lowers itself."""
    data = [_datum([5, 9, 17, 33, 65, 129]), _datum([7, 11, 13, 19, 23, 29])]

    def cross_entropy(
        batch: list[types.Datum], logprobs: list[torch.Tensor]
    ) -> tuple[torch.Tensor, dict[str, float]]:
        total = sum(
            -(lp * torch.tensor(d.loss_fn_inputs["weights"].data)).sum()
            for d, lp in zip(batch, logprobs, strict=True)
        )
        assert isinstance(total, torch.Tensor)
        return total, {}

    custom = service.create_lora_training_client("tinsmith/tiny", rank=4, seed=8).result()
    builtin = service.create_lora_training_client("tinsmith/tiny", rank=4, seed=8).result()
    adam = types.AdamParams(learning_rate=1e-2)
    for _ in range(2):
        custom.forward_backward_custom(data, cross_entropy).result()
        custom.optim_step(adam).result()
        builtin.forward_backward(data, "cross_entropy").result()
        builtin.optim_step(adam).result()
    after_custom = custom.forward(data, "cross_entropy").result().metrics["loss:sum"]
    after_builtin = builtin.forward(data, "cross_entropy").result().metrics["loss:sum"]
    assert after_custom == pytest.approx(after_builtin, rel=1e-4)

    def dpo(
        batch: list[types.Datum], logprobs: list[torch.Tensor]
    ) -> tuple[torch.Tensor, dict[str, float]]:
        chosen, rejected = logprobs[0].sum(), logprobs[1].sum()
        loss = -torch.nn.functional.logsigmoid(0.5 * (chosen - rejected))
        return loss, {"margin:mean": float((chosen - rejected).detach())}

    losses = []
    for _ in range(5):
        losses.append(float(custom.forward_backward_custom(data, dpo).result().metrics["loss:sum"]))
        custom.optim_step(adam).result()
    assert losses[-1] < losses[0]


def test_several_base_models_load_on_demand(service: tinker.ServiceClient) -> None:
    """A registered name and a local model directory are two base models, each loaded when
    first used; each run samples from its own."""
    directory = str(models.materialize("tinsmith/tiny"))
    for base_model in ("tinsmith/tiny", directory):
        training = service.create_lora_training_client(base_model, rank=4).result()
        assert training.get_info().model_data.model_name == base_model
        training.forward_backward([_datum([1, 2, 3, 4])], "cross_entropy").result()
        sampler = training.save_weights_and_get_sampling_client().result()
        assert sampler.get_base_model() == base_model
        sequence = sampler.sample(
            types.ModelInput.from_ints([1, 2]), 1, types.SamplingParams(max_tokens=3)
        ).result()
        assert len(sequence.sequences[0].tokens) <= 3
