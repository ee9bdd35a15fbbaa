"""Catalog databases for the checkpoint tests: a SQLite file, and a fresh PostgreSQL database on
the server at 127.0.0.1:5432 (trust auth, database ``test``) when it answers, else on a throwaway
server started here from the PostgreSQL binaries, else the PostgreSQL cases skip saying why. And
a file:// object store of the test's own."""

from __future__ import annotations

import asyncio
import os
import shutil
import socket
import subprocess
import tempfile
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest

from tinsmith.blobs import BlobStore
from tinsmith.embedded import free_port

_SERVER = os.environ.get("TINSMITH_TEST_POSTGRES", "postgresql+asyncpg://postgres@127.0.0.1:5432")


def _answers(host: str, port: int) -> bool:
    with socket.socket() as sock:
        sock.settimeout(1.0)
        return sock.connect_ex((host, port)) == 0


@pytest.fixture(scope="session")
def postgres_server() -> Iterator[str]:
    """``postgresql+asyncpg://user@host:port`` of a server to make test databases on."""
    if _answers("127.0.0.1", 5432):
        yield _SERVER
        return
    initdb, pg_ctl = shutil.which("initdb"), shutil.which("pg_ctl")
    if initdb is None or pg_ctl is None:
        pytest.skip("no PostgreSQL answers on 127.0.0.1:5432 and initdb/pg_ctl are not installed")
    if os.geteuid() == 0:
        pytest.skip("no PostgreSQL answers on 127.0.0.1:5432, and initdb refuses to run as root")
    data = Path(tempfile.mkdtemp(prefix="tinsmith-pg-"))
    port = free_port()
    subprocess.run(
        [initdb, "-D", str(data), "-U", "postgres", "-A", "trust"], check=True, capture_output=True
    )
    subprocess.run(
        [pg_ctl, "-D", str(data), "-o", f"-p {port} -k {data}", "-w", "start"],
        check=True,
        capture_output=True,
    )
    try:
        yield f"postgresql+asyncpg://postgres@127.0.0.1:{port}"
    finally:
        subprocess.run([pg_ctl, "-D", str(data), "-m", "fast", "stop"], capture_output=True)
        shutil.rmtree(data, ignore_errors=True)


async def admin(server: str, sql: str) -> None:
    import asyncpg

    conn = await asyncpg.connect(server.replace("postgresql+asyncpg", "postgresql") + "/test")
    try:
        await conn.execute(sql)
    finally:
        await conn.close()


@pytest.fixture
async def postgres_url(postgres_server: str) -> AsyncIterator[str]:
    """A fresh, empty database for one test, dropped afterwards."""
    name = f"tinsmith_{uuid.uuid4().hex[:12]}"
    await admin(postgres_server, f'CREATE DATABASE "{name}"')
    yield f"{postgres_server}/{name}"
    for _ in range(10):  # connections may linger a moment after the engine is disposed
        try:
            await admin(postgres_server, f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
            return
        except Exception:
            await asyncio.sleep(0.2)


@pytest.fixture(params=["sqlite", "postgresql"])
def catalog_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    if request.param == "sqlite":
        return f"sqlite+aiosqlite:///{tmp_path / 'catalog.db'}"
    url: str = request.getfixturevalue("postgres_url")
    return url


@pytest.fixture
def blobs(tmp_path: Path) -> BlobStore:
    return BlobStore(f"file://{tmp_path / 'blobs'}")
