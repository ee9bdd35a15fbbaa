"""How runs are going, through the running system: every step's metrics kept in the catalog as
the SDK saw them, a client's own metrics beside them, the console's run list, a sweep's runs
side by side, a run's request timeline, and ``export_session_trace`` through the official SDK,
each the caller's alone."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import urllib.error
import urllib.request
import uuid
from collections.abc import Iterator
from typing import Any
from urllib.parse import parse_qs, urlparse

import httpx
import pytest
import tinker
from tinker import types

from tests.conftest import RunningSystem


class User:
    def __init__(self, system: RunningSystem) -> None:
        self.key = f"tml-progress-{uuid.uuid4().hex[:8]}"
        self.service = tinker.ServiceClient(base_url=system.url, api_key=self.key)
        self.rest = tinker.RestClient(base_url=system.url, api_key=self.key)
        self.http = httpx.Client(
            base_url=system.url + "/api/v1", headers={"X-API-Key": self.key}, timeout=60
        )

    def get(self, path: str, **params: Any) -> Any:
        response = self.http.get(path, params=params)
        assert response.status_code == 200, response.text
        return response.json()

    def close(self) -> None:
        self.http.close()
        self.service.close("success").result(timeout=30)


@pytest.fixture(scope="module")
def user(system: RunningSystem) -> Iterator[User]:
    me = User(system)
    yield me
    me.close()


@pytest.fixture(scope="module")
def stranger(system: RunningSystem) -> Iterator[User]:
    other = User(system)
    yield other
    other.close()


def _datum(tokens: list[int]) -> types.Datum:
    return types.Datum(
        model_input=types.ModelInput.from_ints(tokens[:-1]),
        loss_fn_inputs={"target_tokens": tokens[1:], "weights": [1.0] * (len(tokens) - 1)},
    )


BATCH = [_datum([1, 2, 3, 4, 5, 6]), _datum([7, 8, 9, 10])]
TOKENS = 5 + 3  # the model inputs' tokens


def _train(
    training: tinker.TrainingClient, steps: int, learning_rate: float
) -> list[tuple[float, float]]:
    """``steps`` steps; each one's ``loss:sum`` and grad norm as the SDK returned them."""
    seen = []
    for _ in range(steps):
        fb = training.forward_backward(BATCH, "cross_entropy").result(timeout=120)
        optim = training.optim_step(types.AdamParams(learning_rate=learning_rate)).result(
            timeout=120
        )
        seen.append((fb.metrics["loss:sum"], optim.metrics["grad_norm:mean"]))
    return seen


def _curve(metrics: dict[str, Any], name: str) -> list[tuple[int, float]]:
    return [(step, value) for step, value in metrics["metrics"][name]]


def test_every_step_s_metrics_are_kept_as_the_sdk_saw_them(user: User, stranger: User) -> None:
    training = user.service.create_lora_training_client(base_model="tinsmith/tiny", rank=4).result()
    seen = _train(training, 3, 1e-2)
    run = training.model_id
    kept = user.get(f"/training_runs/{run}/metrics")
    assert kept["steps"] == 3
    losses = _curve(kept, "loss:sum")
    assert [step for step, _ in losses] == [0, 1, 2]
    assert [value for _, value in losses] == pytest.approx([loss for loss, _ in seen], rel=1e-6)
    assert [v for _, v in _curve(kept, "grad_norm:mean")] == pytest.approx(
        [norm for _, norm in seen], rel=1e-6
    )
    assert [v for _, v in _curve(kept, "learning_rate:mean")] == pytest.approx([1e-2] * 3)
    assert [v for _, v in _curve(kept, "tokens:sum")] == [TOKENS] * 3
    assert [v for _, v in _curve(kept, "datums:sum")] == [2] * 3

    # An evaluation (forward alone) is kept apart from the training loss.
    evaluated = training.forward(BATCH, "cross_entropy").result(timeout=120)
    kept = user.get(f"/training_runs/{run}/metrics")
    assert _curve(kept, "forward/loss:sum") == [(3, pytest.approx(evaluated.metrics["loss:sum"]))]
    assert len(_curve(kept, "loss:sum")) == 3

    # Sampling its weights counts its tokens at the step it sampled.
    sampler = training.save_weights_and_get_sampling_client().result()
    params = types.SamplingParams(max_tokens=4, temperature=1.0, seed=1)
    sampler.sample(types.ModelInput.from_ints([1, 2, 3]), 2, params).result(timeout=120)
    kept = user.get(f"/training_runs/{run}/metrics")
    assert _curve(kept, "sample/prompt_tokens:sum") == [(3, 3)]
    assert _curve(kept, "sample/sequences:sum") == [(3, 2)]
    assert _curve(kept, "sample/sampled_tokens:sum") == [(3, 8)]

    # Another tenant sees none of it, and cannot add to it.
    assert stranger.http.get(f"/training_runs/{run}/metrics").status_code == 404
    added = stranger.http.post(f"/training_runs/{run}/metrics", json={"metrics": {"x": 1}})
    assert added.status_code == 404


