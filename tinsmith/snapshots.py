"""Snapshots of projections: a projection's state at a log position, kept so that a process
starts from it and replays only the log after it.

Owns: the codec (a projection's dataclasses as compressed JSON, read back by the types of their
fields, with a fingerprint of those types), where snapshots are kept (the JetStream object store
bucket ``subjects.SNAPSHOTS_BUCKET``, one object per kind of projection, ``KINDS``; a write never
replaces a newer snapshot), and when to write one (``Policy``: every
``TINSMITH_PROJECTION_SNAPSHOT_EVENTS`` events, or ``TINSMITH_PROJECTION_SNAPSHOT_S`` seconds after
an event). Does not own: the projections (tinsmith/jobs.py, the checkpoint service's catalog),
following the log (tinsmith/eventlog.py) or what may be dropped from it (tinsmith/retention.py).

A snapshot is data, never code: nothing is unpickled. It records the fingerprint of the types it
was written with, and the log it belongs to (the event stream's creation time); a reader whose
types have another fingerprint, or whose log is another one, refuses it and replays the log.

The codec is generic over dataclass fields: ints, floats, strs, bools, bytes, enums (StrEnum),
tuples, lists, sets, frozensets, dicts, ``X | None``, nested dataclasses and protobuf messages
(as their serialized bytes). A field of any other type is refused when the codec is built, so a
type the codec cannot hold fails a test, not a start.
"""

from __future__ import annotations

import asyncio
import base64
import dataclasses
import enum
import hashlib
import json
import logging
import os
import time
import types
import typing
import uuid
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from operator import attrgetter
from typing import TYPE_CHECKING, Any, Generic, TypeVar

from google.protobuf.message import Message
from nats.js import api
from nats.js.errors import APIError, NotFoundError

from tinsmith import subjects

if TYPE_CHECKING:
    from tinsmith.bus import Bus

log = logging.getLogger(__name__)

T = TypeVar("T")

# The projections that keep snapshots, one object each. gateway and trainer hold a
# jobs.Projection; checkpoint holds the rows of the SQL catalog.
KINDS = ("gateway", "trainer", "checkpoint")
# Bump when the layout below changes (not the types: their fingerprint covers them).
FORMAT = 1
_MAGIC = b"tinsmith-snapshot\n"
_CHUNK = 1 << 20  # object store chunks
_POSITION = "Tinsmith-Position"
_FINGERPRINT = "Tinsmith-Fingerprint"
_LOG = "Tinsmith-Log"
_PURGED = "purged"  # the object that marks how far the event log was purged (no data)


# -- the codec ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Conv:
    """How one type is written: ``encode``/``decode`` (None: as it is, JSON holds it), ``copy``
    (None: immutable, shared), and its description (what the fingerprint hashes)."""

    describe: str
    encode: Callable[[Any], Any] | None = None
    decode: Callable[[Any], Any] | None = None
    copy: Callable[[Any], Any] | None = None


_PLAIN = {int: "int", float: "float", str: "str", bool: "bool", types.NoneType: "None"}


