"""Object storage: one ``BlobStore`` over fsspec (file://, s3://, gs://, memory://).

Owns: moving whole artifact directories between a local directory and a key under the store's
root, and telling whether an artifact is complete. Does not own: what keys are (artifacts.py).

An artifact is written file by file and then sealed with a marker written last, so a reader never
sees half an artifact; keys are never overwritten in place (a new save is a new key).
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import fsspec

_SEALED = ".complete"


class BlobStore:
    def __init__(self, url: str) -> None:
        self.url = url
        self.fs, root = fsspec.core.url_to_fs(url)
        self.root = str(root).rstrip("/")
        if self.fs.protocol in ("file", ("file", "local")) or "file" in self.fs.protocol:
            self.fs.makedirs(self.root, exist_ok=True)

    def _path(self, key: str) -> str:
        return f"{self.root}/{key.strip('/')}"

    async def put_dir(self, key: str, local_dir: Path) -> int:
        """Upload every file of ``local_dir`` under ``key``, then seal it. Returns bytes written."""
        return await asyncio.to_thread(self._put_dir, key, local_dir)

    def _put_dir(self, key: str, local_dir: Path) -> int:
        target = self._path(key)
        self.fs.makedirs(target, exist_ok=True)
        total = 0
        for path in sorted(local_dir.iterdir()):
            if path.is_file():
                self.fs.put_file(str(path), f"{target}/{path.name}")
                total += path.stat().st_size
        with self.fs.open(f"{target}/{_SEALED}", "wb") as marker:
            marker.write(str(total).encode())
        return total

    async def get_dir(self, key: str, local_dir: Path) -> None:
        """Download the sealed artifact at ``key`` into ``local_dir``."""
        await asyncio.to_thread(self._get_dir, key, local_dir)

    def _get_dir(self, key: str, local_dir: Path) -> None:
        source = self._path(key)
        if not self.fs.exists(f"{source}/{_SEALED}"):
            raise FileNotFoundError(f"no complete artifact at {key!r} in {self.url}")
        local_dir.mkdir(parents=True, exist_ok=True)
        for entry in self.fs.ls(source, detail=False):
            name = str(entry).rstrip("/").rsplit("/", 1)[-1]
            if name != _SEALED:
                self.fs.get_file(str(entry), str(local_dir / name))

    async def exists(self, key: str) -> bool:
        return bool(await asyncio.to_thread(self.fs.exists, f"{self._path(key)}/{_SEALED}"))

    async def delete(self, key: str) -> None:
        path = self._path(key)
        if await asyncio.to_thread(self.fs.exists, path):
            await asyncio.to_thread(self.fs.rm, path, True)
