"""The object store's keys, listings and signed download URLs, on a real file:// store."""

from __future__ import annotations

import hashlib
import hmac
import time
from pathlib import Path
from urllib.parse import parse_qsl, unquote

import pytest

from tinsmith import artifacts
from tinsmith._proto import bus_pb2 as bus
from tinsmith.blobs import BlobStore, SignedDownload, check_key
from tinsmith.failures import InvalidRequest


@pytest.mark.parametrize(
    "bad", ["", "/abs", "a/../b", "..", "a//b", "a/./b", "a\\..\\b", "a/", "a/b\x00c", "a/b\nc"]
)
def test_keys_that_could_leave_the_store_are_refused(bad: str) -> None:
    with pytest.raises(InvalidRequest, match="not accepted"):
        check_key(bad)


def test_checkpoint_ids_and_overwrite_keys() -> None:
    path = artifacts.checkpoint("S:train:0", "external_weights/final")
    assert path.kind == bus.CHECKPOINT_KIND_EXTERNAL
    assert str(path) == "tinker://S:train:0/external_weights/final"
    assert path.checkpoint_id == "external_weights/final"
    assert path.overwrite_key(7) == "runs/S:train:0/external_weights/final@00000007"
    for bad in ("weights/..", "weights/a/b", "other/a", "weights/"):
        with pytest.raises(InvalidRequest):
            artifacts.checkpoint("S:train:0", bad)


async def test_artifacts_are_listed_with_sizes_and_whether_they_are_sealed(
    tmp_path: Path,
) -> None:
    store = BlobStore(f"file://{tmp_path / 'store'}")
    local = tmp_path / "local"
    local.mkdir()
    (local / "a.bin").write_bytes(b"12345")
    (local / "b.json").write_bytes(b"{}")
    assert await store.put_dir("runs/r/weights/x", local) == 7
    (tmp_path / "store" / "runs" / "r" / "snapshots" / "1").mkdir(parents=True)
    (tmp_path / "store" / "runs" / "r" / "snapshots" / "1" / "half").write_bytes(b"...")
    listed = {a.key: a for a in await store.artifacts("runs", 4)}
    assert listed["runs/r/weights/x"].size_bytes == 7 and listed["runs/r/weights/x"].sealed
    assert not listed["runs/r/snapshots/1"].sealed
    assert await store.files("runs/r/weights/x") == {"a.bin": 5, "b.json": 2}
    assert await store.delete("runs/r/weights/x")
    assert not await store.delete("runs/r/weights/x")


def _params(query: str) -> tuple[str, dict[str, str]]:
    path, _, params = query.partition("?")
    return unquote(path), dict(parse_qsl(params))


def test_signed_urls_check_their_signature_and_expiry(tmp_path: Path) -> None:
    store = BlobStore(f"file://{tmp_path / 'store'}")
    later = int(time.time()) + 60
    query = store.signed_query("runs/r:train:0/weights/x", "a.bin", expires=later, tenant="alice")
    path, params = _params(query)
    assert path == "runs/r:train:0/weights/x/a.bin"
    assert sorted(params) == ["expires", "signature", "tenant"]
    assert (params["expires"], params["tenant"]) == (str(later), "alice")
    signature = params["signature"]
    verified = store.verify(path, expires=str(later), signature=signature, tenant="alice")
    assert verified == SignedDownload(
        store_path=f"{store.root}/runs/r:train:0/weights/x/a.bin",
        key="runs/r:train:0/weights/x",
        name="a.bin",
        tenant="alice",
    )
    # Another replica (or a restart) shares the key through the store.
    again = BlobStore(f"file://{tmp_path / 'store'}")
    assert again.verify(path, expires=str(later), signature=signature, tenant="alice") == verified
    with pytest.raises(InvalidRequest, match="signature"):
        store.verify(
            "runs/r:train:0/weights/x/b.bin",
            expires=str(later),
            signature=signature,
            tenant="alice",
        )
    with pytest.raises(InvalidRequest, match="signature"):  # a later deadline is a change too
        store.verify(path, expires=str(later + 1), signature=signature, tenant="alice")
    with pytest.raises(InvalidRequest, match="expired"):
        store.verify(path, expires=str(later - 3600), signature=signature, tenant="alice")
    with pytest.raises(InvalidRequest, match="not accepted"):
        store.verify("runs/../../etc/passwd", expires=str(later), signature=signature, tenant="a")
    with pytest.raises(InvalidRequest, match="signature"):
        store.verify(path, expires=str(later), signature="é" + signature[1:], tenant="alice")
    with pytest.raises(InvalidRequest, match="not a number"):
        store.verify(path, expires="soon", signature=signature, tenant="alice")


def test_a_signed_url_is_bound_to_its_tenant(tmp_path: Path) -> None:
    store = BlobStore(f"file://{tmp_path / 'store'}")
    later = int(time.time()) + 60
    path, params = _params(
        store.signed_query(
            "runs/r/weights/x", "a.bin", expires=later, tenant="key-0123456789abcdef"
        )
    )
    signature = params["signature"]
    verified = store.verify(
        path, expires=params["expires"], signature=signature, tenant=params["tenant"]
    )
    assert verified.tenant == "key-0123456789abcdef"
    # Another tenant's name in its place breaks the signature, whoever's it is.
    for other in ("bob", "key-0123456789abcdeF", "key-0123456789abcdef0", "key-0123456789abcde"):
        with pytest.raises(InvalidRequest, match="signature"):
            store.verify(path, expires=params["expires"], signature=signature, tenant=other)
    # No tenant, or one that could smuggle a line into the signed message, is refused outright.
    for malformed in ("", "bob\n1", "a b"):
        with pytest.raises(InvalidRequest, match="tenant"):
            store.verify(path, expires=params["expires"], signature=signature, tenant=malformed)
    with pytest.raises(InvalidRequest, match="tenant"):
        store.signed_query("runs/r/weights/x", "a.bin", expires=later, tenant="")
    # Two tenants get two signatures for the same file and expiry.
    _, theirs = _params(store.signed_query("runs/r/weights/x", "a.bin", expires=later, tenant="b"))
    assert theirs["signature"] != signature


def test_a_url_signed_before_urls_named_their_tenant_is_refused(tmp_path: Path) -> None:
    store = BlobStore(f"file://{tmp_path / 'store'}")
    store.signed_query("runs/r/weights/x", "a.bin", expires=int(time.time()) + 60, tenant="a")
    later = int(time.time()) + 60
    key = (tmp_path / "store" / ".tinsmith" / "url-signing-key").read_bytes()
    # How URLs were signed before: the path and the expiry, nothing else.
    old = hmac.new(key, f"runs/r/weights/x/a.bin\n{later}".encode(), hashlib.sha256).hexdigest()
    for tenant in ("a", "b"):
        with pytest.raises(InvalidRequest, match="signature"):
            store.verify("runs/r/weights/x/a.bin", expires=str(later), signature=old, tenant=tenant)


def test_the_url_signing_key_is_its_owners_alone(tmp_path: Path) -> None:
    store = BlobStore(f"file://{tmp_path / 'store'}")
    store.signed_query("runs/r/weights/x", "a.bin", expires=int(time.time()) + 60, tenant="a")
    key = tmp_path / "store" / ".tinsmith" / "url-signing-key"
    assert (key.stat().st_mode & 0o777) == 0o600
