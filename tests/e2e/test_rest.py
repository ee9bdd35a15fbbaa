"""The REST catalog through the official SDK's RestClient and AdminClient, call by call, and the
`tinker` command line's checkpoint commands, against the running system."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path

import httpx
import pytest
import tinker

from tests.conftest import RunningSystem
from tinsmith import models

RENDERER = {"renderer_name": "qwen3", "note": 'ünïcode, spaces & {"json": [1]}'}


class User:
    """One API key, its ServiceClient and RestClient; everything it makes is its own."""

    def __init__(self, system: RunningSystem) -> None:
        self.key = f"tml-rest-{uuid.uuid4().hex[:8]}"
        self.owner = "key-" + hashlib.sha256(self.key.encode()).hexdigest()[:16]
        self.service = tinker.ServiceClient(base_url=system.url, api_key=self.key)
        self.rest = tinker.RestClient(base_url=system.url, api_key=self.key)
        self.blobs = system.data_dir / "blobs"

    def new_run(self, **metadata: str) -> tinker.TrainingClient:
        return self.service.create_lora_training_client(
            base_model="tinsmith/tiny", rank=4, user_metadata=metadata or None
        ).result()

    def stored(self, tinker_path: str) -> Path:
        run, segment, name = tinker_path.removeprefix("tinker://").split("/")
        return self.blobs / "runs" / run / segment / name


@pytest.fixture(scope="module")
def user(system: RunningSystem) -> Iterator[User]:
    me = User(system)
    yield me
    me.service.close("success").result(timeout=30)


@pytest.fixture(scope="module")
def stranger(system: RunningSystem) -> Iterator[User]:
    other = User(system)
    yield other
    other.service.close("success").result(timeout=30)


def test_training_runs_are_listed_newest_first_with_a_cursor(user: User, stranger: User) -> None:
    runs = [user.new_run(**RENDERER, n=str(i)) for i in range(3)]
    first = user.rest.list_training_runs(limit=2).result()
    assert first.cursor.total_count == 3 and (first.cursor.offset, first.cursor.limit) == (0, 2)
    assert [r.training_run_id for r in first.training_runs] == [runs[2].model_id, runs[1].model_id]
    rest = user.rest.list_training_runs(limit=2, offset=2).result()
    assert [r.training_run_id for r in rest.training_runs] == [runs[0].model_id]

    path = runs[0].save_state("meta").result().path
    run = user.rest.get_training_run_by_tinker_path(path).result()
    assert run.user_metadata == {**RENDERER, "n": "0"}  # exactly as sent
    assert (
        run.model_owner == user.owner and run.lora_rank == 4 and run.base_model == "tinsmith/tiny"
    )
    assert run.last_checkpoint is not None and run.last_checkpoint.tinker_path == path
    assert user.rest.get_training_run(runs[1].model_id).result().user_metadata == {
        **RENDERER,
        "n": "1",
    }
    # Another API key sees none of it.
    assert stranger.rest.list_training_runs().result().cursor.total_count == 0
    with pytest.raises(tinker.NotFoundError):
        stranger.rest.get_training_run(runs[0].model_id).result()


def test_checkpoints_listed_published_given_a_ttl_and_deleted(user: User, stranger: User) -> None:
    training = user.new_run()
    first = training.save_state("first").result().path
    sampler = training.save_weights_for_sampler("for-sampling").result().path
    second = training.save_state("second", user_metadata={"step": "2"}).result().path

    listed = user.rest.list_checkpoints(training.model_id).result().checkpoints
    assert [c.tinker_path for c in listed] == [second, sampler, first]  # newest first
    assert [c.checkpoint_type for c in listed] == ["training", "sampler", "training"]
    assert listed[0].user_metadata == {"step": "2"}
    for checkpoint in listed:
        files = [p for p in user.stored(checkpoint.tinker_path).iterdir() if p.name != ".complete"]
        assert checkpoint.size_bytes == sum(p.stat().st_size for p in files)
    mine = user.rest.list_user_checkpoints(limit=2).result()
    assert [c.tinker_path for c in mine.checkpoints] == [second, sampler]
    assert mine.cursor is not None and mine.cursor.total_count >= 3

    info = user.rest.get_weights_info_by_tinker_path(first).result()
    assert (info.base_model, info.is_lora, info.lora_rank) == ("tinsmith/tiny", True, 4)
    assert (info.train_attn, info.train_mlp, info.train_unembed) == (True, True, True)

    user.rest.publish_checkpoint_from_tinker_path(first).result()
    assert _checkpoint(user, first).public
    visible = stranger.rest.list_training_runs(access_scope="accessible").result()
    assert training.model_id in {r.training_run_id for r in visible.training_runs}
    with pytest.raises(tinker.NotFoundError):  # published is readable, not deletable
        stranger.rest.delete_checkpoint_from_tinker_path(first).result()
    user.rest.unpublish_checkpoint_from_tinker_path(first).result()
    assert not _checkpoint(user, first).public

    user.rest.set_checkpoint_ttl_from_tinker_path(first, 7200).result()
    expires = _checkpoint(user, first).expires_at
    assert expires is not None
    assert abs(expires - (datetime.now(UTC) + timedelta(seconds=7200))) < timedelta(seconds=60)
    with pytest.raises(tinker.BadRequestError, match="3600"):
        user.rest.set_checkpoint_ttl_from_tinker_path(first, 60).result()
    user.rest.set_checkpoint_ttl_from_tinker_path(first, None).result()
    assert _checkpoint(user, first).expires_at is None

    user.rest.delete_checkpoint_from_tinker_path(second).result()
    user.rest.delete_checkpoint(training.model_id, "sampler_weights/for-sampling").result()
    assert [
        c.tinker_path for c in user.rest.list_checkpoints(training.model_id).result().checkpoints
    ] == [first]
    assert not user.stored(second).exists() and not user.stored(sampler).exists()
    with pytest.raises(tinker.NotFoundError):
        user.rest.delete_checkpoint_from_tinker_path(second).result()
    # The name is free again.
    assert training.save_state("second").result().path == second


def _checkpoint(user: User, tinker_path: str) -> tinker.types.Checkpoint:
    run = tinker.ParsedCheckpointTinkerPath.from_tinker_path(tinker_path).training_run_id
    found = [c for c in user.rest.list_checkpoints(run).result().checkpoints]
    return next(c for c in found if c.tinker_path == tinker_path)


def test_overwrite_follows_the_sdk_and_never_rewrites_an_artifact(user: User) -> None:
    training = user.new_run()
    path = training.save_state("same").result().path
    original = user.stored(path)
    before = (original / "adapter_model.safetensors").read_bytes()
    with pytest.raises(tinker.BadRequestError, match="overwrite"):
        training.save_state("same").result()
    assert training.save_state("same", overwrite=True).result().path == path
    listed = user.rest.list_checkpoints(training.model_id).result().checkpoints
    assert [c.tinker_path for c in listed] == [path]
    assert not original.exists()  # the replaced artifact is removed, not rewritten
    (replacement,) = original.parent.glob("same@*")
    assert (replacement / "adapter_model.safetensors").read_bytes() == before  # no step between
    assert user.service.create_training_client_from_state(path).result().model_id


def test_a_checkpoint_whose_ttl_passes_is_deleted_from_storage(user: User) -> None:
    training = user.new_run()
    path = training.save_state("brief", ttl_seconds=2).result().path
    assert _checkpoint(user, path).expires_at is not None
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and user.stored(path).exists():
        time.sleep(0.2)
    assert not user.stored(path).exists()
    paths = [
        c.tinker_path for c in user.rest.list_checkpoints(training.model_id).result().checkpoints
    ]
    assert path not in paths


def test_sessions_samplers_and_capabilities(user: User, stranger: User) -> None:
    training = user.new_run()
    sampling = user.service.create_sampling_client(base_model="tinsmith/tiny").result()
    session_id = training.model_id.split(":")[0]
    assert session_id in user.rest.list_sessions().result().sessions
    assert session_id not in stranger.rest.list_sessions().result().sessions
    session = user.rest.get_session(session_id).result()
    assert training.model_id in session.training_run_ids
    (sampler_id,) = session.sampler_ids
    assert sampling.get_base_model() == "tinsmith/tiny"
    sampler = user.rest.get_sampler(sampler_id).result()
    assert (sampler.sampler_id, sampler.base_model) == (sampler_id, "tinsmith/tiny")
    with pytest.raises(tinker.NotFoundError):
        stranger.rest.get_session(session_id).result()
    names = {m.model_name for m in user.rest.get_server_capabilities().result().supported_models}
    assert "tinsmith/tiny" in names


def test_external_weights_download_with_a_plain_get_and_signed_urls(
    user: User, system: RunningSystem
) -> None:
    training = user.new_run()
    saved = training.save_weights_external("export").result()
    assert saved.path.endswith("/external_weights/export")
    answer = user.rest.get_external_weights_urls(saved.path).result()
    assert set(answer.urls) >= {"adapter_config.json", "adapter_model.safetensors"}
    assert answer.expires > datetime.now(UTC) + timedelta(minutes=30)
    for name, url in answer.urls.items():
        with urllib.request.urlopen(url) as response:  # no API key: the URL is the credential
            assert response.read() == (user.stored(saved.path) / name).read_bytes()
    url = answer.urls["adapter_model.safetensors"]
    for bad in (url.replace("signature=", "signature=0"), url.replace("expires=", "expires=1")):
        with pytest.raises(urllib.error.HTTPError) as refused:
            urllib.request.urlopen(bad)
        assert refused.value.code == 400 and "detail" in json.loads(refused.value.read())


def test_names_that_would_escape_storage_are_refused_and_touch_nothing(
    user: User, system: RunningSystem
) -> None:
    training = user.new_run()
    before = sorted(str(p) for p in (system.data_dir / "blobs").rglob("*"))
    for name in ("../escape", "..", "a/b", "x" * 200):
        with pytest.raises(tinker.BadRequestError):
            training.save_state(name).result()
    with pytest.raises(tinker.BadRequestError):
        user.rest.get_weights_info_by_tinker_path(
            f"tinker://{training.model_id}/weights/.."
        ).result()
    with httpx.Client(base_url=system.url + "/api/v1", headers={"X-API-Key": user.key}) as http:
        for route in (
            f"/training_runs/{training.model_id}/checkpoints/weights/%2E%2E%2Fescape",
            f"/training_runs/{training.model_id}/checkpoints/weights/%2E%2E",
        ):
            refused = http.delete(route)
            assert refused.status_code == 400, refused.text
            assert "not accepted" in refused.json()["detail"]
        refused = http.get("/blobs/runs/%2E%2E/secret?expires=9999999999&signature=x")
        assert refused.status_code == 400 and refused.json()["detail"]
    assert sorted(str(p) for p in (system.data_dir / "blobs").rglob("*")) == before


def test_storage_usage_is_reported_per_user(user: User, system: RunningSystem) -> None:
    admin = tinker.AdminClient(base_url=system.url, api_key=user.key)
    usage = admin.get_current_checkpoint_storage_usage().result()
    mine = [row for row in usage.data if row.org_user_urn == user.owner]
    checkpoints = user.rest.list_user_checkpoints(limit=1000).result().checkpoints
    assert sum(row.checkpoint_count for row in mine) == len(checkpoints)
    assert sum(row.size_bytes for row in mine) == sum(c.size_bytes or 0 for c in checkpoints)


def test_the_tinker_command_line_lists_shows_and_downloads_checkpoints(
    user: User, system: RunningSystem, tmp_path: Path
) -> None:
    training = user.new_run()
    path = training.save_state("for-the-cli").result().path
    env = {
        **os.environ,
        "TINKER_BASE_URL": system.url,
        "TINKER_API_KEY": user.key,
        "TINKER_TELEMETRY": "0",
    }
    tinker_cli = [str(Path(sys.executable).parent / "tinker"), "--format", "json", "checkpoint"]

    def run(*args: str) -> str:
        done = subprocess.run(
            [*tinker_cli, *args], env=env, capture_output=True, text=True, timeout=120, check=False
        )
        assert done.returncode == 0, done.stdout + done.stderr
        return done.stdout

    listed = json.loads(run("list", "--run-id", training.model_id))
    assert [c["tinker_path"] for c in listed["checkpoints"]] == [path]
    assert json.loads(run("info", path))["checkpoint_id"] == "weights/for-the-cli"
    run("set-ttl", path, "--ttl", "7200")
    run("publish", path)
    assert _checkpoint(user, path).public and _checkpoint(user, path).expires_at is not None
    externals = _externals(user)
    run("download", path, "--output", str(tmp_path))
    (downloaded,) = tmp_path.iterdir()
    assert {"adapter_config.json", "adapter_model.safetensors"} <= {
        p.name for p in downloaded.iterdir()
    }
    # The temporary export the download made is gone again.
    assert _externals(user) == externals
    _load_with_peft(training, downloaded)
    run("delete", path, "--yes")
    assert not user.stored(path).exists()


def _externals(user: User) -> set[str]:
    checkpoints = user.rest.list_user_checkpoints(limit=1000).result().checkpoints
    return {c.tinker_path for c in checkpoints if c.checkpoint_type == "external"}


def _load_with_peft(training: tinker.TrainingClient, adapter: Path) -> None:
    """The downloaded adapter loads with peft on the client, onto the base model's directory."""
    import torch
    from peft import PeftModel, get_peft_model_state_dict
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    info = training.get_info().model_data
    assert info.tokenizer_id == info.model_name == "tinsmith/tiny"  # a name, never a server path
    base = models.materialize(info.model_name)
    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base), str(adapter))
    saved = load_file(str(adapter / "adapter_model.safetensors"))
    loaded = get_peft_model_state_dict(model, save_embedding_layers=False)
    assert saved and saved.keys() == loaded.keys()
    for name, tensor in saved.items():
        assert torch.equal(loaded[name], tensor), name
