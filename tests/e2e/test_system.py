"""What the system is made of: events in the JetStream log, weights in the object store, and the
bootstrap endpoints the SDK calls around the main flow."""

from __future__ import annotations

import asyncio
import re

import httpx
import pytest
import tinker
from tinker import types

from tests.conftest import RunningSystem
from tinsmith import events, subjects
from tinsmith.bus import Bus


def _nats_url(system: RunningSystem) -> str:
    config = (system.data_dir / "nats-server.conf").read_text()
    match = re.search(r"listen: (\S+)", config)
    assert match
    return f"nats://{match.group(1)}"


async def _event_kinds(url: str) -> list[str]:
    bus = await Bus.connect(url, name="test-reader")
    try:
        last = await bus.last_seq(subjects.EVENTS_STREAM)
        return [
            events.kind_of(events.decode(await bus.get(subjects.EVENTS_STREAM, seq)))
            for seq in range(1, last + 1)
        ]
    finally:
        await bus.close()


def test_every_state_change_is_an_event_and_weights_go_through_the_object_store(
    system: RunningSystem,
) -> None:
    service = tinker.ServiceClient(base_url=system.url, api_key="tml-e2e")
    training = service.create_lora_training_client(base_model="tinsmith/tiny", rank=4).result()
    datum = types.Datum(
        model_input=types.ModelInput.from_ints([1, 2, 3]),
        loss_fn_inputs={"target_tokens": [2, 3, 4], "weights": [1.0, 1.0, 1.0]},
    )
    training.forward_backward([datum], "cross_entropy").result()
    training.optim_step(types.AdamParams(learning_rate=1e-3)).result()
    path = training.save_state("system-check").result().path
    sampler = training.save_weights_and_get_sampling_client().result()
    sampler.sample(
        types.ModelInput.from_ints([1, 2]), 1, types.SamplingParams(max_tokens=2)
    ).result()
    service.close("success").result(timeout=30)

    kinds = set(asyncio.run(_event_kinds(_nats_url(system))))
    assert {
        "session_created",
        "session_finished",
        "request_accepted",
        "request_completed",
        "run_created",
        "weights_saved",
        "sampler_created",
    } <= kinds

    run_dir = system.data_dir / "blobs" / "runs" / training.model_id
    saved = run_dir / "weights" / path.rsplit("/", 1)[-1]
    assert {p.name for p in saved.iterdir()} >= {
        "adapter_config.json",
        "adapter_model.safetensors",
        "optimizer.safetensors",
    }
    assert any((run_dir / "ephemeral").iterdir())


def test_capabilities_advertise_the_built_in_models(system: RunningSystem) -> None:
    rest = tinker.RestClient(base_url=system.url, api_key="tml-e2e")
    names = {m.model_name for m in rest.get_server_capabilities().result().supported_models}
    assert {"tinsmith/tiny", "HuggingFaceTB/SmolLM2-135M-Instruct"} <= names


def test_heartbeat_and_telemetry_are_answered(system: RunningSystem) -> None:
    with httpx.Client(base_url=system.url + "/api/v1", headers={"X-API-Key": "tml-e2e"}) as http:
        session = http.post("/create_session", json={"tags": [], "user_metadata": {}}).json()
        beat = http.post("/session_heartbeat", json={"session_id": session["session_id"]})
        assert beat.status_code == 200 and beat.json() == {"type": "session_heartbeat"}
        telemetry = http.post("/telemetry", json={"events": [], "session_id": "x"})
        assert telemetry.json() == {"status": "accepted"}
        config = http.post("/client/config", json={"sdk_version": "0.38.0"}).json()
        assert config["fwdbwd_max_chunk_bytes_count"] < 8 * 1024 * 1024


def test_a_training_run_as_the_rest_api_shows_it(system: RunningSystem) -> None:
    service = tinker.ServiceClient(base_url=system.url, api_key="tml-e2e")
    training = service.create_lora_training_client(
        "tinsmith/tiny", rank=4, user_metadata={"renderer_name": "role_colon"}
    ).result()
    path = training.save_state("rest-check", ttl_seconds=7200).result().path
    rest = tinker.RestClient(base_url=system.url, api_key="tml-e2e")
    run = rest.get_training_run(training.model_id).result()
    assert (run.training_run_id, run.base_model, run.lora_rank) == (
        training.model_id,
        "tinsmith/tiny",
        4,
    )
    assert run.user_metadata == {"renderer_name": "role_colon"}
    assert run.last_checkpoint is not None
    assert run.last_checkpoint.tinker_path == path
    assert run.last_checkpoint.checkpoint_id == "weights/rest-check"
    assert run.last_checkpoint.expires_at is not None
    assert run.last_sampler_checkpoint is None
    with pytest.raises(tinker.NotFoundError):
        rest.get_training_run("nope:train:0").result()
    service.close("success").result(timeout=30)