class Codec(Generic[T]):
    """Writes and reads one dataclass type (typically a projection) and everything its fields
    hold, by the declared types of those fields."""

    def __init__(self, root: type[T]) -> None:
        self.root = root
        self._building: set[type] = set()
        self._conv = self._compile(root)
        self.schema = self._conv.describe
        self.fingerprint = hashlib.sha256(f"{FORMAT}:{self.schema}".encode()).hexdigest()[:32]

    def encode(self, value: T) -> bytes:
        """The value as JSON bytes."""
        assert self._conv.encode is not None
        return json.dumps(self._conv.encode(value), separators=(",", ":")).encode()

    def decode(self, data: bytes) -> T:
        assert self._conv.decode is not None
        decoded: T = self._conv.decode(json.loads(data))
        return decoded

    def copy(self, value: T) -> T:
        """A copy that shares only what cannot change (frozen dataclasses of immutable fields,
        strings, tuples, protobuf messages, which the folds never change once stored): taken on
        the event loop, cheap, and safe to encode in another thread while the original moves on."""
        assert self._conv.copy is not None
        copied: T = self._conv.copy(value)
        return copied

    # -- building ----------------------------------------------------------------------------

    def _compile(self, tp: Any) -> _Conv:
        if tp in _PLAIN:
            return _Conv(_PLAIN[tp])
        if tp is bytes:
            return _Conv("bytes", _b64, base64.b64decode)
        origin, args = typing.get_origin(tp), typing.get_args(tp)
        if origin in (typing.Union, types.UnionType):
            return self._optional(tp, args)
        if isinstance(tp, type) and issubclass(tp, enum.Enum):
            values = [member.value for member in tp]
            if not all(isinstance(v, str | int) for v in values):
                raise TypeError(f"a snapshot holds enums of str or int values, not {tp!r}")
            members = {member.value: member for member in tp}
            return _Conv(f"enum {_name(tp)}{values}", _enum_value, members.__getitem__)
        if isinstance(tp, type) and issubclass(tp, Message):
            return _Conv(f"proto {tp.DESCRIPTOR.full_name}", _proto_bytes, _proto_reader(tp))
        if origin in (tuple, list, set, frozenset):
            return self._sequence(tp, origin, args)
        if origin is dict:
            return self._dict(args)
        if isinstance(tp, type) and dataclasses.is_dataclass(tp):
            return self._dataclass(tp)
        raise TypeError(f"a snapshot cannot hold {tp!r}: add it to tinsmith/snapshots.py")

    def _optional(self, tp: Any, args: tuple[Any, ...]) -> _Conv:
        others = [a for a in args if a is not types.NoneType]
        if len(others) != 1 or len(args) != 2:
            raise TypeError(f"a snapshot holds X | None, not {tp!r}")
        inner = self._compile(others[0])
        enc, dec, cop = inner.encode, inner.decode, inner.copy
        return _Conv(
            f"{inner.describe}|None",
            None if enc is None else (lambda v: None if v is None else enc(v)),
            None if dec is None else (lambda v: None if v is None else dec(v)),
            None if cop is None else (lambda v: None if v is None else cop(v)),
        )

    def _sequence(self, tp: Any, origin: type, args: tuple[Any, ...]) -> _Conv:
        if origin is tuple and not (len(args) == 2 and args[1] is Ellipsis):
            if not args:
                raise TypeError(f"a snapshot cannot hold the bare {tp!r}")
            parts = [self._compile(a) for a in args]
            return _Conv(
                f"tuple[{','.join(p.describe for p in parts)}]",
                lambda v: [p.encode(x) if p.encode else x for p, x in zip(parts, v, strict=True)],
                lambda v: tuple(
                    p.decode(x) if p.decode else x for p, x in zip(parts, v, strict=True)
                ),
                None
                if all(p.copy is None for p in parts)
                else lambda v: tuple(
                    p.copy(x) if p.copy else x for p, x in zip(parts, v, strict=True)
                ),
            )
        if len(args) not in (1, 2):
            raise TypeError(f"a snapshot cannot hold the bare {tp!r}")
        item = self._compile(args[0])
        enc, dec, cop = item.encode, item.decode, item.copy
        make: Callable[[Any], Any] = origin
        etc = ",..." if origin is tuple else ""
        describe = f"{origin.__name__}[{item.describe}{etc}]"
        encode = (lambda v: list(v)) if enc is None else (lambda v: [enc(x) for x in v])
        decode = make if dec is None else (lambda v: make(dec(x) for x in v))
        if origin in (tuple, frozenset):
            copy = None if cop is None else (lambda v: make(cop(x) for x in v))
        else:
            copy = make if cop is None else (lambda v: make(cop(x) for x in v))
        return _Conv(describe, encode, decode, copy)

    def _dict(self, args: tuple[Any, ...]) -> _Conv:
        key, value = (self._compile(a) for a in args)
        kenc, kdec = key.encode, key.decode
        venc, vdec, vcop = value.encode, value.decode, value.copy
        describe = f"dict[{key.describe},{value.describe}]"
        if key.describe == "str":  # a JSON object
            encode, decode = _map_values(venc), _map_values(vdec)
        else:  # pairs
            ek, ev, dk, dv = kenc or _same, venc or _same, kdec or _same, vdec or _same

            def encode(v: Any) -> Any:
                return [[ek(k), ev(x)] for k, x in v.items()]

            def decode(v: Any) -> Any:
                return {dk(k): dv(x) for k, x in v}

        copy = _map_values(vcop)
        return _Conv(describe, encode, decode, copy)

    def _dataclass(self, cls: type) -> _Conv:
        if cls in self._building:
            raise TypeError(f"a snapshot cannot hold the recursive dataclass {cls!r}")
        self._building.add(cls)
        hints = typing.get_type_hints(cls)
        fields = [f for f in dataclasses.fields(cls)]
        if any(not f.init for f in fields):
            raise TypeError(f"a snapshot holds dataclasses whose fields are all init, not {cls!r}")
        names = [f.name for f in fields]
        convs = [self._compile(hints[f.name]) for f in fields]
        self._building.discard(cls)
        frozen = cls.__dataclass_params__.frozen  # type: ignore[attr-defined]
        parts = ";".join(f"{n}:{c.describe}" for n, c in zip(names, convs, strict=True))
        describe = f"{_name(cls)}{{{parts}}}"
        values = attrgetter(*names) if len(names) > 1 else (lambda v: (getattr(v, names[0]),))
        encs = [(i, c.encode) for i, c in enumerate(convs) if c.encode is not None]
        decs = [(i, c.decode) for i, c in enumerate(convs) if c.decode is not None]
        cops = [(i, c.copy) for i, c in enumerate(convs) if c.copy is not None]

        def encode(v: Any) -> list[Any]:
            out = list(values(v))
            for i, enc in encs:
                out[i] = enc(out[i])
            return out

        def decode(v: list[Any]) -> Any:
            if len(v) != len(names):
                raise ValueError(f"{_name(cls)} has {len(names)} fields, the snapshot {len(v)}")
            for i, dec in decs:
                v[i] = dec(v[i])
            return cls(*v)

        def copy(v: Any) -> Any:
            out = list(values(v))
            for i, cop in cops:
                out[i] = cop(out[i])
            return cls(*out)

        immutable = frozen and not cops
        return _Conv(describe, encode, decode, None if immutable else copy)


