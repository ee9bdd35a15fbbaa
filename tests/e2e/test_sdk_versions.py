"""Released tinker SDK versions against ``tinsmith up``: the protocol story (tests/sdk_story.py)
told by each version from its own virtual environment, and what the gateway does for old clients.

The story always runs with the SDK installed here (0.38.0), so ``make test`` covers the story
itself. With each version that ``TINSMITH_TEST_SDKS`` names (``make test-sdks`` names 0.24.1,
0.25.0, 0.34.0 and 0.36.0) it runs too, each from a virtual environment that tests/sdk_env.py
builds once into the tinsmith cache. Each version prints what it passed and any step it skipped
(a method that version lacks), and why.

The gateway's fixes for old clients each have a test here that needs no old SDK: it sends what
the old client sends, byte for byte where it matters, with a plain HTTP client.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest

from tests.conftest import RunningSystem
from tests.pinned_venv import user_environment
from tests.sdk_env import ensure_sdk_venv
from tinsmith import models
from tinsmith._proto import tinker_public_pb2 as tp

pytestmark = pytest.mark.e2e

INSTALLED = importlib.metadata.version("tinker")
SDKS = list(dict.fromkeys([INSTALLED, *os.environ.get("TINSMITH_TEST_SDKS", "").split()]))
STORY = Path(__file__).parents[1] / "sdk_story.py"
STORY_TIMEOUT_S = 300
# What the story must pass with every version: the steps the issue lists. It may skip only
# what a version has no method for, and says so.
REQUIRED = {
    "session",
    "create_lora_training_client",
    "forward",
    "forward_backward",
    "optim_step",
    "save_state",
    "create_training_client_from_state_with_optimizer",
    "create_training_client_from_state",
    "save_weights_for_sampler",
    "sample_with_prompt_logprobs",
    "compute_logprobs",
    "rest_catalog",
}
# The checkpoint archive (RestClient.get_checkpoint_archive_url) is a method of 0.34.0 and
# before, which the story must pass with them; 0.36.0 dropped it, and the story says it skipped it.
ARCHIVE = "checkpoint_archive"


def _release(version: str) -> tuple[int, ...]:
    return tuple(int(part) for part in version.split(".")[:3])


@pytest.mark.parametrize("version", SDKS, ids=lambda version: f"tinker-{version}")
def test_the_story(version: str, system: RunningSystem, tmp_path: Path) -> None:
    python = Path(sys.executable) if version == INSTALLED else ensure_sdk_venv(version)
    started = time.monotonic()
    result = subprocess.run(
        [str(python), str(STORY), system.url, f"tml-sdk-story-{version}", models.TINY],
        cwd=tmp_path,
        env=user_environment(tmp_path),
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=STORY_TIMEOUT_S,
    )
    lines = result.stdout.strip().splitlines()
    report: dict[str, Any] = json.loads(lines[-1]) if lines else {}
    skipped = "; ".join(f"{step} ({why})" for step, why in report.get("skipped", {}).items())
    print(
        f"\ntinker {version}: {len(report.get('passed', []))} steps passed in "
        f"{time.monotonic() - started:.1f} s; skipped: {skipped or 'none'}; "
        f"values: {report.get('values')}"
    )
    assert result.returncode == 0 and "failed" not in report, (
        f"tinker {version} failed at {report.get('failed')}: {report.get('error')}\n"
        f"{result.stderr[-6000:]}\n\nserver logs:\n{system.logs()}"
    )
    assert report["sdk"] == version
    assert set(report["passed"]) >= REQUIRED, REQUIRED - set(report["passed"])
    assert not set(report["passed"]) & set(report["skipped"])
    if _release(version) <= (0, 34, 0):
        assert ARCHIVE in report["passed"], report["skipped"].get(ARCHIVE)
    elif _release(version) >= (0, 36, 0):
        assert ARCHIVE in report["skipped"], report["passed"]
    if version == INSTALLED:
        assert set(report["skipped"]) == {ARCHIVE}, "the installed SDK has every other method"


# -- what the gateway does for old clients ---------------------------------------------------


OLD_RESULT_ACCEPT = "application/x-protobuf, application/json"


def _settled(http: httpx.Client, request_id: str, accept: str) -> httpx.Response:
    """retrieve_future until the request settles, with the Accept header the old client sends."""
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        reply = http.post(
            "/retrieve_future",
            json={"request_id": request_id, "allow_metadata_only": True},
            headers={"Accept": accept},
        )
        if reply.status_code != 408:
            assert reply.status_code == 200, reply.text
            return reply
    raise TimeoutError(f"{request_id} did not settle")


def _forward_pass(
    http: httpx.Client, model_id: str, seq_id: int, tokens: list[int], forward_only: bool
) -> np.ndarray:
    """One forward_backward request in the protobuf form, and the logprobs it answers."""
    datum = tp.Datum()
    datum.model_input.add().encoded_text.tokens = np.asarray(tokens[:-1], "<i4").tobytes()
    targets = datum.loss_fn_inputs["target_tokens"]
    targets.dense, targets.dtype = np.asarray(tokens[1:], "<i8").tobytes(), tp.DTYPE_INT64
    targets.shape.append(len(tokens) - 1)
    request = tp.ForwardBackwardRequest(
        model_id=model_id,
        seq_id=seq_id,
        data=[datum],
        loss_fn="cross_entropy",
        forward_only=forward_only,
    )
    accepted = http.post(
        "/forward_backward",
        content=request.SerializeToString(),
        headers={"Content-Type": "application/x-protobuf"},
    )
    assert accepted.status_code == 200, accepted.text
    # What SDKs before 0.25 accept for a forward_backward result: protobuf, or JSON.
    reply = _settled(
        http, accepted.json()["request_id"], "application/x-protobuf, application/json"
    )
    assert reply.headers["Content-Type"].startswith("application/x-protobuf"), reply.text
    output = tp.ForwardBackwardOutput.FromString(reply.content)
    return np.frombuffer(output.loss_fn_outputs[0].fields["logprobs"].data, "<f4")


def test_an_sdk_before_0_25_is_asked_for_protobuf_forward_passes(system: RunningSystem) -> None:
    # tinker 0.24.1 and earlier send forward_backward as JSON, and forward as JSON to
    # /api/v1/forward, which this gateway does not read, unless the client config sets
    # proto_write_fwdbwd (forward_backward as protobuf) and fwd_via_fwdbwd (forward as a
    # forward_only forward_backward): with both, they send what 0.25 and later always send.
    headers = {"X-API-Key": "tml-sdk-0.24.1", "User-Agent": "AsyncTinker/Python 0.24.1"}
    with httpx.Client(base_url=f"{system.url}/api/v1", headers=headers, timeout=60) as http:
        config = http.post("/client/config", json={"sdk_version": "0.24.1"}).json()
        assert config["proto_write_fwdbwd"] is True
        assert config["fwd_via_fwdbwd"] is True

        session = http.post(
            "/create_session",
            json={
                "tags": [],
                "user_metadata": {},
                "sdk_version": "0.24.1",
                "type": "create_session",
            },
        ).json()["session_id"]
        created = http.post(
            "/create_model",
            json={
                "session_id": session,
                "model_seq_id": 0,
                "base_model": models.TINY,
                "lora_config": {"rank": 4, "train_unembed": True, "train_mlp": True},
                "type": "create_model",
            },
        ).json()
        model_id = _settled(http, created["request_id"], "application/json").json()["model_id"]

        # A forward (forward_only) leaves no gradient behind: a step after it changes nothing,
        # where a step after a forward_backward does.
        tokens = [5, 17, 99, 3, 250, 42, 7]
        before = _forward_pass(http, model_id, 1, tokens, forward_only=True)
        assert before.shape == (len(tokens) - 1,) and np.all(before < 0)
        _optim_step(http, model_id, 2)
        np.testing.assert_array_equal(_forward_pass(http, model_id, 3, tokens, True), before)
        _forward_pass(http, model_id, 4, tokens, forward_only=False)
        _optim_step(http, model_id, 5)
        after = _forward_pass(http, model_id, 6, tokens, forward_only=True)
        assert np.max(np.abs(after - before)) > 1e-3

        # Had it sent JSON anyway (what 0.24.1 sends when the config does not ask for protobuf),
        # the answer says which form is accepted.
        datum = {
            "loss_fn_inputs": {
                "target_tokens": {"data": tokens[1:], "dtype": "int64", "shape": [6]},
                "weights": {"data": [1.0] * 6, "dtype": "float32", "shape": [6]},
            },
            "model_input": {"chunks": [{"tokens": tokens[:-1], "type": "encoded_text"}]},
        }
        refused = http.post(
            "/forward_backward",
            json={
                "forward_backward_input": {"data": [datum], "loss_fn": "cross_entropy"},
                "model_id": model_id,
                "seq_id": 7,
            },
        )
        assert refused.status_code == 400
        assert "protobuf" in refused.json()["detail"]
        assert "client config" in refused.json()["detail"]


def _optim_step(http: httpx.Client, model_id: str, seq_id: int) -> None:
    adam = {"learning_rate": 0.01, "beta1": 0.9, "beta2": 0.95, "eps": 1e-12}
    step = http.post(
        "/optim_step",
        json={"model_id": model_id, "seq_id": seq_id, "adam_params": adam, "type": "optim_step"},
    )
    assert step.status_code == 200, step.text
    _settled(http, step.json()["request_id"], "application/json")
