"""``POST /api/v1/sample_text`` (the console's playground): text in and out through the same
sampler path as the SDK's ``sample``, with the same answers, ownership and input checks, and
nothing left open behind it."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
import tinker
from tinker import types
from tokenizers import Tokenizer

from tests.conftest import RunningSystem
from tinsmith import models

pytestmark = pytest.mark.e2e
BASE = "tinsmith/tiny"


class User:
    def __init__(self, system: RunningSystem) -> None:
        self.key = f"tml-text-{uuid.uuid4().hex[:8]}"
        self.service = tinker.ServiceClient(base_url=system.url, api_key=self.key)
        self.http = httpx.Client(
            base_url=system.url + "/api/v1", headers={"X-API-Key": self.key}, timeout=120
        )

    def sample_text(self, **body: Any) -> httpx.Response:
        return self.http.post("/sample_text", json=body)


@pytest.fixture(scope="module")
def user(system: RunningSystem) -> Iterator[User]:
    me = User(system)
    yield me
    me.http.close()
    me.service.close("success").result(timeout=30)


@pytest.fixture(scope="module")
def sampler_path(user: User) -> str:
    training = user.service.create_lora_training_client(BASE, rank=4).result()
    datum = types.Datum(
        model_input=types.ModelInput.from_ints(list(range(5, 30))),
        loss_fn_inputs={"target_tokens": list(range(6, 31)), "weights": [1.0] * 25},
    )
    training.forward_backward([datum], "cross_entropy").result(timeout=120)
    training.optim_step(types.AdamParams(learning_rate=1e-2)).result(timeout=120)
    return str(training.save_weights_for_sampler("text").result(timeout=120).path)


def test_text_samples_are_the_sdk_s_samples_of_the_same_tokens(
    user: User, sampler_path: str
) -> None:
    tokenizer = Tokenizer.from_str(models.hub_snapshot(BASE).files["tokenizer.json"].decode())
    prompt = "a quick brown fox"
    params = {"max_tokens": 7, "temperature": 1.0, "seed": 1234}
    answer = user.sample_text(
        prompt=prompt, model_path=sampler_path, num_samples=2, sampling_params=params
    )
    assert answer.status_code == 200, answer.text
    body = answer.json()
    tokens = tokenizer.encode(prompt, add_special_tokens=False).ids
    assert body["prompt_tokens"] == len(tokens)
    assert body["model_path"] == sampler_path and body["base_model"] == BASE

    client = user.service.create_sampling_client(model_path=sampler_path)
    expected = (
        client.result()
        .sample(types.ModelInput.from_ints(tokens), 2, types.SamplingParams(**params))
        .result(timeout=120)
    )
    assert [s["tokens"] for s in body["sequences"]] == [s.tokens for s in expected.sequences]
    for sequence in body["sequences"]:
        assert sequence["text"] == tokenizer.decode(sequence["tokens"], skip_special_tokens=False)
        assert sequence["stop_reason"] == "length"

    base = user.sample_text(prompt=prompt, base_model=BASE, sampling_params={"max_tokens": 3})
    assert base.status_code == 200, base.text
    assert base.json()["model_path"] is None


def test_each_call_s_session_is_finished_when_it_answers(user: User, sampler_path: str) -> None:
    def sessions() -> tuple[int, int]:
        """(open sessions, sessions ever made) of the tenant."""
        opened = user.http.get("/usage").json()["tenants"][0]["sessions"]
        listed = user.http.get("/sessions", params={"limit": 1000}).json()["sessions"]
        return opened, len(listed)

    opened, made = sessions()
    for _ in range(3):
        answer = user.sample_text(prompt="hi", model_path=sampler_path)
        assert answer.status_code == 200, answer.text
    assert sessions() == (opened, made + 3)
    # A call refused for what it asks makes no session at all.
    refused = user.sample_text(
        prompt="hi", model_path=sampler_path, sampling_params={"max_tokens": 10**6}
    )
    assert refused.status_code == 400
    assert "exceeds the context length" in refused.json()["detail"]
    assert user.sample_text(prompt="hi", model_path=sampler_path + "x").status_code == 404
    assert sessions() == (opened, made + 3)


@pytest.mark.parametrize(
    ("body", "says"),
    [
        ({"model_path": "PATH"}, "'prompt' must be the text"),
        ({"prompt": "", "model_path": "PATH"}, "'prompt' must be the text"),
        ({"prompt": 3, "model_path": "PATH"}, "'prompt' must be the text"),
        ({"prompt": "hi"}, "name one model"),
        ({"prompt": "hi", "model_path": "PATH", "base_model": BASE}, "name one model"),
        ({"prompt": "hi", "base_model": "no/such-model"}, "no/such-model"),
        ({"prompt": "hi", "model_path": "PATH", "num_samples": 0}, "num_samples"),
        ({"prompt": "hi", "model_path": "PATH", "sampling_params": {"top_p": 2}}, "top_p"),
        ({"prompt": "hi", "model_path": "PATH", "sampling_params": {"stop": [""]}}, "stop"),
        ({"prompt": "hi", "model_path": "PATH", "sampling_params": []}, "sampling_params"),
    ],
)
def test_a_bad_body_is_a_400_that_says_what_is_accepted(
    user: User, sampler_path: str, body: dict[str, Any], says: str
) -> None:
    if body.get("model_path") == "PATH":
        body = {**body, "model_path": sampler_path}
    answer = user.sample_text(**body)
    assert answer.status_code == 400, answer.text
    assert says in answer.json()["detail"]


def test_another_tenant_samples_a_checkpoint_only_once_it_is_published(
    system: RunningSystem, user: User, sampler_path: str
) -> None:
    stranger = User(system)
    try:
        hidden = stranger.sample_text(prompt="hi", model_path=sampler_path)
        assert hidden.status_code == 404, hidden.text
        missing = user.sample_text(prompt="hi", model_path=sampler_path + "-gone")
        assert missing.status_code == 404, missing.text

        rest = tinker.RestClient(base_url=system.url, api_key=user.key)
        rest.publish_checkpoint_from_tinker_path(sampler_path).result(timeout=60)
        shown = stranger.sample_text(prompt="hi", model_path=sampler_path)
        assert shown.status_code == 200, shown.text
    finally:
        stranger.http.close()
