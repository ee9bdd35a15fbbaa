"""The whole system on an S3-compatible object store (moto's server, on loopback) and, where a
PostgreSQL server answers, a PostgreSQL catalog: checkpoints are written to and read from S3,
downloaded through presigned URLs with a plain GET, and deleted from the bucket."""

from __future__ import annotations

import asyncio
import io
import subprocess
import sys
import tarfile
import urllib.request
import uuid
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import tinker
from tinker import types

from tests.checkpoint.conftest import admin, postgres_server
from tests.conftest import RunningSystem, _wait_port, start_system, stop_system
from tinsmith.embedded import free_port

BUCKET = "tinsmith-test"
__all__ = ["postgres_server"]  # the fixture, shared with tests/checkpoint


@pytest.fixture(scope="module")
def s3(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, str]]:
    """moto in server mode on a free loopback port, with one bucket; the AWS variables that point
    boto (and so s3fs) at it."""
    port = free_port()
    log = (tmp_path_factory.mktemp("moto") / "moto.log").open("w")
    process = subprocess.Popen(
        [str(Path(sys.executable).parent / "moto_server"), "-H", "127.0.0.1", "-p", str(port)],
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    _wait_port(port, timeout=30)
    env = {
        "AWS_ACCESS_KEY_ID": "testing",
        "AWS_SECRET_ACCESS_KEY": "testing",
        "AWS_DEFAULT_REGION": "us-east-1",
        "AWS_ENDPOINT_URL": f"http://127.0.0.1:{port}",
    }
    import boto3

    boto3.client("s3", **_boto(env)).create_bucket(Bucket=BUCKET)
    yield env
    process.terminate()
    process.wait(10)
    log.close()


def _boto(env: dict[str, str]) -> dict[str, str]:
    return {
        "endpoint_url": env["AWS_ENDPOINT_URL"],
        "aws_access_key_id": env["AWS_ACCESS_KEY_ID"],
        "aws_secret_access_key": env["AWS_SECRET_ACCESS_KEY"],
        "region_name": env["AWS_DEFAULT_REGION"],
    }


@pytest.fixture(scope="module")
def catalog_env(request: pytest.FixtureRequest) -> Iterator[dict[str, str]]:
    """A fresh PostgreSQL database as the catalog, where one can be had; else SQLite."""
    try:
        server: str = request.getfixturevalue("postgres_server")
    except pytest.skip.Exception:
        yield {}
        return
    name = f"tinsmith_{uuid.uuid4().hex[:12]}"
    asyncio.run(admin(server, f'CREATE DATABASE "{name}"'))
    yield {"TINSMITH_CATALOG_URL": f"{server}/{name}"}
    asyncio.run(admin(server, f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))


@pytest.fixture(scope="module")
def system_on_s3(
    s3: dict[str, str], catalog_env: dict[str, str], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[RunningSystem]:
    env = {**s3, **catalog_env, "TINSMITH_BLOB_URL": f"s3://{BUCKET}/tinsmith"}
    running = start_system(tmp_path_factory.mktemp("tinsmith-s3"), env=env)
    yield running
    stop_system(running)


def _objects(s3: dict[str, str], prefix: str) -> dict[str, bytes]:
    import boto3

    client = boto3.client("s3", **_boto(s3))
    listed = client.list_objects_v2(Bucket=BUCKET, Prefix=f"tinsmith/{prefix}")
    return {
        o["Key"]: client.get_object(Bucket=BUCKET, Key=o["Key"])["Body"].read()
        for o in listed.get("Contents", [])
    }


def test_checkpoints_live_in_s3_and_download_through_presigned_urls(
    system_on_s3: RunningSystem, s3: dict[str, str]
) -> None:
    assert not (system_on_s3.data_dir / "blobs").exists()
    service = tinker.ServiceClient(base_url=system_on_s3.url, api_key="tml-s3")
    rest = tinker.RestClient(base_url=system_on_s3.url, api_key="tml-s3")
    training = service.create_lora_training_client(base_model="tinsmith/tiny", rank=4).result()
    tokenizer_free = types.ModelInput.from_ints([5, 6, 7, 8])
    datum = types.Datum(model_input=tokenizer_free, loss_fn_inputs={"target_tokens": [6, 7, 8, 9]})
    training.forward_backward([datum], "cross_entropy").result()
    training.optim_step(types.AdamParams(learning_rate=1e-2)).result()
    state = training.save_state("s3-state").result().path
    stored = _objects(s3, f"runs/{training.model_id}/weights/s3-state/")
    assert any(k.endswith("optimizer.safetensors") for k in stored)

    # The sampler and a new run both read it back from the bucket.
    resumed = service.create_training_client_from_state_with_optimizer(state).result()
    sampler = resumed.save_weights_and_get_sampling_client().result()
    sample = sampler.sample(tokenizer_free, 1, types.SamplingParams(max_tokens=3, seed=1)).result()
    assert len(sample.sequences[0].tokens) == 3

    export = training.save_weights_external("s3-export").result().path
    urls = rest.get_external_weights_urls(export).result().urls
    files = _objects(s3, f"runs/{training.model_id}/external_weights/s3-export/")
    assert set(urls) >= {"adapter_config.json", "adapter_model.safetensors"}
    for name, url in urls.items():
        assert url.startswith(s3["AWS_ENDPOINT_URL"]) and "Signature=" in url  # presigned by S3
        with urllib.request.urlopen(url) as response:
            assert (
                response.read()
                == files[f"tinsmith/runs/{training.model_id}/external_weights/s3-export/{name}"]
            )

    # The archive of tinker 0.34.0 and before: streamed by the gateway from the bucket, its
    # members the objects of the checkpoint, and the marker the old CLI looks for.
    archive = httpx.get(
        f"{system_on_s3.url}/api/v1/training_runs/{training.model_id}/checkpoints/weights/"
        "s3-state/archive",
        headers={"X-API-Key": "tml-s3"},
    )
    assert archive.status_code == 200, archive.text
    url = archive.json()["url"]
    assert url.startswith(f"{system_on_s3.url}/api/v1/archives/")  # no object: the gateway's
    with urllib.request.urlopen(url) as response:
        data = response.read()
    members = {}
    with tarfile.open(fileobj=io.BytesIO(data)) as tar:
        for member in tar.getmembers():
            extracted = tar.extractfile(member)
            assert member.isreg() and extracted is not None, member
            members[member.name] = extracted.read()
    prefix = f"tinsmith/runs/{training.model_id}/weights/s3-state/"
    assert members == {
        **{k.removeprefix(prefix): v for k, v in stored.items() if not k.endswith("/.complete")},
        "checkpoint_complete": b"",
    }

    listed = rest.list_checkpoints(training.model_id).result().checkpoints
    assert {c.tinker_path for c in listed} == {state, export}
    assert all(c.size_bytes for c in listed)
    rest.delete_checkpoint_from_tinker_path(state).result()
    assert _objects(s3, f"runs/{training.model_id}/weights/s3-state/") == {}
    service.close("success").result(timeout=30)
