"""The checkpoint archive of tinker 0.34.0 and before (``RestClient.get_checkpoint_archive_url``,
and the ``tinker checkpoint download`` of those versions), asked as those SDKs ask it, with a
plain HTTP client: the route answers a URL signed for the caller; the URL downloads, without a
key, a tar of exactly the checkpoint's files (byte for byte what the file downloads of
``get_external_weights_urls``'s route give) and the ``checkpoint_complete`` marker; a stranger
gets a 404 for a private checkpoint, and the archive of a published one only while it stays
published; an expired, forged or re-purposed URL is a 400 that says why. The old SDKs themselves
download it in tests/sdk_story.py (``make test-sdks``)."""

from __future__ import annotations

import hashlib
import io
import tarfile
import time
import uuid
from collections.abc import Iterator
from datetime import datetime
from urllib.parse import parse_qsl, urlencode, urlsplit

import httpx
import pytest
import tinker

from tests.conftest import RunningSystem
from tinsmith.blobs import BlobStore

pytestmark = pytest.mark.e2e

COMPLETE = "checkpoint_complete"


def checkpoint_route(tinker_path: str) -> str:
    run, checkpoint = tinker_path.removeprefix("tinker://").split("/", 1)
    return f"/training_runs/{run}/checkpoints/{checkpoint}"


class Tenant:
    """One API key (its own tenant: the gateway runs open on loopback), its ServiceClient, and
    an HTTP client that sends what tinker 0.34.0 sends for the archive."""

    def __init__(self, system: RunningSystem) -> None:
        self.key = f"tml-archive-{uuid.uuid4().hex[:8]}"
        self.name = "key-" + hashlib.sha256(self.key.encode()).hexdigest()[:16]
        self.service = tinker.ServiceClient(base_url=system.url, api_key=self.key)
        self.rest = tinker.RestClient(base_url=system.url, api_key=self.key)
        self.http = httpx.Client(
            base_url=f"{system.url}/api/v1",
            headers={"X-API-Key": self.key, "Accept": "application/json"},
            follow_redirects=False,  # as the SDK asks it: a redirect would be its answer too
            timeout=60,
        )

    def archive_url(self, tinker_path: str) -> httpx.Response:
        return self.http.get(checkpoint_route(tinker_path) + "/archive")

    def file_urls(self, tinker_path: str) -> dict[str, str]:
        """What ``get_external_weights_urls``'s route answers: a signed URL per file."""
        answer = self.http.get(checkpoint_route(tinker_path) + "/external_weights_urls")
        assert answer.status_code == 200, answer.text
        urls: dict[str, str] = answer.json()["urls"]
        return urls

    def close(self) -> None:
        self.http.close()
        self.service.close("success").result(timeout=30)


@pytest.fixture(scope="module")
def owner(system: RunningSystem) -> Iterator[Tenant]:
    tenant = Tenant(system)
    yield tenant
    tenant.close()


@pytest.fixture(scope="module")
def stranger(system: RunningSystem) -> Iterator[Tenant]:
    tenant = Tenant(system)
    yield tenant
    tenant.close()


@pytest.fixture(scope="module")
def checkpoints(owner: Tenant) -> dict[str, str]:
    """A run of the owner's, trained a step, with a training and a sampler checkpoint."""
    training = owner.service.create_lora_training_client(base_model="tinsmith/tiny", rank=4)
    run = training.result()
    datum = tinker.types.Datum(
        model_input=tinker.types.ModelInput.from_ints([5, 6, 7, 8]),
        loss_fn_inputs={"target_tokens": [6, 7, 8, 9]},
    )
    run.forward_backward([datum], "cross_entropy").result()
    run.optim_step(tinker.types.AdamParams(learning_rate=1e-2)).result()
    return {
        "training": run.save_state("archived").result().path,
        "sampler": run.save_weights_for_sampler("archived").result().path,
    }


def stored(system: RunningSystem, tinker_path: str) -> dict[str, bytes]:
    """A checkpoint's files as the store holds them (its seal aside)."""
    directory = system.data_dir / "blobs" / "runs" / tinker_path.removeprefix("tinker://")
    return {p.name: p.read_bytes() for p in sorted(directory.iterdir()) if p.name != ".complete"}


def download(url: str) -> httpx.Response:
    """A GET with no API key: the URL is the credential."""
    return httpx.get(url, timeout=60)


def members(archive: bytes) -> dict[str, bytes]:
    """The archive's members in their order, each checked to be a regular file at the root."""
    out: dict[str, bytes] = {}
    with tarfile.open(fileobj=io.BytesIO(archive), mode="r:") as tar:
        for member in tar.getmembers():
            assert member.isreg() and "/" not in member.name, member
            extracted = tar.extractfile(member)
            assert extracted is not None
            out[member.name] = extracted.read()
    return out


def refusal(response: httpx.Response, status: int) -> str:
    assert response.status_code == status, response.text
    detail = response.json()["detail"]
    assert isinstance(detail, str) and detail
    return detail