def _map_values(conv: Callable[[Any], Any] | None) -> Callable[[Any], Any]:
    """A dict's copy with ``conv`` applied to each value (None: the values as they are)."""
    if conv is None:
        return dict

    def each(v: Any) -> Any:
        return {k: conv(x) for k, x in v.items()}

    return each


def _same(value: Any) -> Any:
    return value


def _name(tp: type) -> str:
    return f"{tp.__module__}.{tp.__qualname__}"


def _b64(value: bytes) -> str:
    return base64.b64encode(value).decode()


def _enum_value(value: enum.Enum) -> Any:
    return value.value


def _proto_bytes(message: Message) -> str:
    return _b64(message.SerializeToString(deterministic=True))


def _proto_reader(cls: type[Message]) -> Callable[[str], Message]:
    def read(value: str) -> Message:
        message = cls()
        message.ParseFromString(base64.b64decode(value))
        return message

    return read


# -- a snapshot's bytes ------------------------------------------------------------------------


@dataclass(frozen=True)
class Header:
    """What a snapshot says about itself, before its body is read."""

    kind: str
    position: int  # the log position the state reflects: a reader follows from position + 1
    fingerprint: str
    log: str  # the event stream's creation time: a snapshot of another log is refused
    written_at: float = 0.0
    size: int = 0  # bytes stored


def pack(header: Header, body: bytes) -> bytes:
    """The stored form: a header line of JSON, then the body, compressed."""
    meta = {
        "format": FORMAT,
        "kind": header.kind,
        "position": header.position,
        "fingerprint": header.fingerprint,
        "log": header.log,
        "written_at": header.written_at,
    }
    return _MAGIC + json.dumps(meta).encode() + b"\n" + zlib.compress(body, 1)


def unpack(data: bytes) -> tuple[Header, bytes]:
    if not data.startswith(_MAGIC):
        raise ValueError("not a tinsmith snapshot")
    line, _, rest = data[len(_MAGIC) :].partition(b"\n")
    meta = json.loads(line)
    if meta.get("format") != FORMAT:
        raise ValueError(f"snapshot format {meta.get('format')}, this version reads {FORMAT}")
    header = Header(
        kind=meta["kind"],
        position=int(meta["position"]),
        fingerprint=meta["fingerprint"],
        log=meta["log"],
        written_at=float(meta.get("written_at", 0.0)),
        size=len(data),
    )
    return header, zlib.decompress(rest)


