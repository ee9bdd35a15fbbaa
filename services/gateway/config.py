"""The gateway's settings, read once from the environment."""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from tinsmith import tenants
from tinsmith.limits import Limits


@dataclass(frozen=True)
class GatewayConfig:
    host: str = "127.0.0.1"
    port: int = 8000
    # retrieve_future holds a pending future this long before answering try_again (the SDK's
    # read timeout for it is 45 s).
    long_poll_s: float = 25.0
    # The SDK cuts forward_backward requests into chunks below this many bytes.
    max_chunk_bytes: int = 4_000_000
    # Sample requests accepted but not yet answered, across all samplers, beyond which asample
    # answers 429 (the SDK backs off and resubmits).
    sampler_queue_limit: int = 4096
    # The object store, to serve the signed download URLs of stores that cannot presign their
    # own (file://) and the checkpoint archives of tinker 0.34.0 and before (every store); empty:
    # no downloads through the gateway.
    blob_url: str = ""
    # The gRPC face (grpc_face.py): its port, and the largest message it takes or sends. A
    # request becomes one NATS message (8 MiB at most, with its envelope), hence 7 MiB.
    grpc_port: int = 8001
    grpc_max_message_bytes: int = 7 * 1024 * 1024
    # The gateway's URL as clients reach it, for the download URLs it signs (file:// stores).
    # Empty: http://<host>:<port>, or, when the gateway listens on every interface, the
    # request's Host header if it is a well-formed host[:port].
    public_url: str = ""
    # The bounds every request is checked against before it is accepted.
    limits: Limits = field(default_factory=Limits)
    # Who may call (tinsmith/tenants.py): "keys" (issued keys only) or "open" (any tml- key is
    # its own tenant). TINSMITH_AUTH; unset: open on loopback, keys anywhere else.
    auth: str = tenants.OPEN
    # Each tenant's quotas unless its key overrides them (TINSMITH_TENANT_* variables).
    quotas: tenants.Quotas = field(default_factory=tenants.Quotas)

    @classmethod
    def from_env(cls) -> GatewayConfig:
        host = os.environ.get("TINSMITH_HOST", cls.host)
        return cls(
            host=host,
            port=int(os.environ.get("TINSMITH_PORT", cls.port)),
            long_poll_s=float(os.environ.get("TINSMITH_LONG_POLL_S", cls.long_poll_s)),
            sampler_queue_limit=int(
                os.environ.get("TINSMITH_SAMPLER_QUEUE_LIMIT", cls.sampler_queue_limit)
            ),
            blob_url=os.environ.get("TINSMITH_BLOB_URL", ""),
            grpc_port=int(os.environ.get("TINSMITH_GRPC_PORT", cls.grpc_port)),
            public_url=os.environ.get("TINSMITH_PUBLIC_URL", "").rstrip("/"),
            limits=Limits.from_env(),
            auth=tenants.mode_from_env(host),
            quotas=tenants.Quotas.from_env(),
        )
