"""The operator's side of API keys: ``tinsmith keys create | list | revoke`` on a deployment.

Owns: finding the deployment's NATS (``--nats-url``, else ``TINSMITH_NATS_URL``, else the
``nats.url`` that ``tinsmith up`` records in its data directory), appending ``KeyIssued`` and
``KeyRevoked``, replaying the key events (and only those: an ordered consumer on
``tinsmith.events.key.>``), and what the commands print. A new key is printed once, by ``create``,
and goes nowhere else: no log, no file, no event (``KeyIssued`` holds a salted digest). Listings
show no digest and no salt. Does not own: the key format, digests and modes (tinsmith/tenants.py),
or folding the events (tinsmith/jobs.py). The pure parts (``quotas``, ``rows``, ``issued_text``,
``table``) take and return values; only ``locate`` and ``KeyAdmin`` do I/O.
"""

from __future__ import annotations

import asyncio
import os
import re
import time
from collections.abc import AsyncIterator, Iterable, Mapping
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path

import nats
import nats.errors
from google.protobuf.message import DecodeError
from nats.aio.msg import Msg
from nats.js import api
from nats.js.errors import NotFoundError

from tinsmith import events, jobs, subjects, tenants
from tinsmith._proto import bus_pb2 as bus
from tinsmith.bus import Bus
from tinsmith.embedded import NATS_URL_FILE, recorded_nats_url
from tinsmith.eventlog import EventLog
from tinsmith.failures import InvalidRequest, NotFound, TinsmithError, Unavailable

CONNECT_TIMEOUT_S = 5.0
# The most a listing waits for the key events to arrive; they are few, so this is only a bound.
REPLAY_TIMEOUT_S = 30.0
MAX_TEXT = 200  # characters of a label or a reason

# The quota flags of ``keys create`` (one per bus.Quotas field; checkpoint storage in MiB, where
# the event holds bytes), each with its largest value and what it bounds.
_INT32 = 2**31 - 1
QUOTA_FLAGS: dict[str, tuple[int, str]] = {
    "max_runs": (_INT32, "runs loaded at once"),
    "max_sessions": (_INT32, "open sessions"),
    "max_checkpoint_mb": ((2**63 - 1) >> 20, "MiB of stored checkpoints"),
    "max_inflight": (_INT32, "requests in flight"),
    "max_queued_samples": (_INT32, "sample requests queued"),
}
_MIB = 1 << 20
# The user, password or token of a URL (what comes before the host), to leave out of messages.
_USERINFO = re.compile(r"^((?:[A-Za-z][A-Za-z0-9+.-]*://)?)[^/]*@")


@dataclass(frozen=True)
class Source:
    """A NATS URL and where it came from (a flag, a variable or a data directory's record)."""

    url: str
    origin: str

    @property
    def shown(self) -> str:
        """The URL without its credentials, and its origin: safe to print."""
        url = _USERINFO.sub(r"\1***@", self.url)
        return f"{url} (from {self.origin})"


@dataclass(frozen=True)
class KeyRow:
    """One issued key as a listing shows it: never its digest or salt."""

    key_id: str
    tenant: str
    admin: bool
    label: str
    quotas: bus.Quotas
    issued_at: float
    revoked_at: float | None = None
    reason: str = ""


# -- pure ------------------------------------------------------------------------------------------


def quotas(**flags: int | None) -> bus.Quotas:
    """The overrides of a new key from the ``create`` flags (``QUOTA_FLAGS``; None: not given).
    ``max_checkpoint_mb`` is in MiB; the event holds bytes."""
    overrides = bus.Quotas()
    for name, value in flags.items():
        if name not in QUOTA_FLAGS:
            raise ValueError(f"unknown quota {name!r}")
        if value is None:
            continue
        largest = QUOTA_FLAGS[name][0]
        if not 0 <= value <= largest:
            raise InvalidRequest(
                f"--{name.replace('_', '-')} must be between 0 and {largest}, got {value}"
            )
        if name == "max_checkpoint_mb":
            overrides.max_checkpoint_bytes = value * _MIB
        else:
            setattr(overrides, name, value)
    return overrides


