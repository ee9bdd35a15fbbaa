"""The Tinker REST API (what ``tinker.RestClient``, ``AdminClient`` and the ``tinker`` command
line call): training runs, checkpoints and copies of them, sessions, their projects and search,
storage and billing usage, the audit log, the downloads of signed URLs for stores that
cannot presign their own (file://), and checkpoints as tar archives (for tinker 0.34.0 and
before: archives.py). docs/sdk-methods.md lists every SDK method and its route.

Owns: the routes and their parameters, and relaying each call to the checkpoint service's
catalog over NATS as the calling tenant asks it. Does not own the answers: the catalog
(services/checkpoint) builds the JSON and decides what each tenant may see.
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
import time
from datetime import datetime
from typing import Any

from aiohttp import web

from tinsmith import artifacts, subjects
from tinsmith._proto import bus_pb2 as bus
from tinsmith.blobs import BlobStore
from tinsmith.bus import MAX_BODY_BYTES
from tinsmith.failures import InvalidRequest, NotFound, TooLarge, from_kind
from tinsmith.limits import INT32_MAX, INT64_MAX
from tinsmith.tenants import Tenant

from . import archives, wire
from . import operations as ops
from .config import GatewayConfig
from .handlers import Gateway

log = logging.getLogger(__name__)

API = "/api/v1"
_CHECKPOINT = API + "/training_runs/{run}/checkpoints/{segment}/{name}"
# A Host header the gateway will put into the download URLs it signs: a DNS name, an IPv4
# address or a bracketed IPv6 address, and a port.
_LABEL = r"[A-Za-z0-9](?:[A-Za-z0-9-]{0,61}[A-Za-z0-9])?"
_HOST = re.compile(rf"(?:{_LABEL}(?:\.{_LABEL})*|\[[0-9A-Fa-f:.]+\])(?::[0-9]{{1,5}})?")
_EVERY_INTERFACE = ("", "0.0.0.0", "::")
_NO_STORE = (
    "this gateway serves no downloads: it has no TINSMITH_BLOB_URL (its operator sets it to the "
    "object store the other services use)"
)


def tenant_of(request: web.Request) -> Tenant:
    """Who is calling, as the authentication middleware (http.py) found it."""
    tenant = request["tenant"]
    assert isinstance(tenant, Tenant)
    return tenant


# The catalog operations whose second execution answers differently from the first (a deleted
# checkpoint is not found): sent again only when no checkpoint service had them. Every other one
# is a read or sets what it sets, and is sent again when its answer is late (tinsmith/bus.py).
_NOT_REPEATABLE = frozenset({"delete_checkpoint", "gc"})


class Rest:
    def __init__(self, gateway: Gateway, blobs: BlobStore | None) -> None:
        self.gateway = gateway
        self.bus = gateway.log.bus
        self.blobs = blobs
        self.config = gateway.config

    def add_routes(self, app: web.Application) -> None:
        get, add = app.router.add_get, app.router.add_route
        get(API + "/training_runs", self.training_runs)
        get(API + "/training_runs/{run}", self.training_run)
        get(API + "/training_runs/{run}/checkpoints", self.checkpoints)
        get(API + "/checkpoints", self.user_checkpoints)
        add("DELETE", _CHECKPOINT, self.delete_checkpoint)
        add("POST", _CHECKPOINT + "/publish", self.publish)
        add("DELETE", _CHECKPOINT + "/publish", self.unpublish)
        add("PUT", _CHECKPOINT + "/ttl", self.set_ttl)
        get(_CHECKPOINT + "/external_weights_urls", self.external_weights_urls)
        get(_CHECKPOINT + "/archive", self.archive_url)
        add("POST", API + "/weights_info", self.weights_info)
        get(API + "/sessions", self.sessions)
        get(API + "/sessions/{session}", self.session)
        add("PUT", API + "/sessions/{session}/project", self.assign_project)
        add("POST", API + "/sessions/search", self.search_sessions)
        add("POST", API + "/copy_weights", self.copy_weights)
        get(API + "/billing/usage/checkpoints/current", self.storage_usage)
        get(API + "/billing/usage/events", self.billing_usage)
        get(API + "/audit", self.audit_log)
        # How runs are going (services/checkpoint/progress.py): what the console shows.
        get(API + "/training_runs/{run}/metrics", self.run_metrics)
        add("POST", API + "/training_runs/{run}/metrics", self.report_metrics)
        get(API + "/training_runs/{run}/requests", self.run_requests)
        get(API + "/console/runs", self.console_runs)
        get(API + "/sweeps/{sweep}", self.sweep)
        get(API + "/sessions/{session}/trace_export", self.trace_export)
        get(API + "/engines", self.engines)
        get(API + "/blobs/{path:.+}", self.download)
        get(API + "/archives/{path:.+}", self.archive)

    async def ask(self, op: str, tenant: Tenant, **fields: Any) -> bytes:
        """Relay one operation to the catalog (for HTTP and gRPC alike) as ``tenant`` asks it:
        its JSON, or its error raised."""
        query = bus.CatalogQuery(owner=tenant.name, admin=tenant.admin, **fields)
        reply = bus.CatalogReply.FromString(
            await self.bus.request(
                subjects.catalog_subject(op),
                query.SerializeToString(),
                repeatable=op not in _NOT_REPEATABLE,
            )
        )
        if reply.error_kind:
            raise from_kind(reply.error_kind, reply.error_detail)
        return reply.json

    async def _ask(self, op: str, request: web.Request, **fields: Any) -> web.Response:
        """Relay one operation to the catalog; its JSON is the answer, its error the status."""
        body = await self.ask(op, tenant_of(request), **fields)
        return web.Response(body=body, content_type="application/json")

    # -- training runs and checkpoints ---------------------------------------------------------

    async def training_runs(self, request: web.Request) -> web.Response:
        return await self._ask(
            "training_runs",
            request,
            limit=_int(request, "limit", 20),
            offset=_int(request, "offset", 0),
            access_scope=request.query.get("access_scope", "owned"),
            project_id=wire.text(dict(request.query), "project_id"),
        )

    async def training_run(self, request: web.Request) -> web.Response:
        return await self._ask(
            "training_run",
            request,
            training_run_id=subjects.check_id("training run id", request.match_info["run"]),
            access_scope=request.query.get("access_scope", "owned"),
        )

    async def checkpoints(self, request: web.Request) -> web.Response:
        return await self._ask(
            "checkpoints",
            request,
            training_run_id=subjects.check_id("training run id", request.match_info["run"]),
            access_scope=request.query.get("access_scope", "owned"),
        )

    async def user_checkpoints(self, request: web.Request) -> web.Response:
        return await self._ask(
            "user_checkpoints",
            request,
            limit=_int(request, "limit", 100),
            offset=_int(request, "offset", 0),
        )

    async def delete_checkpoint(self, request: web.Request) -> web.Response:
        return await self._ask("delete_checkpoint", request, tinker_path=_path(request))

    async def publish(self, request: web.Request) -> web.Response:
        return await self._ask(
            "publish_checkpoint", request, tinker_path=_path(request), public=True
        )

    async def unpublish(self, request: web.Request) -> web.Response:
        return await self._ask(
            "publish_checkpoint", request, tinker_path=_path(request), public=False
        )

    async def set_ttl(self, request: web.Request) -> web.Response:
        body = await read_json(request)
        ttl = body.get("ttl_seconds")
        if ttl is not None and (
            not isinstance(ttl, int) or isinstance(ttl, bool) or not 0 <= ttl <= INT64_MAX
        ):
            raise InvalidRequest(
                f"ttl_seconds must be a number of seconds or null, got {ttl!r:.50}"
            )
        return await self._ask(
            "set_checkpoint_ttl", request, tinker_path=_path(request), ttl_seconds=ttl
        )

    async def external_weights_urls(self, request: web.Request) -> web.Response:
        return await self._ask(
            "external_weights_urls",
            request,
            tinker_path=_path(request),
            base_url=download_base(self.config, request.host),
        )

    async def archive_url(self, request: web.Request) -> web.Response:
        """``get_checkpoint_archive_url`` (tinker 0.34.0 and before): ``{"url", "expires"}``, a
        URL of this gateway's that downloads the checkpoint as one tar archive, signed for the
        caller (JSON: those SDKs take it as well as a redirect to the URL)."""
        tinker_path = _path(request)
        if self.blobs is None:
            raise NotFound(_NO_STORE)
        return await self._ask(
            "checkpoint_archive_url",
            request,
            tinker_path=tinker_path,
            base_url=download_base(self.config, request.host),
        )

    async def copy_weights(self, request: web.Request) -> web.Response:
        """``copy_weights``: a checkpoint the caller may read copied into a new run of its own
        (services/checkpoint/copies.py). ``weights_access_token`` is read and not used: what a
        tenant may read is its own checkpoints and the published ones."""
        tenant = tenant_of(request)
        body = await read_json(request)
        source = body.get("source_path")
        if not isinstance(source, str):
            raise InvalidRequest("copy_weights needs 'source_path', a tinker:// checkpoint path")
        session_id = wire.opt_str(body, "session_id")
        model_seq_id = body.get("model_seq_id")
        if model_seq_id is not None:
            model_seq_id = wire.req_int(body, "model_seq_id", minimum=0, maximum=INT32_MAX)
        ttl = body.get("ttl_seconds")
        if ttl is not None:
            ttl = wire.req_int(body, "ttl_seconds", minimum=0)
        project = wire.opt_str(body, "destination_project_id")
        key = request.headers.get("X-Idempotency-Key", "")
        if len(key) > 200 or not key.isprintable():
            raise InvalidRequest(
                "the X-Idempotency-Key header must be at most 200 printable characters"
            )
        await self.gateway.decide(tenant, ops.may_store_checkpoint)
        return await self._ask(
            "copy_weights",
            request,
            tinker_path=str(artifacts.parse(source)),
            project_id=_project(project) if project is not None else "",
            session_id=subjects.check_id("session id", session_id) if session_id else "",
            model_seq_id=model_seq_id,
            ttl_seconds=ttl,
            idempotency_key=key,
        )

    async def weights_info(self, request: web.Request) -> web.Response:
        body = await read_json(request)
        path = body.get("tinker_path")
        if not isinstance(path, str):
            raise InvalidRequest("weights_info needs 'tinker_path', a tinker:// checkpoint path")
        return await self._ask("weights_info", request, tinker_path=str(artifacts.parse(path)))

    # -- sessions and usage --------------------------------------------------------------------

    async def sessions(self, request: web.Request) -> web.Response:
        return await self._ask(
            "sessions", request, limit=_int(request, "limit", 20), offset=_int(request, "offset", 0)
        )

    async def session(self, request: web.Request) -> web.Response:
        return await self._ask(
            "session",
            request,
            session_id=subjects.check_id("session id", request.match_info["session"]),
        )

    async def assign_project(self, request: web.Request) -> web.Response:
        body = await read_json(request)
        project = body.get("project_id")
        if not isinstance(project, str):
            raise InvalidRequest(
                "assign_session_project needs 'project_id', the project to move the session "
                "into (sessions cannot be moved out of a project)"
            )
        return await self._ask(
            "assign_session_project",
            request,
            session_id=subjects.check_id("session id", request.match_info["session"]),
            project_id=_project(project),
        )

    async def search_sessions(self, request: web.Request) -> web.Response:
        """``search_sessions``: the SessionSearchRequest goes to the catalog as it came (it
        reads and checks every field: services/checkpoint/sessions.py)."""
        body = await read_json(request)
        return await self._ask("search_sessions", request, search=json.dumps(body))

    async def audit_log(self, request: web.Request) -> web.Response:
        return await self._ask(
            "audit_log",
            request,
            event_type=request.query.get("event_type", "all")[:50],
            day=request.query.get("day", "")[:50],
        )

    async def billing_usage(self, request: web.Request) -> web.Response:
        return await self._ask(
            "billing_usage",
            request,
            starting_on=_instant(request, "starting_on"),
            ending_before=_instant(request, "ending_before"),
        )

    async def storage_usage(self, request: web.Request) -> web.Response:
        return await self._ask(
            "storage_usage", request, project_id=wire.text(dict(request.query), "project_id")
        )

    # -- progress ------------------------------------------------------------------------------

    async def run_metrics(self, request: web.Request) -> web.Response:
        return await self._ask("run_metrics", request, training_run_id=_run(request))

    async def report_metrics(self, request: web.Request) -> web.Response:
        body = await read_json(request)
        metrics = body.get("metrics")
        if not isinstance(metrics, dict) or not all(
            isinstance(value, int | float) and not isinstance(value, bool)
            for value in metrics.values()
        ):
            raise InvalidRequest(
                "the body needs 'metrics', an object of names and finite numbers, e.g. "
                '{"metrics": {"reward": 0.5}, "step": 3} (step: optional, the run\'s current '
                "step by default)"
            )
        step = body.get("step")
        if step is not None and (
            not isinstance(step, int) or isinstance(step, bool) or not 0 <= step <= INT32_MAX
        ):
            raise InvalidRequest(
                f"step must be a step number from 0 to {INT32_MAX}, or null for the run's "
                f"current step; got {step!r:.50}"
            )
        return await self._ask(
            "report_metrics",
            request,
            training_run_id=_run(request),
            metrics={str(name): float(value) for name, value in metrics.items()},
            step=step,
        )

    async def run_requests(self, request: web.Request) -> web.Response:
        return await self._ask(
            "run_requests",
            request,
            training_run_id=_run(request),
            limit=_int(request, "limit", 100),
            offset=_int(request, "offset", 0),
        )

    async def console_runs(self, request: web.Request) -> web.Response:
        query = dict(request.query)
        return await self._ask(
            "console_runs",
            request,
            tag=wire.text(query, "tag"),
            sweep=wire.text(query, "sweep"),
            limit=_int(request, "limit", 50),
            offset=_int(request, "offset", 0),
        )

    async def sweep(self, request: web.Request) -> web.Response:
        query = dict(request.query)
        return await self._ask(
            "sweep",
            request,
            sweep=request.match_info["sweep"][:200],
            metric=wire.text(query, "metric"),
            goal=wire.text(query, "goal"),
        )

    async def trace_export(self, request: web.Request) -> web.Response:
        """``export_session_trace``: the trace is built when asked, so it is ready at once."""
        return await self._ask(
            "trace_export",
            request,
            session_id=subjects.check_id("session id", request.match_info["session"]),
            base_url=download_base(self.config, request.host),
        )

    async def engines(self, request: web.Request) -> web.Response:
        """The operators' view (admin keys): each engine replica's duty cycle and gauges, and
        each tenant's usage."""
        tenants = await self.gateway.decide(tenant_of(request), ops.tenants_usage)
        engines = self.gateway.engines.view(time.time())
        return web.json_response({"engines": engines, "tenants": tenants})

    # -- downloads -----------------------------------------------------------------------------

    async def download(self, request: web.Request) -> web.StreamResponse:
        """One file of a checkpoint, for a URL the catalog signed (stores that cannot presign):
        key-less, but bound by its signature to the tenant it was signed for, who must still be
        allowed to read the checkpoint (its own, or published), and expiring."""
        if self.blobs is None:
            raise NotFound(_NO_STORE)
        signed = self.blobs.verify(
            request.match_info["path"],
            expires=request.query.get("expires", ""),
            signature=request.query.get("signature", ""),
            tenant=request.query.get("tenant", ""),
        )
        await self.gateway.check_download(signed.tenant, signed.key)
        store_path = signed.store_path
        blobs = self.blobs
        if blobs.local:
            if not await asyncio.to_thread(blobs.fs.isfile, store_path):
                raise NotFound("the file is no longer in storage")
            return web.FileResponse(store_path)
        try:
            data = await asyncio.to_thread(lambda: b"".join(blobs.read_chunks(store_path)))
        except FileNotFoundError:
            raise NotFound("the file is no longer in storage") from None
        return web.Response(body=data, content_type="application/octet-stream")

    async def archive(self, request: web.Request) -> web.StreamResponse:
        """A checkpoint as one tar archive (archives.py), for a URL the catalog signed
        (``archive_url``): key-less like ``download`` and checked the same way, from any store
        (even one that presigns its own URLs: an archive is no object in it), streamed as it is
        read."""
        if self.blobs is None:
            raise NotFound(_NO_STORE)
        signed = self.blobs.verify_archive(
            request.match_info["path"],
            expires=request.query.get("expires", ""),
            signature=request.query.get("signature", ""),
            tenant=request.query.get("tenant", ""),
        )
        tinker_path = await self.gateway.check_download(signed.tenant, signed.key)
        archive = await archives.Archive.of(self.blobs, signed.key)
        name = tinker_path.removeprefix(artifacts.SCHEME).replace("/", "_")
        response = web.StreamResponse(
            headers={
                "Content-Type": archives.MEDIA_TYPE,
                "Content-Disposition": f'attachment; filename="{name}.tar"',
            }
        )
        response.content_length = archive.size
        await response.prepare(request)
        if request.method == "HEAD":  # its headers alone (aiohttp would send what is written)
            await response.write_eof()
            return response
        try:
            async for chunk in archive.chunks():
                await response.write(chunk)
        except (archives.ArchiveCutOff, ConnectionError) as cut:
            # The answer has begun, so no error can be answered: the connection ends short of
            # its Content-Length, which the client sees as an incomplete download.
            log.warning("the archive of %s was cut off: %s", tinker_path, cut)
            if request.transport is not None:
                request.transport.close()
            return response
        await response.write_eof()
        return response