def test_a_client_adds_its_own_metrics_at_a_step(user: User) -> None:
    training = user.service.create_lora_training_client(base_model="tinsmith/tiny", rank=4).result()
    _train(training, 2, 1e-3)
    run = training.model_id
    now = user.http.post(f"/training_runs/{run}/metrics", json={"metrics": {"reward": 0.25}})
    assert now.status_code == 200, now.text
    assert now.json()["step"] == 2  # the run's current step
    at = user.http.post(
        f"/training_runs/{run}/metrics",
        json={"metrics": {"eval/score": 3, "reward": 0.5}, "step": 0},
    )
    assert at.status_code == 200, at.text
    again = user.http.post(f"/training_runs/{run}/metrics", json={"metrics": {"reward": 0.75}})
    assert again.status_code == 200, again.text
    kept = user.get(f"/training_runs/{run}/metrics")
    assert _curve(kept, "reward") == [(0, 0.5), (2, 0.75)]  # reported again: the latest
    assert _curve(kept, "eval/score") == [(0, 3.0)]

    for body, detail in [
        ({"metrics": {"reward": "high"}}, "finite numbers"),
        ({"metrics": {}}, "at least one metric"),
        ({"reward": 1}, "'metrics'"),
        ({"metrics": {"reward": 1}, "step": -1}, "step must be"),
        ({"metrics": {"x" * 300: 1}}, "printable characters"),
    ]:
        refused = user.http.post(f"/training_runs/{run}/metrics", json=body)
        assert refused.status_code == 400, refused.text
        assert detail in refused.json()["detail"]
    refused = user.http.post(
        f"/training_runs/{run}/metrics",
        content=b'{"metrics": {"reward": NaN}}',
        headers={"Content-Type": "application/json"},
    )
    assert refused.status_code == 400 and "finite" in refused.json()["detail"]


def test_the_console_lists_runs_and_compares_a_sweep(user: User, stranger: User) -> None:
    sweep = f"sweep-{uuid.uuid4().hex[:6]}"
    runs = {}
    for lr in (1e-2, 1e-4):
        training = user.service.create_lora_training_client(
            base_model="tinsmith/tiny", rank=4, user_metadata={"sweep": sweep, "variant": "a"}
        ).result()
        runs[lr] = (training.model_id, _train(training, 2, lr))
    listed = user.get("/console/runs", sweep=sweep)
    assert [r["training_run_id"] for r in listed["runs"]] == [runs[1e-4][0], runs[1e-2][0]]
    newest = listed["runs"][0]
    assert newest["steps"] == 2 and newest["status"] in ("idle", "training")
    assert newest["last_loss"] == pytest.approx(runs[1e-4][1][-1][0], rel=1e-6)
    assert newest["sparkline"] == pytest.approx([loss for loss, _ in runs[1e-4][1]], rel=1e-6)
    assert newest["learning_rate"] == pytest.approx(1e-4)
    assert stranger.get("/console/runs", sweep=sweep)["runs"] == []

    compared = user.get(f"/sweeps/{sweep}")
    assert compared["metric"] == "loss:sum" and compared["goal"] == "min"
    assert [r["training_run_id"] for r in compared["runs"]] == [runs[1e-2][0], runs[1e-4][0]]
    assert compared["differs"] == ["learning_rate"]  # the same variant, rank and loss
    losses = {model_id: min(loss for loss, _ in seen) for model_id, seen in runs.values()}
    best = min(losses, key=lambda model_id: losses[model_id])
    assert compared["best"]["training_run_id"] == best
    assert compared["best"]["value"] == pytest.approx(losses[best], rel=1e-6)
    assert stranger.get(f"/sweeps/{sweep}")["runs"] == []

    timeline = user.get(f"/training_runs/{runs[1e-2][0]}/requests")
    ops = [r["op"] for r in reversed(timeline["requests"])]
    assert ops == ["create_model", "forward_backward", "optim_step"] * 1 + [
        "forward_backward",
        "optim_step",
    ]
    for request in timeline["requests"]:
        assert request["status"] == "completed"
        assert request["queue_s"] >= 0 and request["compute_s"] > 0 and request["store_s"] >= 0


