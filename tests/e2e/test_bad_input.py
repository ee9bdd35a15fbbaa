"""Bad input gets 400 or 404 with a detail that says what was wrong, and the system keeps
serving (a rejected training request does not stall the run's later requests)."""

from __future__ import annotations

import re
import shutil
import uuid
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import tinker
from tinker import types

from tests.conftest import RunningSystem
from tinsmith import models

HEADERS = {"X-API-Key": "tml-e2e"}


@pytest.fixture(scope="module")
def http(system: RunningSystem) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=system.url + "/api/v1", headers=HEADERS, timeout=60) as client:
        yield client


@pytest.fixture(scope="module")
def training(system: RunningSystem) -> Iterator[tinker.TrainingClient]:
    service = tinker.ServiceClient(base_url=system.url, api_key="tml-e2e")
    client = service.create_lora_training_client(base_model="tinsmith/tiny", rank=4)
    yield client.result() if hasattr(client, "result") else client
    service.close("success").result(timeout=30)


def _datum(tokens: list[int]) -> types.Datum:
    return types.Datum(
        model_input=types.ModelInput.from_ints(tokens[:-1]),
        loss_fn_inputs={"target_tokens": tokens[1:], "weights": [1.0] * (len(tokens) - 1)},
    )


def _still_trains(training: tinker.TrainingClient) -> None:
    out = training.forward_backward([_datum([1, 2, 3, 4])], "cross_entropy").result(timeout=60)
    assert out.metrics["loss:sum"] > 0


def test_unknown_base_model(http: httpx.Client) -> None:
    session = http.post("/create_session", json={"tags": [], "user_metadata": {}}).json()
    reply = http.post(
        "/create_model",
        json={
            "session_id": session["session_id"],
            "model_seq_id": 0,
            "base_model": "nobody/no-such-model",
            "lora_config": {"rank": 8},
        },
    )
    assert reply.status_code == 400
    assert "nobody/no-such-model" in reply.json()["detail"]
    assert "tinsmith/tiny" in reply.json()["detail"]


def test_malformed_protobuf_body(http: httpx.Client, training: tinker.TrainingClient) -> None:
    reply = http.post(
        "/forward_backward",
        content=b"\xff\xff\xff not a protobuf",
        headers={"Content-Type": "application/x-protobuf"},
    )
    assert reply.status_code == 400
    assert "ForwardBackwardRequest" in reply.json()["detail"]
    _still_trains(training)


def test_token_ids_outside_the_vocabulary(training: tinker.TrainingClient) -> None:
    with pytest.raises(tinker.BadRequestError, match=r"outside the vocabulary.*\[0, 512\)"):
        training.forward_backward([_datum([1, 2, 99999, 4])], "cross_entropy").result(timeout=60)
    _still_trains(training)


def test_sampling_token_ids_outside_the_vocabulary(training: tinker.TrainingClient) -> None:
    sampler = training.save_weights_and_get_sampling_client().result()
    with pytest.raises(tinker.BadRequestError, match="outside the vocabulary"):
        sampler.sample(
            types.ModelInput.from_ints([1, -5]), 1, types.SamplingParams(max_tokens=2)
        ).result(timeout=60)


@pytest.mark.parametrize(
    ("extra", "detail"),
    [
        ({"topk_sample_logprobs": 21}, "'topk_sample_logprobs' must be <= 20"),
        ({"topk_prompt_logprobs": -1}, "'topk_prompt_logprobs' must be >= 0"),
        ({"prompt_alt_tokens_k": 50}, "'prompt_alt_tokens_k' must be <= 20"),
        (
            {"target_prompt_logprobs": {"data": [1, 2], "dtype": "int64", "shape": [1, 2]}},
            r"shape \[len\(prompt\) - 1, K\] = \[3, K >= 1\], got \[1, 2\]",
        ),
        (
            {"target_prompt_logprobs": {"data": [-1] * 3, "dtype": "int64", "shape": [3, 1]}},
            "names no token id",
        ),
        (
            {
                "target_prompt_logprobs": {
                    "data": list(range(30)),
                    "dtype": "int64",
                    "shape": [3, 10],
                }
            },
            "30 distinct token ids; at most 20",
        ),
        (
            {"target_prompt_logprobs": {"data": [1, 2, 600], "dtype": "int64", "shape": [3, 1]}},
            r"token id 600, outside the vocabulary",
        ),
        (
            {
                "target_prompt_logprobs": {
                    "data": [1.0, 2.0, 3.0],
                    "dtype": "float32",
                    "shape": [3, 1],
                }
            },
            "must be an int64 tensor",
        ),
    ],
)
def test_bad_sampling_options(
    http: httpx.Client, training: tinker.TrainingClient, extra: dict[str, object], detail: str
) -> None:
    sampler = training.save_weights_and_get_sampling_client().result()
    body = {
        "sampling_session_id": sampler._sampling_session_id,  # type: ignore[attr-defined]
        "seq_id": 10**6,
        "num_samples": 1,
        "prompt": {"chunks": [{"type": "encoded_text", "tokens": [1, 2, 3, 4]}]},
        "sampling_params": {"max_tokens": 2},
        **extra,
    }
    reply = http.post("/asample", json=body)
    assert reply.status_code == 400
    assert re.search(detail, reply.json()["detail"]), reply.json()["detail"]


