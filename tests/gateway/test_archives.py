"""A checkpoint's tar archive (services/gateway/archives.py) from a real file:// store: the size
it announces is the size it sends, for files on and off the tar block size, empty ones, ones
longer than a read, and a name that needs an extended header; Python's tarfile (what the old
SDK's CLI extracts with) reads back exactly the files and the marker; a file that changes while
it is sent cuts the archive off rather than finishing it wrong."""

from __future__ import annotations

import io
import os
import tarfile
from pathlib import Path

import pytest

from services.gateway.archives import COMPLETE, Archive, ArchiveCutOff
from tinsmith.blobs import BlobStore
from tinsmith.failures import NotFound

KEY = "runs/S:train:0/weights/archived"


async def stored(tmp_path: Path, files: dict[str, bytes]) -> BlobStore:
    blobs = BlobStore(f"file://{tmp_path / 'store'}")
    local = tmp_path / "local"
    local.mkdir()
    for name, data in files.items():
        (local / name).write_bytes(data)
    await blobs.put_dir(KEY, local)
    return blobs


async def sent(archive: Archive) -> bytes:
    return b"".join([chunk async for chunk in archive.chunks()])


async def test_the_archive_is_its_announced_size_and_tarfile_reads_back_every_file(
    tmp_path: Path,
) -> None:
    files = {
        "adapter_config.json": b'{"r": 4}',
        "adapter_model.safetensors": os.urandom(3 * 1024 * 1024 + 7),  # several reads
        "on_a_block.bin": os.urandom(1024),
        "empty.bin": b"",
        "n" * 120 + ".json": b"a name longer than a tar header holds",
    }
    blobs = await stored(tmp_path, files)
    archive = await Archive.of(blobs, KEY)
    data = await sent(archive)
    assert len(data) == archive.size and archive.size % tarfile.RECORDSIZE == 0

    with tarfile.open(fileobj=io.BytesIO(data), mode="r") as tar:
        members = tar.getmembers()
        assert [m.name for m in members] == [*sorted(files), COMPLETE]
        for member in members:
            assert member.isreg() and member.mode == 0o644 and member.mtime > 0
            extracted = tar.extractfile(member)
            assert extracted is not None
            assert extracted.read() == files.get(member.name, b"")
        tar.extractall(tmp_path / "out", filter="data")
    assert {p.name: p.read_bytes() for p in (tmp_path / "out").iterdir()} == {
        **files,
        COMPLETE: b"",
    }
    # The same artifact makes the same archive, byte for byte.
    assert await sent(await Archive.of(blobs, KEY)) == data


async def test_an_unsealed_or_missing_artifact_has_no_archive(tmp_path: Path) -> None:
    blobs = await stored(tmp_path, {"adapter_config.json": b"{}"})
    (tmp_path / "store" / KEY / ".complete").unlink()
    with pytest.raises(NotFound, match="no longer in storage"):
        await Archive.of(blobs, KEY)
    with pytest.raises(NotFound):
        await Archive.of(blobs, "runs/S:train:0/weights/never-saved")


@pytest.mark.parametrize("change", ["deleted", "shorter", "longer"])
async def test_a_file_that_changes_while_it_is_sent_cuts_the_archive_off(
    tmp_path: Path, change: str
) -> None:
    blobs = await stored(tmp_path, {"a.bin": b"a" * 700, "b.bin": b"b" * 700})
    archive = await Archive.of(blobs, KEY)
    changed = tmp_path / "store" / KEY / "b.bin"
    if change == "deleted":
        changed.unlink()
    else:
        changed.write_bytes(b"b" * (600 if change == "shorter" else 800))
    chunks = []
    with pytest.raises(ArchiveCutOff, match=r"b\.bin"):
        async for chunk in archive.chunks():
            chunks.append(chunk)
    assert len(b"".join(chunks)) < archive.size