def test_export_session_trace_gives_a_perfetto_trace_of_the_session(
    user: User, stranger: User
) -> None:
    training = user.service.create_lora_training_client(base_model="tinsmith/tiny", rank=4).result()
    _train(training, 1, 1e-3)
    session_id = training.model_id.split(":")[0]
    url = user.rest.export_session_trace(session_id).result(timeout=60)
    with urllib.request.urlopen(url, timeout=30) as response:
        trace = json.loads(response.read())
    slices = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    requests = [e for e in slices if e["cat"] == "request"]
    mine = [e for e in requests if e["args"]["request_id"].startswith(training.model_id)]
    assert [e["name"] for e in mine][-3:] == ["create_model", "forward_backward", "optim_step"]
    fb = next(e for e in mine if e["name"] == "forward_backward")
    phases = {
        e["name"]: e
        for e in slices
        if e["cat"] != "request"
        and e["tid"] == fb["tid"]
        and e["pid"] == fb["pid"]
        and fb["ts"] <= e["ts"] <= fb["ts"] + fb["dur"]
    }
    assert {"queue", "compute", "store"} <= set(phases)
    assert phases["compute"]["dur"] > 0
    names = {e["args"]["name"] for e in trace["traceEvents"] if e["name"] == "process_name"}
    assert f"run {training.model_id}" in names

    with pytest.raises(Exception, match=r"404|session"):
        stranger.rest.export_session_trace(session_id).result(timeout=60)
    # The URL is the tenant's: another tenant's signature does not open it.
    forged = url.replace(user_tenant(url), "key-0000000000000000")
    with pytest.raises(urllib.error.HTTPError):
        urllib.request.urlopen(forged, timeout=30)


def user_tenant(url: str) -> str:
    return parse_qs(urlparse(url).query)["tenant"][0]


def _tinsmith(system: RunningSystem, key: str, *args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "TINKER_BASE_URL": system.url, "TINKER_API_KEY": key}
    return subprocess.run(
        [sys.executable, "-m", "tinsmith.cli", *args],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
    )


def test_tinsmith_runs_and_run_print_the_same_in_a_terminal(
    system: RunningSystem, user: User, stranger: User
) -> None:
    sweep = f"cli-{uuid.uuid4().hex[:6]}"
    training = user.service.create_lora_training_client(
        base_model="tinsmith/tiny", rank=4, user_metadata={"sweep": sweep}
    ).result()
    seen = _train(training, 2, 1e-2)
    listed = _tinsmith(system, user.key, "runs", "--sweep", sweep)
    assert listed.returncode == 0, listed.stderr
    header, row, total = listed.stdout.strip().splitlines()
    assert header.split()[:5] == ["RUN", "BASE", "MODEL", "RANK", "STEPS"]
    cells = row.split()
    assert cells[:4] == [training.model_id, "tinsmith/tiny", "4", "2"]
    assert float(cells[4]) == pytest.approx(seen[-1][0], rel=1e-3)
    assert total == "1 runs"

    shown = _tinsmith(system, user.key, "run", training.model_id)
    assert shown.returncode == 0, shown.stderr
    lines = shown.stdout.splitlines()
    assert lines[0] == f"run {training.model_id}" and "steps 2" in lines[2]
    (loss,) = [line.split() for line in lines if line.startswith("loss:sum ")]
    assert loss[1] == "1" and float(loss[2]) == pytest.approx(seen[-1][0], rel=1e-3)
    requests = [line.split()[1] for line in lines if line[:2].isdigit()]
    assert requests == ["optim_step", "forward_backward"] * 2 + ["create_model"]

    refused = _tinsmith(system, stranger.key, "run", training.model_id)
    assert refused.returncode == 1 and "404" in refused.stderr
    assert _tinsmith(system, stranger.key, "runs", "--sweep", sweep).stdout.strip() == "no runs"
