"""Stop `tinsmith up` and start it again on the same data directory: the catalog, training state
and futures all survive; and a catalog database deleted while it was stopped is rebuilt from the
log, answering exactly as before."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import pytest
import tinker
from safetensors.numpy import load_file
from tinker import types

from tests.conftest import RunningSystem, start_system, stop_system

KEY = "tml-restart"


def _batch(seed: int) -> list[types.Datum]:
    rng = np.random.default_rng(seed)
    ids = rng.integers(3, 512, size=10).tolist()
    return [
        types.Datum(
            model_input=types.ModelInput.from_ints(ids[:-1]),
            loss_fn_inputs={"target_tokens": ids[1:], "weights": [1.0] * 9},
        )
    ]


def _step(training: tinker.TrainingClient, seed: int) -> None:
    training.forward_backward(_batch(seed), "cross_entropy").result()
    training.optim_step(types.AdamParams(learning_rate=1e-2)).result()


def _adapter(data_dir: Path, tinker_path: str) -> dict[str, np.ndarray]:
    run, segment, name = tinker_path.removeprefix("tinker://").split("/")
    return load_file(
        str(data_dir / "blobs" / "runs" / run / segment / name / "adapter_model.safetensors")
    )


def _catalog(url: str) -> dict[str, object]:
    """What the REST API shows this user, in full."""
    rest = tinker.RestClient(base_url=url, api_key=KEY)
    runs = rest.list_training_runs(limit=100).result()
    return {
        "runs": [r.model_dump() for r in runs.training_runs],
        "checkpoints": [c.model_dump() for c in rest.list_user_checkpoints().result().checkpoints],
        "sessions": {
            s: rest.get_session(s).result().model_dump()
            for s in rest.list_sessions().result().sessions
        },
    }


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("tinsmith-restart")


@pytest.fixture(scope="module")
def first(data_dir: Path) -> Iterator[RunningSystem]:
    running = start_system(data_dir)
    yield running
    if running.process.poll() is None:
        stop_system(running)


def test_everything_survives_a_restart(data_dir: Path, first: RunningSystem) -> None:
    service = tinker.ServiceClient(base_url=first.url, api_key=KEY, user_metadata={"k": "v"})
    training = service.create_lora_training_client(
        "tinsmith/tiny", rank=4, seed=3, user_metadata={"renderer_name": "role_colon"}
    ).result()
    _step(training, 0)
    two = training.save_state("two").result().path
    training.save_weights_for_sampler("for-sampling").result()
    _step(training, 1)
    expected = _adapter(data_dir, training.save_state("three").result().path)

    # A future made just before the stop, never waited on by its client.
    with httpx.Client(base_url=first.url + "/api/v1", headers={"X-API-Key": KEY}) as http:
        session_id = http.post("/create_session", json={"tags": []}).json()["session_id"]
        made = http.post(
            "/create_model",
            json={
                "session_id": session_id,
                "model_seq_id": 0,
                "base_model": "tinsmith/tiny",
                "lora_config": {"rank": 2},
            },
        ).json()
        pending = http.post(
            "/optim_step",
            json={
                "model_id": made["model_id"],
                "seq_id": 1,
                "adam_params": {"learning_rate": 1e-3},
            },
        ).json()["request_id"]
    before = _catalog(first.url)
    service.close("success").result(timeout=30)
    assert stop_system(first) == 0

    second = start_system(data_dir)
    try:
        assert _catalog(second.url) == before
        with httpx.Client(base_url=second.url + "/api/v1", headers={"X-API-Key": KEY}) as http:
            answer = http.post("/retrieve_future", json={"request_id": pending}, timeout=60)
            while answer.status_code == 408:
                answer = http.post("/retrieve_future", json={"request_id": pending}, timeout=60)
            assert answer.status_code == 200 and answer.json()["type"] == "optim_step", answer.text
        again = tinker.ServiceClient(base_url=second.url, api_key=KEY)
        resumed = again.create_training_client_from_state_with_optimizer(two).result()
        _step(resumed, 1)
        got = _adapter(data_dir, resumed.save_state("three-again").result().path)
        assert max(float(np.max(np.abs(got[k] - expected[k]))) for k in expected) <= 1e-6
        again.close("success").result(timeout=30)
        after = _catalog(second.url)
    finally:
        assert stop_system(second) == 0

    (data_dir / "catalog.db").unlink()  # dropped while stopped: the log rebuilds it
    third = start_system(data_dir)
    try:
        assert _catalog(third.url) == after
    finally:
        stop_system(third)