def test_unimplemented_loss_function(training: tinker.TrainingClient) -> None:
    with pytest.raises(tinker.BadRequestError, match=r"unknown loss_fn.*cross_entropy, importance"):
        training.forward_backward([_datum([1, 2, 3])], "no_such_loss").result(timeout=60)
    _still_trains(training)


def test_unknown_model_id(http: httpx.Client) -> None:
    reply = http.post("/get_info", json={"model_id": "nope:train:0", "type": "get_info"})
    assert reply.status_code == 404
    assert "nope:train:0" in reply.json()["detail"]
    reply = http.post(
        "/optim_step", json={"model_id": "nope:train:0", "seq_id": 1, "adam_params": {}}
    )
    assert reply.status_code == 404


def test_unknown_sampler_id(http: httpx.Client) -> None:
    reply = http.get("/samplers/nope:sample:0")
    assert reply.status_code == 404
    assert "nope:sample:0" in reply.json()["detail"]
    reply = http.post(
        "/asample",
        json={
            "sampling_session_id": "nope:sample:0",
            "seq_id": 0,
            "num_samples": 1,
            "prompt": {"chunks": [{"type": "encoded_text", "tokens": [1, 2]}]},
            "sampling_params": {"max_tokens": 2},
        },
    )
    assert reply.status_code == 404


def test_unknown_future_and_session(http: httpx.Client) -> None:
    reply = http.post("/retrieve_future", json={"request_id": "nope:1"})
    assert reply.status_code == 404
    reply = http.post("/session_heartbeat", json={"session_id": "nope"})
    assert reply.status_code == 404


def test_a_repeated_seq_id_returns_the_first_future(
    http: httpx.Client, training: tinker.TrainingClient
) -> None:
    info = http.post("/get_info", json={"model_id": training.model_id}).json()
    assert info["model_data"]["model_name"] == "tinsmith/tiny"
    _still_trains(training)  # the SDK has now used a seq_id we can repeat
    body = {"model_id": training.model_id, "seq_id": 1, "adam_params": {"learning_rate": 1.0}}
    first = http.post("/optim_step", json=body).json()
    assert first["request_id"] == f"{training.model_id}:1"
    assert http.post("/optim_step", json=body).json() == first


def test_the_system_keeps_serving(http: httpx.Client, training: tinker.TrainingClient) -> None:
    assert http.get("/healthz").json() == {"status": "ok"}
    _still_trains(training)


def test_a_base_model_of_an_unsupported_architecture(http: httpx.Client) -> None:
    """A served directory (under TINSMITH_MODEL_DIRS: tinsmith up's default is the models cache)
    whose architecture the engines cannot train is refused by name."""
    gpt2 = '{"model_type": "gpt2", "vocab_size": 100, "n_embd": 64, "n_layer": 2, "n_head": 4}'
    served = models.default_cache_dir() / "models" / f"test-gpt2-{uuid.uuid4().hex[:8]}"
    served.mkdir(parents=True)
    (served / "config.json").write_text(gpt2)
    try:
        _refused_by_architecture(http, served)
    finally:
        shutil.rmtree(served)


def _refused_by_architecture(http: httpx.Client, tmp_path: Path) -> None:
    session = http.post("/create_session", json={"tags": [], "user_metadata": {}}).json()
    reply = http.post(
        "/create_model",
        json={
            "session_id": session["session_id"],
            "model_seq_id": 0,
            "base_model": str(tmp_path),
            "lora_config": {"rank": 8},
        },
    )
    assert reply.status_code == 400
    assert "not supported for architecture 'gpt2'" in reply.json()["detail"]
