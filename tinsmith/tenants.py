"""Tenants and their API keys: who is calling, decided in one place.

Owns: the key format (``tml-<key_id>_<secret>``, which the Tinker SDK accepts as it is), issuing
a key (random, shown once, kept only as a salted SHA-256 digest in a ``KeyIssued`` event),
checking a presented key against the keys folded from the log (``jobs.Projection.keys``), the two
authentication modes, and each tenant's quotas (the deployment's defaults with a key's own
overrides). Does not own: appending the key events (tinsmith/keyadmin.py) or where a tenant's
quotas are compared with its usage (the gateway's operations). Pure: no I/O.

Keys carry 256 random bits, so a fast salted digest is the right store for them (a slow password
hash guards low-entropy secrets; it would only slow every call down here).

Modes (``TINSMITH_AUTH``):

- ``keys``: only keys the operator issued, and not revoked, are accepted. The default whenever
  the gateway listens beyond loopback.
- ``open``: the laptop mode. An issued key still means its tenant (and a revoked one is still
  refused); any other ``tml-`` key is a tenant of its own, named by a digest of the key.

Either way a call without a key, or with one that is not a ``tml-`` key, is refused.
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import os
import re
import secrets
from collections.abc import Mapping
from dataclasses import dataclass, fields, replace

from tinsmith._proto import bus_pb2 as bus
from tinsmith.failures import InvalidRequest, Unauthenticated
from tinsmith.jobs import KeyState

KEYS = "keys"
OPEN = "open"
MODES = (KEYS, OPEN)
MODE_VARIABLE = "TINSMITH_AUTH"

PREFIX = "tml-"
_KEY = re.compile(r"tml-([0-9a-f]{16})_([A-Za-z0-9_-]{43})")
_TENANT = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")
_OPEN_TENANT = "key-"  # open-mode tenants: key-<digest of the key>


@dataclass(frozen=True)
class Quotas:
    """What one tenant may hold at once. Each default is a ``TINSMITH_TENANT_*`` variable
    (``VARIABLES``); a key may override each one (``bus.Quotas``)."""

    # Runs loaded in the trainers (not unloaded for idleness, in a session not finished).
    max_runs: int = 64
    # Sessions not finished that created something or took a request in the last hour.
    max_sessions: int = 256
    # Bytes of the tenant's live checkpoints in storage.
    max_checkpoint_bytes: int = 64 << 30
    # Requests accepted and not yet settled, training and sampling together.
    max_inflight: int = 512
    # Sample requests accepted and not yet settled: the tenant's share of the samplers' queue
    # (TINSMITH_SAMPLER_QUEUE_LIMIT bounds all tenants together).
    max_queued_samples: int = 1024

    @classmethod
    def from_env(cls) -> Quotas:
        quotas = cls()
        for name, variable in VARIABLES.items():
            raw = os.environ.get(variable, "").strip()
            if not raw:
                continue
            if not raw.isdigit():
                raise SystemExit(f"{variable} must be a non-negative integer, got {raw!r}")
            value = int(raw) << 20 if name == "max_checkpoint_bytes" else int(raw)
            quotas = replace(quotas, **{name: value})
        return quotas

    def overridden(self, overrides: bus.Quotas) -> Quotas:
        """These defaults with a key's overrides (its fields that are set)."""
        return replace(self, **{f.name: v for f, v in overrides.ListFields()})


VARIABLES = {
    "max_runs": "TINSMITH_TENANT_MAX_RUNS",
    "max_sessions": "TINSMITH_TENANT_MAX_SESSIONS",
    "max_checkpoint_bytes": "TINSMITH_TENANT_MAX_CHECKPOINT_MB",
    "max_inflight": "TINSMITH_TENANT_MAX_INFLIGHT",
    "max_queued_samples": "TINSMITH_TENANT_MAX_QUEUED_SAMPLES",
}
assert set(VARIABLES) == {f.name for f in fields(Quotas)}