def download_base(config: GatewayConfig, host_header: str) -> str:
    """The gateway's URL for the download URLs it signs: TINSMITH_PUBLIC_URL, else the address
    it listens on, else (it listens on every interface) the request's Host header if that is a
    well-formed host and port; never anything else a client sent."""
    if config.public_url:
        return config.public_url
    host = config.host
    if host not in _EVERY_INTERFACE:
        return f"http://{f'[{host}]' if ':' in host else host}:{config.port}"
    if not _HOST.fullmatch(host_header):
        raise InvalidRequest(
            f"the Host header {host_header[:100]!r} is not a host[:port] this gateway will put "
            "into download URLs; the operator can set TINSMITH_PUBLIC_URL"
        )
    return f"http://{host_header}"


def _path(request: web.Request) -> str:
    """The tinker:// path of the checkpoint a route names (validated: a bad name is a 400 and
    never reaches storage)."""
    info = request.match_info
    checkpoint = artifacts.checkpoint(info["run"], f"{info['segment']}/{info['name']}")
    return str(checkpoint)


def _project(value: str) -> str:
    """A project id: 1-200 printable characters."""
    if not 1 <= len(value) <= 200 or not value.isprintable():
        raise InvalidRequest(f"a project id is 1-200 printable characters, got {value!r:.80}")
    return value