# -- where they are kept -----------------------------------------------------------------------


class Store:
    """Snapshots in a JetStream object store bucket, one object per kind, in the object store's
    own layout (``nats object get`` reads them). Each write replaces the kind's object only if it
    is newer, and only if no other write got there first (the metadata is appended with the
    expected last sequence of its subject): two replicas of a kind never put an older snapshot
    over a newer one."""

    def __init__(self, bus: Bus, bucket: str = subjects.SNAPSHOTS_BUCKET) -> None:
        self.bus = bus
        self.bucket = bucket
        self.stream = f"OBJ_{bucket}"
        self._ready = False

    async def ensure(self) -> None:
        if self._ready:
            return
        try:
            await self.bus.js.stream_info(self.stream)
        except NotFoundError:
            config = api.ObjectStoreConfig(
                description="tinsmith: snapshots of the projections of the event log",
                storage=api.StorageType.FILE,
            )
            await self.bus.js.create_object_store(self.bucket, config=config)
        self._ready = True

    def _meta_subject(self, kind: str) -> str:
        return f"$O.{self.bucket}.M.{base64.urlsafe_b64encode(kind.encode()).decode()}"

    async def _meta(self, kind: str) -> tuple[int, dict[str, Any] | None]:
        """The kind's object metadata and its sequence (0, None: none, or no bucket yet)."""
        try:
            msg = await self.bus.js.get_last_msg(self.stream, self._meta_subject(kind))
        except NotFoundError:
            return 0, None
        info: dict[str, Any] = json.loads(msg.data or b"{}")
        if info.get("deleted"):
            return int(msg.seq or 0), None
        return int(msg.seq or 0), info

    async def latest(self, kind: str) -> Header | None:
        """The header of the kind's snapshot, without its body."""
        _, info = await self._meta(kind)
        return None if info is None else _header_of(kind, info)

    async def positions(self) -> dict[str, int]:
        """The log position of each kind's snapshot (a kind without one is absent)."""
        found = {}
        for kind in KINDS:
            header = await self.latest(kind)
            if header is not None:
                found[kind] = header.position
        return found

    async def purged(self) -> int:
        """The position below which the event log was purged (0: never): the retention marks it
        before it purges, so that a reader that must start below it knows, whatever the stream's
        first sequence says (the key events below it stay)."""
        _, info = await self._meta(_PURGED)
        return 0 if info is None else _header_of(_PURGED, info).position

    async def mark_purged(self, position: int) -> None:
        """Record that the event log is (about to be) purged below ``position``."""
        await self.ensure()
        meta = {
            "name": _PURGED,
            "bucket": self.bucket,
            "nuid": uuid.uuid4().hex,
            "size": 0,
            "chunks": 0,
            "mtime": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "digest": "SHA-256=" + base64.urlsafe_b64encode(hashlib.sha256().digest()).decode(),
            "headers": {_POSITION: [str(position)]},
        }
        await self.bus.js.publish(
            self._meta_subject(_PURGED),
            json.dumps(meta).encode(),
            headers={api.Header.ROLLUP.value: "sub"},
        )

    async def save(self, header: Header, data: bytes) -> bool:
        """Store ``data`` (``pack``'s) as the kind's snapshot; False when a snapshot at least as
        new is there already, or another writer replaced it meanwhile."""
        await self.ensure()
        seq, info = await self._meta(header.kind)
        if info is not None and _header_of(header.kind, info).position >= header.position:
            return False
        nuid = uuid.uuid4().hex
        chunks = f"$O.{self.bucket}.C.{nuid}"
        digest = hashlib.sha256(data)
        try:
            for start in range(0, len(data), _CHUNK):
                await self.bus.js.publish(chunks, data[start : start + _CHUNK])
            meta = {
                "name": header.kind,
                "bucket": self.bucket,
                "nuid": nuid,
                "size": len(data),
                "chunks": (len(data) + _CHUNK - 1) // _CHUNK,
                "mtime": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                "digest": "SHA-256=" + base64.urlsafe_b64encode(digest.digest()).decode(),
                "headers": {
                    _POSITION: [str(header.position)],
                    _FINGERPRINT: [header.fingerprint],
                    _LOG: [header.log],
                },
                "options": {"max_chunk_size": _CHUNK},
            }
            await self.bus.js.publish(
                self._meta_subject(header.kind),
                json.dumps(meta).encode(),
                headers={
                    api.Header.ROLLUP.value: "sub",
                    api.Header.EXPECTED_LAST_SUBJECT_SEQUENCE.value: str(seq),
                },
            )
        except APIError as error:
            await self.bus.js.purge_stream(self.stream, subject=chunks)
            if error.err_code == 10071:  # wrong last sequence: another writer came first
                return False
            raise
        except BaseException:
            await asyncio.shield(self.bus.js.purge_stream(self.stream, subject=chunks))
            raise
        if info is not None and info.get("nuid"):
            await self.bus.js.purge_stream(
                self.stream, subject=f"$O.{self.bucket}.C.{info['nuid']}"
            )
        return True

    async def read(self, kind: str) -> bytes | None:
        """The kind's stored snapshot (``pack``'s bytes), chunk by chunk; None without one."""
        _, info = await self._meta(kind)
        if info is None:
            return None
        chunks = f"$O.{self.bucket}.C.{info['nuid']}"
        data = bytearray()
        seq = 1
        for _ in range(int(info.get("chunks") or 0)):
            msg = await self.bus.js.get_msg(
                self.stream, seq, subject=chunks, next=True, direct=True
            )
            data += msg.data or b""
            seq = int(msg.seq or 0) + 1
        digest = "SHA-256=" + base64.urlsafe_b64encode(hashlib.sha256(data).digest()).decode()
        if len(data) != int(info.get("size") or 0) or digest != info.get("digest"):
            raise ValueError(f"the {kind} snapshot in {self.bucket} is damaged: size or digest")
        return bytes(data)


