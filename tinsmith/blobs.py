"""Object storage: one ``BlobStore`` over fsspec (file://, s3://, gs://, memory://).

Owns: moving whole artifact directories between a local directory and a key under the store's
root, telling whether an artifact is complete, listing artifacts with their sizes and ages,
deleting them, and download URLs for their files: presigned by the store itself where it can
(s3://, gs://), else signed here for the gateway to serve (file://); and the signed URLs of whole
artifacts as tar archives, which the gateway streams from any store. Does not own: what keys are
(artifacts.py), nor an archive's bytes (services/gateway/archives.py).

An artifact is written file by file and then sealed with a marker written last, so a reader never
sees half an artifact. Keys are validated before they touch storage: relative, no empty, '.' or
'..' component.

A signed download URL is bound to the tenant it was made for: its path and query are
``<key>/<file>?expires=<unix seconds>&tenant=<tenant>&signature=<hex>``, and the signature (an
HMAC-SHA256 with the store's signing key) covers the path, the expiry and the tenant, so none of
them can be changed. ``verify`` answers the store path and the tenant (``SignedDownload``); whether
that tenant may still read the checkpoint is the caller's to check. Presigned URLs (s3://, gs://)
are the store's own and carry no tenant. An archive URL is ``<key>?expires=&tenant=&signature=``,
signed the same way under another prefix, so that neither kind of URL verifies as the other
(``signed_archive_query``, ``verify_archive``: ``SignedArchive``).
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import hmac
import os
import secrets
import time
from collections.abc import Generator
from contextlib import AbstractContextManager
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any
from urllib.parse import quote, urlencode

import fsspec
from opentelemetry.trace import Span

from tinsmith import telemetry
from tinsmith.failures import InvalidRequest

_SEALED = ".complete"
# Prefixes the signed message of each kind of URL: a file's, and a whole artifact's as a tar
# archive. A URL signed before URLs carried a tenant never verifies.
_SIGNED = "tinsmith-download-v2"
_SIGNED_ARCHIVE = "tinsmith-archive-v1"
_SIGNING_KEY = ".tinsmith/url-signing-key"
_PRESIGNING = ("s3", "s3a", "gs", "gcs")
_CHUNK = 1024 * 1024


@dataclass(frozen=True)
class SignedDownload:
    """What a valid signed download URL names: the file in the store, and the tenant it was
    signed for."""

    store_path: str  # the file, under the store's root (read it with read_chunks)
    key: str  # the artifact's key (the checkpoint's blob key)
    name: str  # the file's name in the artifact
    tenant: str


@dataclass(frozen=True)
class SignedArchive:
    """What a valid signed archive URL names: an artifact, and the tenant it was signed for."""

    key: str
    tenant: str


@dataclass(frozen=True)
class ArtifactFile:
    name: str
    size_bytes: int
    modified: float  # seconds since the epoch


@dataclass(frozen=True)
class ArtifactInfo:
    key: str
    size_bytes: int
    modified: float  # seconds since the epoch, of its newest file
    sealed: bool


def check_key(key: str) -> str:
    """A key is a relative path of printable characters whose components are neither empty nor
    '.' nor '..'."""
    parts = key.split("/") if isinstance(key, str) else [""]
    if (
        not key
        or key.startswith("/")
        or any(p in ("", ".", "..") or "\\" in p for p in parts)
        or not key.isprintable()
    ):
        raise InvalidRequest(
            f"object-store key {key!r:.200} is not accepted: a relative path of printable "
            "characters whose parts are not empty, '.' or '..'"
        )
    return key


class BlobStore:
    def __init__(self, url: str) -> None:
        self.url = url
        # Remote listings are not cached: other processes write and delete under the same keys.
        remote = {} if url.startswith(("file:", "memory:", "/")) else {"use_listings_cache": False}
        self.fs, root = fsspec.core.url_to_fs(url, **remote)
        self.root = str(root).rstrip("/")
        protocols = (self.fs.protocol,) if isinstance(self.fs.protocol, str) else self.fs.protocol
        self.protocols = tuple(str(p) for p in protocols)
        self.local = "file" in self.protocols
        if self.local:
            self.fs.makedirs(self.root, exist_ok=True)

    @property
    def presigns(self) -> bool:
        """Whether the store itself hands out download URLs (S3 and GCS presigned URLs)."""
        return any(p in _PRESIGNING for p in self.protocols)

    def _path(self, key: str) -> str:
        return f"{self.root}/{check_key(key.strip('/'))}"

    def _span(self, operation: str, key: str) -> AbstractContextManager[Span]:
        """A transfer's span: object-store I/O in the trace of the request it serves."""
        attributes = {"tinsmith.blob.key": key, "tinsmith.blob.store": self.protocols[0]}
        return telemetry.tracer.start_as_current_span(f"blob.{operation}", attributes=attributes)

    # -- artifacts -----------------------------------------------------------------------------

    async def put_dir(self, key: str, local_dir: Path) -> int:
        """Upload every file of ``local_dir`` under ``key``, then seal it. Returns bytes written."""
        with self._span("put", key) as span:
            size = await asyncio.to_thread(self._put_dir, key, local_dir)
            span.set_attribute("tinsmith.blob.bytes", size)
            return size

    def _put_dir(self, key: str, local_dir: Path) -> int:
        target = self._path(key)
        marker = f"{target}/{_SEALED}"
        if self.fs.exists(marker):  # rewritten (a repeated snapshot): unsealed while it changes
            self.fs.rm(marker)
        self.fs.makedirs(target, exist_ok=True)
        total = 0
        for path in sorted(local_dir.iterdir()):
            if path.is_file():
                self.fs.put_file(str(path), f"{target}/{path.name}")
                total += path.stat().st_size
        with self.fs.open(marker, "wb") as sealed:
            sealed.write(str(total).encode())
        return total

    async def get_dir(self, key: str, local_dir: Path) -> None:
        """Download the sealed artifact at ``key`` into ``local_dir``."""
        with self._span("get", key) as span:
            await asyncio.to_thread(self._get_dir, key, local_dir)
            size = sum(p.stat().st_size for p in local_dir.iterdir() if p.is_file())
            span.set_attribute("tinsmith.blob.bytes", size)

    def _get_dir(self, key: str, local_dir: Path) -> None:
        source = self._path(key)
        if not self.fs.exists(f"{source}/{_SEALED}"):
            raise FileNotFoundError(f"no complete artifact at {key!r} in {self.url}")
        local_dir.mkdir(parents=True, exist_ok=True)
        for entry in self.fs.ls(source, detail=False):
            name = str(entry).rstrip("/").rsplit("/", 1)[-1]
            if name != _SEALED:
                self.fs.get_file(str(entry), str(local_dir / name))

    async def copy_dir(self, source: str, target: str) -> int:
        """Copy the sealed artifact at ``source`` to ``target`` file by file (within the store:
        S3 and GCS copy server-side), then seal it. Returns the bytes copied."""
        with self._span("copy", target) as span:
            size = await asyncio.to_thread(self._copy_dir, source, target)
            span.set_attribute("tinsmith.blob.bytes", size)
            return size

    def _copy_dir(self, source: str, target: str) -> int:
        files = self._files(source)  # FileNotFoundError unless sealed
        origin, destination = self._path(source), self._path(target)
        marker = f"{destination}/{_SEALED}"
        if self.fs.exists(marker):  # copied again: unsealed while it changes
            self.fs.rm(marker)
        self.fs.makedirs(destination, exist_ok=True)
        for name in sorted(files):
            self.fs.copy(f"{origin}/{name}", f"{destination}/{name}")
        total = sum(files.values())
        with self.fs.open(marker, "wb") as sealed:
            sealed.write(str(total).encode())
        return total

    async def exists(self, key: str) -> bool:
        return bool(await asyncio.to_thread(self.fs.exists, f"{self._path(key)}/{_SEALED}"))

    async def delete(self, key: str) -> bool:
        """Remove the artifact at ``key``; False when there was nothing to remove."""
        path = self._path(key)
        if not await asyncio.to_thread(self.fs.exists, path):
            return False
        await asyncio.to_thread(self.fs.rm, path, True)
        return True

    async def files(self, key: str) -> dict[str, int]:
        """The files of the sealed artifact at ``key``, with their sizes."""
        return await asyncio.to_thread(self._files, key)

    def _files(self, key: str) -> dict[str, int]:
        return {file.name: file.size_bytes for file in self._listing(key)}

    async def listing(self, key: str) -> list[ArtifactFile]:
        """The files of the sealed artifact at ``key``, by name, with their sizes and times."""
        return await asyncio.to_thread(self._listing, key)

    def _listing(self, key: str) -> list[ArtifactFile]:
        source = self._path(key)
        if not self.fs.exists(f"{source}/{_SEALED}"):
            raise FileNotFoundError(f"no complete artifact at {key!r} in {self.url}")
        found = []
        for entry in self.fs.ls(source, detail=True):
            name = str(entry["name"]).rstrip("/").rsplit("/", 1)[-1]
            if entry.get("type") == "file" and name != _SEALED:
                found.append(ArtifactFile(name, int(entry.get("size") or 0), _modified(entry)))
        return sorted(found, key=lambda file: file.name)

    def file_path(self, key: str, name: str) -> str:
        """Where one file of an artifact is in the store (read it with ``read_chunks``)."""
        return f"{self._path(key)}/{check_key(name)}"

    async def artifacts(self, prefix: str, depth: int) -> list[ArtifactInfo]:
        """Every artifact directory ``depth`` components deep whose key starts with ``prefix``,
        sealed or not (a writer that died leaves it unsealed)."""
        return await asyncio.to_thread(self._artifacts, prefix, depth)

    def _artifacts(self, prefix: str, depth: int) -> list[ArtifactInfo]:
        base = self._path(prefix)
        if not self.fs.exists(base):
            return []
        found: dict[str, list[dict[str, Any]]] = {}
        for path, info in self.fs.find(base, detail=True).items():
            key = str(path)[len(self.root) + 1 :]
            parts = key.split("/")
            if len(parts) > depth:
                found.setdefault("/".join(parts[:depth]), []).append(info)
        return [
            ArtifactInfo(
                key=key,
                size_bytes=sum(
                    int(i.get("size") or 0) for i in infos if not i["name"].endswith(_SEALED)
                ),
                modified=max(_modified(i) for i in infos),
                sealed=any(str(i["name"]).endswith("/" + _SEALED) for i in infos),
            )
            for key, infos in sorted(found.items())
        ]

    # -- downloads -----------------------------------------------------------------------------

    def presigned_url(self, key: str, name: str, expires_in_s: int) -> str:
        """A URL that fetches one file of an artifact with a plain GET, from the store itself."""
        return str(self.fs.sign(f"{self._path(key)}/{check_key(name)}", expiration=expires_in_s))

    def _signing_key(self) -> bytes:
        """The secret behind the URLs the gateway serves: made once, kept in the store, so every
        gateway replica and the checkpoint service share it, across restarts."""
        path = f"{self.root}/{_SIGNING_KEY}"
        if not self.fs.exists(path):
            self.fs.makedirs(path.rsplit("/", 1)[0], exist_ok=True)
            with contextlib.suppress(FileExistsError):
                if self.local:  # exclusive create: the first writer wins a race; owner-only
                    with os.fdopen(
                        os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600), "wb"
                    ) as out:
                        out.write(secrets.token_bytes(32))
                else:
                    with self.fs.open(path, "wb") as out:
                        out.write(secrets.token_bytes(32))
        with self.fs.open(path, "rb") as key:
            return bytes(key.read())

    def _signature(self, kind: str, path: str, expires: int, tenant: str) -> str:
        # No part can hold a newline (a key and a tenant are printable), so the message is
        # unambiguous.
        message = f"{kind}\n{path}\n{expires}\n{tenant}".encode()
        return hmac.new(self._signing_key(), message, hashlib.sha256).hexdigest()

    def _signed_query(self, kind: str, path: str, expires: int, tenant: str) -> str:
        signature = self._signature(kind, path, expires, _check_tenant(tenant))
        query = urlencode({"expires": expires, "tenant": tenant, "signature": signature})
        return f"{quote(path)}?{query}"

    def _verify(
        self, kind: str, path: str, expires: str, signature: str, tenant: str, renew: str
    ) -> None:
        """Raise InvalidRequest unless ``signature`` signs ``path``, ``expires`` and ``tenant``
        as ``kind`` and ``expires`` has not passed (``renew`` says how to get a new URL)."""
        _check_tenant(tenant)
        try:
            deadline = int(expires)
        except ValueError:
            raise InvalidRequest("the download URL's 'expires' is not a number") from None
        if deadline < time.time():
            raise InvalidRequest(f"the download URL has expired; {renew}")
        expected = self._signature(kind, path, deadline, tenant).encode()
        if not hmac.compare_digest(expected, signature.encode("utf-8", "replace")):
            raise InvalidRequest("the download URL's signature is not valid")

    def signed_query(self, key: str, name: str, *, expires: int, tenant: str) -> str:
        """The path and query of a gateway download URL for one file, bound to ``tenant``:
        ``<key>/<name>?expires=<expires>&tenant=<tenant>&signature=<hex>``."""
        return self._signed_query(_SIGNED, f"{check_key(key)}/{check_key(name)}", expires, tenant)

    def verify(self, path: str, *, expires: str, signature: str, tenant: str) -> SignedDownload:
        """Check a gateway download URL (its path after ``/api/v1/blobs/``, and its ``expires``,
        ``signature`` and ``tenant`` parameters); return its file and the tenant it was signed
        for. Raises InvalidRequest when a part is malformed, the signature is wrong (any part
        changed) or the URL has expired."""
        check_key(path)
        if "/" not in path:
            raise InvalidRequest("the download URL names no file of an artifact")
        renew = "ask for new ones with get_external_weights_urls"
        self._verify(_SIGNED, path, expires, signature, tenant, renew)
        key, name = path.rsplit("/", 1)
        return SignedDownload(store_path=f"{self.root}/{path}", key=key, name=name, tenant=tenant)

    def signed_archive_query(self, key: str, *, expires: int, tenant: str) -> str:
        """The path and query of a gateway URL for the whole artifact at ``key`` as a tar
        archive, bound to ``tenant``: ``<key>?expires=<expires>&tenant=<tenant>&signature=<hex>``.
        """
        return self._signed_query(_SIGNED_ARCHIVE, check_key(key), expires, tenant)

    def verify_archive(
        self, key: str, *, expires: str, signature: str, tenant: str
    ) -> SignedArchive:
        """Check a gateway archive URL (its path after ``/api/v1/archives/``, and its
        parameters) as ``verify`` checks a file's; a file's URL is not an archive's."""
        renew = "ask for a new one with get_checkpoint_archive_url"
        self._verify(_SIGNED_ARCHIVE, check_key(key), expires, signature, tenant, renew)
        return SignedArchive(key=key, tenant=tenant)

    def read_chunks(self, store_path: str) -> Generator[bytes, None, None]:
        """The bytes of one file, in chunks (blocking: run it off the event loop)."""
        with self.fs.open(store_path, "rb") as source:
            while chunk := source.read(_CHUNK):
                yield chunk

    def size(self, store_path: str) -> int:
        return int(self.fs.size(store_path))


def _check_tenant(tenant: str) -> str:
    """A tenant a URL can be bound to: a name of printable characters without spaces."""
    if (
        not isinstance(tenant, str)
        or not 0 < len(tenant) <= 200
        or not tenant.isprintable()
        or any(c.isspace() for c in tenant)
    ):
        raise InvalidRequest(
            f"the download URL's tenant {tenant!r:.100} is not accepted: a URL is signed for one "
            "tenant, named by printable characters without spaces"
        )
    return tenant


def _modified(info: dict[str, Any]) -> float:
    """An entry's modification time, however the backend spells it."""
    for field in ("mtime", "LastModified", "updated", "created", "last_modified"):
        value = info.get(field)
        if isinstance(value, int | float):
            return float(value)
        if isinstance(value, datetime):
            return value.timestamp()
        if isinstance(value, str):
            with contextlib.suppress(ValueError):
                return datetime.fromisoformat(value.replace("Z", "+00:00")).timestamp()
    return time.time()