def quota_text(overrides: bus.Quotas) -> str:
    """The overrides a key carries, ``name=value`` separated by commas; ``defaults`` if none."""
    parts = []
    for field, value in overrides.ListFields():
        if field.name == "max_checkpoint_bytes" and value % _MIB == 0:
            parts.append(f"max_checkpoint_mb={value // _MIB}")
        else:
            parts.append(f"{field.name}={value}")
    return ",".join(parts) or "defaults"


def check_text(value: str, what: str) -> str:
    """A label or a reason: one printable line of at most ``MAX_TEXT`` characters."""
    if len(value) > MAX_TEXT or not value.isprintable():
        raise InvalidRequest(
            f"the {what} must be one line of at most {MAX_TEXT} printable characters"
        )
    return value


def rows(key_events: Iterable[tuple[int, bus.Event]]) -> list[KeyRow]:
    """Fold key events (log position, event), in log order, into one row per issued key, oldest
    first. The fold is the gateway's (``jobs.Projection``), so a listing says exactly which keys
    the gateways accept; each row adds when and why its key was revoked."""
    projection = jobs.Projection()
    revocations: dict[str, bus.Event] = {}
    for seq, event in key_events:
        try:
            projection.apply(seq, event)
        except Exception:
            continue  # as in the gateways' projection: an event that cannot be applied is skipped
        if event.HasField("key_revoked"):
            key_id = event.key_revoked.key_id
            state = projection.keys.get(key_id)
            if state is not None and state.revoked and key_id not in revocations:
                revocations[key_id] = event
    found = []
    for key_id, state in projection.keys.items():
        revoked = revocations.get(key_id)
        issued = state.issued
        found.append(
            KeyRow(
                key_id=key_id,
                tenant=issued.tenant,
                admin=issued.admin,
                label=issued.label,
                quotas=issued.quotas,
                issued_at=state.issued_at,
                revoked_at=None if revoked is None else revoked.time,
                reason="" if revoked is None else revoked.key_revoked.reason,
            )
        )
    return sorted(found, key=lambda row: (row.issued_at, row.key_id))


def issued_text(key: str, row: KeyRow) -> str:
    """What ``create`` prints: the key, this once, and what it stands for."""
    defaults = " (the rest: the deployment's defaults)" if row.quotas.ListFields() else ""
    return (
        f"key id   {row.key_id}\n"
        f"tenant   {row.tenant}\n"
        f"admin    {_yes_no(row.admin)}\n"
        f"label    {_cell(row.label)}\n"
        f"quotas   {quota_text(row.quotas).replace(',', ', ')}{defaults}\n"
        f"issued   {_when(row.issued_at)}\n"
        f"key      {key}\n"
        "\n"
        "This is the only time the key is shown: tinsmith keeps a salted digest of it, not the "
        "key.\nHand it to its user (the Tinker SDK reads it from TINKER_API_KEY).\n"
    )


def table(key_rows: list[KeyRow]) -> str:
    """What ``list`` prints: one line per key under a header, columns aligned."""
    if not key_rows:
        return "no keys were issued yet: `tinsmith keys create --tenant NAME` issues one\n"
    header = ("KEY ID", "TENANT", "ADMIN", "ISSUED", "REVOKED", "QUOTAS", "LABEL", "REASON")
    lines = [header] + [
        (
            row.key_id,
            row.tenant,
            _yes_no(row.admin),
            _when(row.issued_at),
            "no" if row.revoked_at is None else _when(row.revoked_at),
            quota_text(row.quotas),
            _cell(row.label),
            _cell(row.reason),
        )
        for row in key_rows
    ]
    widths = [max(len(line[column]) for line in lines) for column in range(len(header))]
    return "".join(
        "  ".join(cell.ljust(width) for cell, width in zip(line, widths, strict=True)).rstrip()
        + "\n"
        for line in lines
    )