def _instant(request: web.Request, name: str) -> float:
    """A query parameter that is an RFC 3339 time with its offset, as seconds since the epoch."""
    raw = request.query.get(name, "")
    try:
        when = datetime.fromisoformat(raw)
    except ValueError:
        when = None
    if when is None or when.tzinfo is None:
        raise InvalidRequest(
            f"{name} must be an RFC 3339 time with its UTC offset, e.g. 2026-07-13T00:00:00Z; "
            f"got {raw[:60]!r}"
        )
    return when.timestamp()


def _run(request: web.Request) -> str:
    return subjects.check_id("training run id", request.match_info["run"])


def _int(request: web.Request, name: str, default: int) -> int:
    raw = request.query.get(name)
    if raw is None or raw == "":
        return default
    try:
        value = int(raw)
    except ValueError:
        raise InvalidRequest(f"{name} must be an integer, got {raw[:40]!r}") from None
    if not 0 <= value <= INT32_MAX:
        raise InvalidRequest(f"{name} must be between 0 and {INT32_MAX}, got {raw[:40]}")
    return value


class BodyTooLarge(TooLarge):
    """A body over ``MAX_BODY_BYTES``, with its first bytes: enough to find the run and seq_id
    it was meant for, so that its refusal spends that seq_id like any other refusal."""

    def __init__(self, request: web.Request, prefix: bytes) -> None:
        super().__init__(
            f"{request.method} {request.path}: the body is larger than the {MAX_BODY_BYTES} "
            "bytes a request may carry (each request travels as one message on the bus): send "
            "less in one call (the SDK cuts forward_backward batches into chunks by itself)"
        )
        self.prefix = prefix


