"""A future still pending after the long poll is answered 408 try_again, which the SDK re-polls
at once: with a long poll far shorter than every step, the whole flow still works."""

from __future__ import annotations

from pathlib import Path

import tinker
from tinker import types

from tests.conftest import start_system, stop_system


def test_the_sdk_re_polls_pending_futures(tmp_path: Path) -> None:
    system = start_system(tmp_path, env={"TINSMITH_LONG_POLL_S": "0.01"})
    try:
        service = tinker.ServiceClient(base_url=system.url, api_key="tml-e2e")
        training = service.create_lora_training_client("tinsmith/tiny", rank=4).result()
        datum = types.Datum(
            model_input=types.ModelInput.from_ints([1, 2, 3, 4, 5]),
            loss_fn_inputs={"target_tokens": [2, 3, 4, 5, 6], "weights": [1.0] * 5},
        )
        for _ in range(3):
            fb = training.forward_backward([datum], "cross_entropy")
            training.optim_step(types.AdamParams(learning_rate=1e-3)).result()
            assert fb.result().metrics["loss:sum"] > 0
        sampler = training.save_weights_and_get_sampling_client().result()
        params = types.SamplingParams(max_tokens=4, stop=[])
        assert (
            len(sampler.sample(types.ModelInput.from_ints([1, 2]), 2, params).result().sequences)
            == 2
        )
        service.close("success").result(timeout=30)
    finally:
        stop_system(system)