def revoked_text(row: KeyRow, *, already: bool) -> str:
    if already:
        return f"key {row.key_id} of tenant {row.tenant} was revoked already: nothing changed\n"
    return (
        f"key {row.key_id} of tenant {row.tenant} revoked: every gateway refuses it within "
        "moments\n"
    )


def _yes_no(flag: bool) -> str:
    return "yes" if flag else "no"


def _when(seconds: float) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(seconds))


def _cell(text: str) -> str:
    """Free text as one table cell: '-' if empty, anything unprintable escaped (the log may hold
    events that another program wrote)."""
    if not text:
        return "-"
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)


# -- I/O -------------------------------------------------------------------------------------------


def locate(nats_url: str | None, data_dir: Path, environ: Mapping[str, str] = os.environ) -> Source:
    """The deployment's NATS: the flag, else ``TINSMITH_NATS_URL``, else what the ``tinsmith up``
    of ``data_dir`` recorded while it runs. ``Unavailable`` if none of them names one."""
    if nats_url:
        return Source(nats_url, "--nats-url")
    from_env = environ.get("TINSMITH_NATS_URL", "").strip()
    if from_env:
        return Source(from_env, "TINSMITH_NATS_URL")
    recorded = recorded_nats_url(data_dir)
    if recorded:
        return Source(recorded, str(data_dir / NATS_URL_FILE))
    raise Unavailable(
        f"no running tinsmith to reach: {data_dir} holds no {NATS_URL_FILE} (`tinsmith up` "
        "records its NATS there while it runs); start `tinsmith up`, pass its --data-dir, or name "
        "the deployment's NATS with --nats-url or TINSMITH_NATS_URL"
    )


