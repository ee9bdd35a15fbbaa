"""`python -m services.gateway`: the HTTP and gRPC gateway (wiring only).

Speaks the Tinker API on TINSMITH_HOST:TINSMITH_PORT, and the same operations over gRPC on
TINSMITH_HOST:TINSMITH_GRPC_PORT (proto/tinsmith/v1/service.proto): turns each call into an
event on NATS and answers from its projection of the log. Stateless: run any number.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable

from tinsmith import runtime
from tinsmith.blobs import BlobStore
from tinsmith.bus import Bus
from tinsmith.eventlog import EventLog

from . import grpc_face, http
from .config import GatewayConfig
from .handlers import Gateway
from .rest import Rest

log = logging.getLogger(__name__)


async def start(bus: Bus) -> Callable[[], Awaitable[None]]:
    config = GatewayConfig.from_env()
    gateway = Gateway(config, EventLog(bus))
    # Its projection starts from the newest snapshot and writes its own
    # (TINSMITH_PROJECTION_SNAPSHOT_EVENTS, TINSMITH_PROJECTION_SNAPSHOT_S).
    gateway.projection.keep_snapshots("gateway")
    await gateway.start()
    log.info(
        "authentication: %s (TINSMITH_AUTH); %d keys issued, %d revoked",
        config.auth,
        len(gateway.state.keys),
        sum(key.revoked for key in gateway.state.keys.values()),
    )
    rest = Rest(gateway, BlobStore(config.blob_url) if config.blob_url else None)
    stop_http = await http.serve(http.build_app(gateway, rest), config.host, config.port)
    stop_grpc = await grpc_face.serve(gateway, rest, config)

    async def stop() -> None:
        await stop_grpc()
        await stop_http()

    return stop


if __name__ == "__main__":
    runtime.run("gateway", start, __doc__)