_PREFIX_BYTES = 64 * 1024


async def read_body(request: web.Request) -> bytes:
    """A request's body, or ``BodyTooLarge`` (413) once it passes ``MAX_BODY_BYTES``; the rest
    of such a body is never read into memory."""
    declared = request.content_length
    if declared is not None and declared > MAX_BODY_BYTES:
        prefix = await request.content.read(_PREFIX_BYTES)
        raise BodyTooLarge(request, prefix)
    chunks: list[bytes] = []
    size = 0
    async for chunk in request.content.iter_chunked(_PREFIX_BYTES):
        size += len(chunk)
        if size > MAX_BODY_BYTES:
            raise BodyTooLarge(request, b"".join(chunks)[:_PREFIX_BYTES])
        chunks.append(chunk)
    return b"".join(chunks)


async def read_json(request: web.Request) -> dict[str, Any]:
    """A request's JSON object body ({} when empty), or a 400 that says what is wrong: not
    JSON, not an object, or nested too deep. ``NaN`` and ``Infinity`` become ``wire.NonFinite``,
    which every field that reads a number refuses by name."""
    raw = await read_body(request)
    if not raw:
        return {}
    try:
        body = json.loads(raw, parse_constant=wire.NonFinite)
    except ValueError as exc:
        raise InvalidRequest(f"the body is not valid JSON: {str(exc)[:200]}") from exc
    except RecursionError:
        raise InvalidRequest("the body is JSON nested too deep") from None
    if not isinstance(body, dict):
        raise InvalidRequest("the body must be a JSON object")
    return body