# A session counts against max_sessions while it is not finished and was active (created, or
# took a request) this recently; the SDK finishes its session on close().
SESSION_ACTIVE_S = 3600.0


@dataclass(frozen=True)
class Tenant:
    """Who a call is from: the owner of everything it creates."""

    name: str
    quotas: Quotas
    admin: bool = False
    key_id: str = ""  # the issued key it presented; empty for an open-mode tenant


def issue(
    tenant: str, *, admin: bool = False, quotas: bus.Quotas | None = None, label: str = ""
) -> tuple[str, bus.KeyIssued]:
    """A new key for ``tenant``: the key (to show once) and the event that records its digest."""
    check_tenant(tenant)
    key_id = secrets.token_hex(8)
    secret = secrets.token_urlsafe(32)
    salt = secrets.token_bytes(16)
    issued = bus.KeyIssued(
        key_id=key_id,
        tenant=tenant,
        admin=admin,
        salt=salt,
        digest=_digest(salt, secret),
        quotas=quotas or bus.Quotas(),
        label=label,
    )
    return f"{PREFIX}{key_id}_{secret}", issued


def check_tenant(name: str) -> str:
    if not _TENANT.fullmatch(name) or name.startswith(_OPEN_TENANT):
        raise InvalidRequest(
            f"tenant name {name!r:.80} is not accepted: use 1-64 characters from A-Z, a-z, 0-9, "
            f"'_', '.' and '-', starting with a letter or digit, and not starting with "
            f"{_OPEN_TENANT!r} (open mode's tenants)"
        )
    return name


def key_id_of(key: str) -> str | None:
    """The key id of an issued-format key, else None."""
    found = _KEY.fullmatch(key)
    return found.group(1) if found else None


def authenticate(
    key: str | None, keys: Mapping[str, KeyState], *, mode: str, defaults: Quotas
) -> Tenant:
    """The tenant a presented key stands for, or ``Unauthenticated`` saying why not."""
    if not key:
        raise Unauthenticated(
            "this call carries no API key: send one in the X-API-Key header (HTTP) or the "
            "x-api-key metadata (gRPC)"
        )
    if not key.startswith(PREFIX):
        raise Unauthenticated("the API key is not a tinsmith key: keys start with 'tml-'")
    found = _KEY.fullmatch(key)
    state = keys.get(found.group(1)) if found else None
    if state is not None and found is not None:
        if not hmac.compare_digest(state.issued.digest, _digest(state.issued.salt, found.group(2))):
            state = None  # a known key id with the wrong secret is an unknown key
        elif state.revoked:
            raise Unauthenticated(
                f"API key {state.issued.key_id} was revoked; ask the operator for a new one"
            )
        else:
            issued = state.issued
            return Tenant(
                name=issued.tenant,
                quotas=defaults.overridden(issued.quotas),
                admin=issued.admin,
                key_id=issued.key_id,
            )
    if mode == OPEN:
        return Tenant(name=open_tenant(key), quotas=defaults)
    raise Unauthenticated(
        "the API key is not one this deployment issued (TINSMITH_AUTH=keys): the operator "
        "issues keys with `tinsmith keys create --tenant NAME`"
    )


def open_tenant(key: str) -> str:
    """The tenant an unissued key is in open mode: a digest of the key, never the key."""
    return _OPEN_TENANT + hashlib.sha256(key.encode()).hexdigest()[:16]


def mode_from_env(host: str) -> str:
    """``TINSMITH_AUTH``, or its default: ``keys`` unless the gateway listens on loopback only."""
    mode = os.environ.get(MODE_VARIABLE, "").strip().lower()
    if not mode:
        return OPEN if is_loopback(host) else KEYS
    if mode not in MODES:
        raise SystemExit(f"{MODE_VARIABLE} must be one of {', '.join(MODES)}, got {mode!r}")
    return mode


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _digest(salt: bytes, secret: str) -> bytes:
    return hashlib.sha256(salt + secret.encode()).digest()