def test_the_archive_is_the_checkpoints_files_and_its_marker(
    system: RunningSystem, owner: Tenant, checkpoints: dict[str, str]
) -> None:
    for kind, path in checkpoints.items():
        asked = time.time()
        answer = owner.archive_url(path)
        assert answer.status_code == 200, answer.text
        body = answer.json()
        assert set(body) == {"url", "expires"}
        expires = datetime.fromisoformat(body["expires"]).timestamp()
        assert asked + 3500 < expires < time.time() + 3700  # an hour
        assert body["url"].startswith(f"{system.url}/api/v1/archives/")

        fetched = download(body["url"])
        assert fetched.status_code == 200, fetched.text
        assert fetched.headers["Content-Type"] == "application/x-tar"
        assert int(fetched.headers["Content-Length"]) == len(fetched.content)
        assert len(fetched.content) % tarfile.RECORDSIZE == 0
        name = path.removeprefix("tinker://").replace("/", "_")
        assert f'filename="{name}.tar"' in fetched.headers["Content-Disposition"]

        files = stored(system, path)
        assert {"adapter_config.json", "adapter_model.safetensors"} <= set(files)
        if kind == "training":
            assert "optimizer.safetensors" in files
        # Exactly the checkpoint's files, in name order, then the marker.
        assert members(fetched.content) == {**files, COMPLETE: b""}
        assert list(members(fetched.content)) == [*sorted(files), COMPLETE]

        # Byte for byte what the route of get_external_weights_urls downloads, file by file.
        by_file = {n: download(u).content for n, u in owner.file_urls(path).items()}
        assert members(fetched.content) == {**by_file, COMPLETE: b""}

        # Asked again, it is the same archive; a HEAD tells its size and sends none of it.
        again = owner.archive_url(path).json()["url"]
        with httpx.Client(timeout=60) as keep_alive:
            head = keep_alive.head(again)
            assert head.status_code == 200 and head.content == b""
            assert int(head.headers["Content-Length"]) == len(fetched.content)
            assert keep_alive.get(again).content == fetched.content  # on the same connection


def test_a_stranger_reads_only_a_published_checkpoint_and_only_while_it_is(
    owner: Tenant, stranger: Tenant, checkpoints: dict[str, str]
) -> None:
    path = checkpoints["training"]
    missing = path.replace("/archived", "/no-such-checkpoint")
    # Another tenant's private checkpoint is a 404 worded as one that does not exist.
    hidden = refusal(stranger.archive_url(path), 404)
    assert hidden.replace("archived", "no-such-checkpoint") == refusal(
        stranger.archive_url(missing), 404
    )
    assert refusal(owner.archive_url(missing), 404)
    # A name that could escape storage is a 400 that says what a name is.
    run = path.removeprefix("tinker://").split("/")[0]
    bad = owner.http.get(f"/training_runs/{run}/checkpoints/weights/%2E%2E/archive")
    assert "not accepted" in refusal(bad, 400)
    # The route itself needs a key; only the URL it answers does not.
    keyless = httpx.get(str(owner.archive_url(path).url), timeout=60)
    assert refusal(keyless, 401)

    owner.rest.publish_checkpoint_from_tinker_path(path).result()
    shared = stranger.archive_url(path)
    assert shared.status_code == 200, shared.text
    url = shared.json()["url"]
    assert dict(parse_qsl(urlsplit(url).query))["tenant"] == stranger.name
    own_url = owner.archive_url(path).json()["url"]
    assert download(url).content == download(own_url).content

    owner.rest.unpublish_checkpoint_from_tinker_path(path).result()
    assert "unpublished" in refusal(download(url), 404)  # signed, but no longer readable
    assert download(own_url).status_code == 200  # its owner's still is
    assert refusal(stranger.archive_url(path), 404) == hidden


def test_expired_forged_and_file_urls_are_refused(
    system: RunningSystem, owner: Tenant, stranger: Tenant, checkpoints: dict[str, str]
) -> None:
    path = checkpoints["sampler"]
    url = owner.archive_url(path).json()["url"]
    parts = urlsplit(url)
    params = dict(parse_qsl(parts.query))
    base = f"{parts.scheme}://{parts.netloc}{parts.path}"

    def changed(**fields: str) -> str:
        return f"{base}?{urlencode({**params, **fields})}"

    signature = params["signature"]
    for forged in (
        changed(signature=("0" if signature[0] != "0" else "1") + signature[1:]),
        changed(tenant=stranger.name),  # handed to another tenant
        changed(expires=str(int(params["expires"]) + 3600)),  # made to last longer
        url.replace("/archived?", "/other?"),  # another checkpoint
    ):
        assert "signature" in refusal(download(forged), 400)
    assert "expires" in refusal(download(changed(expires="soon")), 400)
    assert refusal(download(base), 400)  # no signature at all

    # Correctly signed, but past its time: it says how to get a new one.
    blobs = BlobStore(f"file://{system.data_dir / 'blobs'}")
    key = parts.path.removeprefix("/api/v1/archives/")
    past = blobs.signed_archive_query(key, expires=int(time.time()) - 1, tenant=owner.name)
    expired = refusal(download(f"{system.url}/api/v1/archives/{past}"), 400)
    assert "expired" in expired and "get_checkpoint_archive_url" in expired

    # A file's URL is not an archive's, nor the other way round, though both are signed alike.
    file_url = owner.file_urls(path)["adapter_config.json"]
    as_archive = file_url.replace("/api/v1/blobs/", "/api/v1/archives/")
    assert "signature" in refusal(download(as_archive), 400)
    as_file = url.replace("/api/v1/archives/", "/api/v1/blobs/")
    assert "signature" in refusal(download(as_file), 400)
    assert download(url).status_code == 200  # the real one still works


def test_a_deleted_checkpoints_archive_is_gone(system: RunningSystem, owner: Tenant) -> None:
    training = owner.service.create_lora_training_client(base_model="tinsmith/tiny", rank=4)
    path = training.result().save_state("short-lived").result().path
    url = owner.archive_url(path).json()["url"]
    assert download(url).status_code == 200
    owner.rest.delete_checkpoint_from_tinker_path(path).result()
    assert not (system.data_dir / "blobs" / "runs" / path.removeprefix("tinker://")).exists()
    assert refusal(download(url), 404)
    assert refusal(owner.archive_url(path), 404)