def _header_of(kind: str, info: dict[str, Any]) -> Header:
    headers = info.get("headers") or {}

    def one(name: str) -> str:
        value = headers.get(name) or [""]
        return str(value[0] if isinstance(value, list) else value)

    return Header(
        kind=kind,
        position=int(one(_POSITION) or 0),
        fingerprint=one(_FINGERPRINT),
        log=one(_LOG),
        size=int(info.get("size") or 0),
    )


async def log_identity(bus: Bus) -> str:
    """What tells this event log from another with the same name: its stream's creation time."""
    info = await bus.js.stream_info(subjects.EVENTS_STREAM)
    return info.created.isoformat() if info.created is not None else ""


# -- when to write -----------------------------------------------------------------------------


@dataclass(frozen=True)
class Policy:
    """Write a snapshot once ``every_events`` events were applied since the last, or
    ``every_s`` seconds after the first event since the last."""

    every_events: int = 5000
    every_s: float = 300.0

    @classmethod
    def from_env(cls) -> Policy:
        events_ = os.environ.get("TINSMITH_PROJECTION_SNAPSHOT_EVENTS", "").strip()
        seconds = os.environ.get("TINSMITH_PROJECTION_SNAPSHOT_S", "").strip()
        default = cls()
        try:
            policy = cls(
                every_events=int(events_) if events_ else default.every_events,
                every_s=float(seconds) if seconds else default.every_s,
            )
        except ValueError:
            raise SystemExit(
                "TINSMITH_PROJECTION_SNAPSHOT_EVENTS must be an integer and "
                f"TINSMITH_PROJECTION_SNAPSHOT_S a number, got {events_!r} and {seconds!r}"
            ) from None
        if policy.every_events < 1 or policy.every_s <= 0:
            raise SystemExit("TINSMITH_PROJECTION_SNAPSHOT_EVENTS and _S must be above 0")
        return policy

    def due(self, events_since: int, first_since: float, now: float) -> bool:
        """Whether to write one now: ``events_since`` events since the last snapshot, the first
        of them at ``first_since`` (monotonic)."""
        if events_since <= 0:
            return False
        return events_since >= self.every_events or now - first_since >= self.every_s
