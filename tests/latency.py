"""A TCP relay that delays what passes through it, both ways, keeping its order: a client
connected through it to a real nats-server sees a slow network, so that tests can tell work
that overlaps a round trip from work that waits for it."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from urllib.parse import urlparse


@contextlib.asynccontextmanager
async def delayed(url: str, one_way_s: float) -> AsyncIterator[str]:
    """Relay to ``url`` (nats://host:port) with ``one_way_s`` added to each direction; yield
    the relay's own URL."""
    target = urlparse(url)
    relays: set[asyncio.Future[tuple[None, None]]] = set()

    async def pump(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        loop = asyncio.get_running_loop()
        chunks: asyncio.Queue[tuple[float, bytes]] = asyncio.Queue()

        async def deliver() -> None:
            while True:
                due, data = await chunks.get()
                await asyncio.sleep(max(0.0, due - loop.time()))
                if not data:
                    break
                writer.write(data)
                await writer.drain()
            writer.close()

        delivering = asyncio.ensure_future(deliver())
        try:
            while data := await reader.read(65536):
                chunks.put_nowait((loop.time() + one_way_s, data))
        except ConnectionError:
            pass
        chunks.put_nowait((loop.time() + one_way_s, b""))
        with contextlib.suppress(ConnectionError):
            await delivering

    async def relay(client_r: asyncio.StreamReader, client_w: asyncio.StreamWriter) -> None:
        server_r, server_w = await asyncio.open_connection(target.hostname, target.port)
        both = asyncio.gather(pump(client_r, server_w), pump(server_r, client_w))
        relays.add(both)
        both.add_done_callback(relays.discard)

    server = await asyncio.start_server(relay, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        yield f"nats://127.0.0.1:{port}"
    finally:
        server.close()
        for task in list(relays):
            task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.gather(*relays, return_exceptions=True)
