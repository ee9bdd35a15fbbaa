"""A checkpoint as one tar archive, streamed from the object store: what tinker SDKs up to 0.34.0
download from the URL that ``RestClient.get_checkpoint_archive_url`` answers, and what their
``tinker checkpoint download`` and ``push-hf`` extract.

Owns: the archive's layout and bytes. The checkpoint's files sit at its root, as the old CLI
extracts them into one directory: a PEFT adapter (``adapter_config.json``,
``adapter_model.safetensors``) and whatever else the checkpoint holds (a training checkpoint's
optimizer state and metadata), each a regular file with mode 0644 and its time in the store, in
name order. An empty ``checkpoint_complete`` comes last: those versions' ``push-hf`` refuses an
archive without it, and here it stands for the store's own seal (an archive is only ever made
of a sealed artifact). The tar is uncompressed (the SDK opens it with ``tarfile.open(path,
"r")``, which reads either, and safetensors hardly compress), so its size is known before its
first byte is sent (``Content-Length``, which the CLI's progress bar reads), and it is built
while it is sent: no copy of the bytes is kept in storage.

Does not own: who may download it (the signed URL and the gateway's check, rest.py) nor reading
the files (tinsmith/blobs.py).
"""

from __future__ import annotations

import asyncio
import tarfile
from collections.abc import AsyncIterator
from dataclasses import dataclass

from tinsmith.blobs import BlobStore
from tinsmith.failures import NotFound

COMPLETE = "checkpoint_complete"
MEDIA_TYPE = "application/x-tar"
_BLOCK = tarfile.BLOCKSIZE
_RECORD = tarfile.RECORDSIZE  # an archive ends on a whole record, as tarfile writes one


class ArchiveCutOff(Exception):
    """A file's bytes in the store are not the size it was listed with (deleted, or changed,
    while it was sent): the archive is cut off, never finished with the wrong bytes."""


@dataclass(frozen=True)
class _Member:
    header: bytes
    size: int
    store_path: str  # empty: a member with no bytes (the marker)


class Archive:
    """The tar archive of one sealed artifact: its exact ``size``, then its bytes (``chunks``)."""

    def __init__(self, blobs: BlobStore, members: list[_Member]) -> None:
        self.blobs = blobs
        self.members = members
        body = sum(len(m.header) + m.size + _padding(m.size) for m in members) + 2 * _BLOCK
        self.size = body + (-body % _RECORD)

    @classmethod
    async def of(cls, blobs: BlobStore, key: str) -> Archive:
        """The archive of the artifact at ``key``, as it is in the store now."""
        try:
            files = await blobs.listing(key)
        except FileNotFoundError:
            raise NotFound("the checkpoint's files are no longer in storage") from None
        members = [
            _Member(
                _header(f.name, f.size_bytes, f.modified),
                f.size_bytes,
                blobs.file_path(key, f.name),
            )
            for f in files
        ]
        sealed = max((f.modified for f in files), default=0.0)
        members.append(_Member(_header(COMPLETE, 0, sealed), 0, ""))
        return cls(blobs, members)

    async def chunks(self) -> AsyncIterator[bytes]:
        """The archive's bytes, a file's chunk at a time (read off the event loop); raises
        ``ArchiveCutOff`` where a file does not have the size it was listed with."""
        sent = 0
        for member in self.members:
            yield member.header
            read = 0
            if member.store_path:
                try:
                    async for chunk in _read(self.blobs, member.store_path):
                        read += len(chunk)
                        if read > member.size:
                            break
                        yield chunk
                except OSError as error:  # e.g. deleted since it was listed
                    raise ArchiveCutOff(f"{member.store_path}: {error}") from error
            if read != member.size:
                raise ArchiveCutOff(
                    f"{member.store_path} has not the {member.size} bytes it was listed with"
                )
            yield b"\0" * _padding(member.size)
            sent += len(member.header) + member.size + _padding(member.size)
        yield b"\0" * (self.size - sent)  # the end-of-archive blocks, to a whole record


def _header(name: str, size: int, modified: float) -> bytes:
    """A regular file's tar header (POSIX; an extended header only where a name needs one)."""
    info = tarfile.TarInfo(name)
    info.size = size
    info.mtime = int(modified)
    info.mode = 0o644
    info.type = tarfile.REGTYPE
    return info.tobuf(tarfile.PAX_FORMAT, "utf-8", "surrogateescape")


def _padding(size: int) -> int:
    return -size % _BLOCK


async def _read(blobs: BlobStore, store_path: str) -> AsyncIterator[bytes]:
    """One file's chunks, each read in a worker thread (the store's reads block)."""
    chunks = blobs.read_chunks(store_path)
    try:
        while (chunk := await asyncio.to_thread(next, chunks, None)) is not None:
            yield chunk
    finally:
        await asyncio.to_thread(chunks.close)
