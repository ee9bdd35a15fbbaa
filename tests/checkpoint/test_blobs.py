"""The object store's keys, listings and signed download URLs, on a real file:// store."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from tinsmith import artifacts
from tinsmith._proto import bus_pb2 as bus
from tinsmith.blobs import BlobStore, check_key
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


def test_signed_urls_check_their_signature_and_expiry(tmp_path: Path) -> None:
    store = BlobStore(f"file://{tmp_path / 'store'}")
    later = int(time.time()) + 60
    query = store.signed_query("runs/r/weights/x", "a.bin", later)
    path, _, params = query.partition("?")
    assert path == "runs/r/weights/x/a.bin"
    signature = params.split("signature=")[1]
    assert store.verify("runs/r/weights/x/a.bin", str(later), signature).endswith("x/a.bin")
    # Another replica (or a restart) shares the key through the store.
    assert BlobStore(f"file://{tmp_path / 'store'}").verify(
        "runs/r/weights/x/a.bin", str(later), signature
    )
    with pytest.raises(InvalidRequest, match="signature"):
        store.verify("runs/r/weights/x/b.bin", str(later), signature)
    with pytest.raises(InvalidRequest, match="expired"):
        store.verify("runs/r/weights/x/a.bin", str(later - 3600), signature)
    with pytest.raises(InvalidRequest, match="not accepted"):
        store.verify("runs/../../etc/passwd", str(later), signature)
    with pytest.raises(InvalidRequest, match="signature"):
        store.verify("runs/r/weights/x/a.bin", str(later), "é" + signature[1:])


def test_the_url_signing_key_is_its_owners_alone(tmp_path: Path) -> None:
    store = BlobStore(f"file://{tmp_path / 'store'}")
    store.signed_query("runs/r/weights/x", "a.bin", int(time.time()) + 60)
    key = tmp_path / "store" / ".tinsmith" / "url-signing-key"
    assert (key.stat().st_mode & 0o777) == 0o600