class KeyAdmin:
    """A connection to a deployment's event log, for the ``keys`` commands."""

    def __init__(self, bus_: Bus) -> None:
        self.eventlog = EventLog(bus_)
        self.js = bus_.js

    @staticmethod
    @asynccontextmanager
    async def connect(source: Source) -> AsyncIterator[KeyAdmin]:
        """Connect, check that the event log is there, and close on leaving. Any NATS failure,
        the first connection included, is ``Unavailable`` naming the URL (without credentials)."""
        seen: list[Exception] = []

        async def remember(error: Exception) -> None:  # instead of nats-py's logged traceback
            seen.append(error)

        try:
            nc = await asyncio.wait_for(
                nats.connect(
                    source.url,
                    name="tinsmith-keys",
                    allow_reconnect=False,
                    max_reconnect_attempts=1,  # 0 would mean: try forever
                    reconnect_time_wait=0.1,
                    connect_timeout=CONNECT_TIMEOUT_S,
                    error_cb=remember,
                ),
                CONNECT_TIMEOUT_S * 2,
            )
        except (nats.errors.Error, OSError, TimeoutError, ValueError) as exc:
            cause = seen[-1] if seen else exc
            raise Unavailable(
                f"cannot reach NATS at {source.shown}: {_describe(cause)}; is the deployment "
                "running?"
            ) from exc
        try:
            admin = KeyAdmin(Bus(nc, "tinsmith-keys"))
            try:
                await admin.js.stream_info(subjects.EVENTS_STREAM)
            except NotFoundError as exc:
                raise Unavailable(
                    f"NATS at {source.shown} holds no tinsmith event log (stream "
                    f"{subjects.EVENTS_STREAM}): no tinsmith service has run against it"
                ) from exc
            yield admin
        except (nats.errors.Error, OSError, TimeoutError) as exc:
            raise Unavailable(f"NATS at {source.shown} failed: {_describe(exc)}") from exc
        finally:
            await nc.close()

    async def issue(
        self, tenant: str, *, admin: bool, overrides: bus.Quotas, label: str
    ) -> tuple[str, KeyRow]:
        """Issue a key and append its ``KeyIssued``; return the key (to show once) and its row."""
        key, issued = tenants.issue(tenant, admin=admin, quotas=overrides, label=label)
        event = events.make(key_issued=issued)
        await self.eventlog.append(event, msg_id=f"key-issued:{issued.key_id}")
        (row,) = rows([(1, event)])
        return key, row

    async def keys(self) -> list[KeyRow]:
        return rows(await self.key_events())

    async def key_events(self) -> list[tuple[int, bus.Event]]:
        """Every key event in the log so far, in order, with its log position."""
        key_subjects = subjects.events_of("key")
        info = await self.js.stream_info(subjects.EVENTS_STREAM, subjects_filter=key_subjects)
        if not info.state.subjects:
            return []
        found: list[tuple[int, bus.Event]] = []
        caught_up = asyncio.Event()

        async def on_msg(msg: Msg) -> None:
            try:
                found.append((int(msg.metadata.sequence.stream), events.decode(msg.data)))
            except DecodeError:
                pass  # not an event: the gateways skip it too
            finally:
                if msg.metadata.num_pending == 0:
                    caught_up.set()

        subscription = await self.js.subscribe(
            key_subjects,
            stream=subjects.EVENTS_STREAM,
            cb=on_msg,
            ordered_consumer=True,
            deliver_policy=api.DeliverPolicy.ALL,
        )
        try:
            await asyncio.wait_for(caught_up.wait(), REPLAY_TIMEOUT_S)
        except TimeoutError as exc:
            raise Unavailable(
                f"the key events did not all arrive within {REPLAY_TIMEOUT_S:.0f} s "
                f"({len(found)} did); try again"
            ) from exc
        finally:
            await subscription.unsubscribe()
        return found

    async def revoke(self, key_id: str, reason: str) -> tuple[KeyRow, bool]:
        """Append ``KeyRevoked`` for an issued key; return its row and whether it was revoked
        already (then nothing is appended). ``NotFound`` if no such key was issued."""
        found = {row.key_id: row for row in await self.keys()}
        row = found.get(key_id)
        if row is None:
            raise NotFound(
                f"no key {key_id!r:.40} was issued on this deployment: `tinsmith keys list` shows "
                "the key ids"
            )
        if row.revoked_at is not None:
            return row, True
        revoked = bus.KeyRevoked(key_id=key_id, reason=reason)
        await self.eventlog.append(events.make(key_revoked=revoked), msg_id=f"key-revoked:{key_id}")
        return row, False


def key_id_argument(value: str) -> str:
    """The key id to revoke, from a key id or from the whole key (never echoed back)."""
    if value.startswith(tenants.PREFIX):
        key_id = tenants.key_id_of(value)
        if key_id is None:
            raise InvalidRequest(
                "that is neither a key id nor a whole tinsmith key (tml-<key id>_<secret>): "
                "`tinsmith keys list` shows the key ids"
            )
        return key_id
    return value


# -- the commands ----------------------------------------------------------------------------------


async def create(
    source: Source, tenant: str, *, admin: bool, overrides: bus.Quotas, label: str
) -> str:
    async with KeyAdmin.connect(source) as keyadmin:
        key, row = await keyadmin.issue(tenant, admin=admin, overrides=overrides, label=label)
    return issued_text(key, row)


async def list_keys(source: Source) -> str:
    async with KeyAdmin.connect(source) as keyadmin:
        return table(await keyadmin.keys())


async def revoke(source: Source, key_id: str, reason: str) -> str:
    async with KeyAdmin.connect(source) as keyadmin:
        row, already = await keyadmin.revoke(key_id_argument(key_id), reason)
    return revoked_text(row, already=already)


def _describe(error: BaseException) -> str:
    if isinstance(error, TinsmithError):
        return error.detail
    return str(error) or type(error).__name__
