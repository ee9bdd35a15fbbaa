"""A loopback OTLP/HTTP receiver that keeps every span it is sent, for tests and benchmarks.

Owns: an aiohttp server on 127.0.0.1 (a free port) that answers the OTLP/HTTP protobuf exports
(``POST /v1/traces``, ``/v1/metrics`` and ``/v1/logs``; gzip and deflate bodies too)
as a collector would, and the decoding of each exported span into a plain, frozen ``Span``.

    with OtlpReceiver() as receiver:  # serves from a thread with its own event loop
        env = {"OTEL_EXPORTER_OTLP_ENDPOINT": receiver.endpoint}
        ...
        spans = receiver.wait_for(lambda spans: any(s.name == "compute" for s in spans), 10.0)

    async with OtlpReceiver() as receiver:  # serves on the running event loop
        ...

Metrics and logs are answered and kept as their decoded export requests, nothing more. Does not
own: what the services export (tinsmith/telemetry.py) or what the spans mean.
"""

from __future__ import annotations

import asyncio
import socket
import threading
import time
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any

from aiohttp import web
from google.protobuf.message import DecodeError, Message
from opentelemetry.proto.collector.logs.v1 import logs_service_pb2
from opentelemetry.proto.collector.metrics.v1 import metrics_service_pb2
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2
from opentelemetry.proto.common.v1 import common_pb2
from opentelemetry.proto.trace.v1 import trace_pb2

PROTOBUF = "application/x-protobuf"
MAX_BODY_BYTES = 64 * 1024 * 1024  # aiohttp's default (1 MiB) is less than a full span batch
SERVICE_NAME = "service.name"
_POLL_S = 0.05


@dataclass(frozen=True)
class Span:
    """One finished span as exported. Ids are lowercase hex; times are unix-epoch nanoseconds."""

    trace_id: str
    span_id: str
    parent_span_id: str  # "" for a root span
    name: str
    kind: str  # an opentelemetry.trace.SpanKind name: "INTERNAL", "SERVER", "CLIENT", ...
    start_ns: int
    end_ns: int
    service: str  # the resource's service.name
    attributes: Mapping[str, Any] = field(default_factory=dict)
    links: tuple[tuple[str, str], ...] = ()  # (trace_id, span_id) of each link
    status: str = "UNSET"  # an opentelemetry.trace.StatusCode name: "UNSET", "OK" or "ERROR"
    status_message: str = ""
    events: tuple[str, ...] = ()  # the names of the span's events, "exception" among them

    @property
    def duration_ns(self) -> int:
        return self.end_ns - self.start_ns


# --- decoding -----------------------------------------------------------------------------------


def _value(any_value: common_pb2.AnyValue) -> Any:
    """An OTLP AnyValue as the plain Python value it carries (None when it is empty)."""
    kind = any_value.WhichOneof("value")
    if kind is None:
        return None
    if kind == "array_value":
        return [_value(v) for v in any_value.array_value.values]
    if kind == "kvlist_value":
        return _attributes(any_value.kvlist_value.values)
    return getattr(any_value, kind)


def _attributes(pairs: Sequence[common_pb2.KeyValue]) -> dict[str, Any]:
    return {pair.key: _value(pair.value) for pair in pairs}


def _kind_name(kind: trace_pb2.Span.SpanKind.ValueType) -> str:
    # SPAN_KIND_SERVER -> SERVER, the name opentelemetry.trace.SpanKind gives it
    return trace_pb2.Span.SpanKind.Name(kind).removeprefix("SPAN_KIND_")


def _status_name(code: trace_pb2.Status.StatusCode.ValueType) -> str:
    return trace_pb2.Status.StatusCode.Name(code).removeprefix("STATUS_CODE_")


def decode_spans(request: trace_service_pb2.ExportTraceServiceRequest) -> list[Span]:
    """Every span of one export request, each with its resource's service name."""
    spans = []
    for resource_spans in request.resource_spans:
        service = str(_attributes(resource_spans.resource.attributes).get(SERVICE_NAME, ""))
        for scope_spans in resource_spans.scope_spans:
            for span in scope_spans.spans:
                spans.append(
                    Span(
                        trace_id=span.trace_id.hex(),
                        span_id=span.span_id.hex(),
                        parent_span_id=span.parent_span_id.hex(),
                        name=span.name,
                        kind=_kind_name(span.kind),
                        start_ns=span.start_time_unix_nano,
                        end_ns=span.end_time_unix_nano,
                        service=service,
                        attributes=_attributes(span.attributes),
                        links=tuple((ln.trace_id.hex(), ln.span_id.hex()) for ln in span.links),
                        status=_status_name(span.status.code),
                        status_message=span.status.message,
                        events=tuple(event.name for event in span.events),
                    )
                )
    return spans


async def _parse(request: web.Request, message: Message) -> None:
    """Fill ``message`` from the request's protobuf body, or answer 4xx. aiohttp has already
    undone a gzip or deflate Content-Encoding (and answers 400 when that fails)."""
    if request.content_type != PROTOBUF:
        raise web.HTTPUnsupportedMediaType(
            text=f"only {PROTOBUF} is accepted, not {request.content_type!r}"
        )
    body = await request.read()
    try:
        message.ParseFromString(body)
    except DecodeError as error:
        raise web.HTTPBadRequest(text=f"undecodable OTLP body: {error}") from error


def _answer(response: Message) -> web.Response:
    return web.Response(body=response.SerializeToString(), content_type=PROTOBUF)


# --- the receiver -------------------------------------------------------------------------------


class OtlpReceiver:
    """Receives OTLP/HTTP exports on ``endpoint`` and keeps them; see the module docstring."""

    def __init__(self, host: str = "127.0.0.1") -> None:
        self.host = host
        self.port = 0
        self._lock = threading.Lock()
        self._spans: list[Span] = []
        self._metrics: list[metrics_service_pb2.ExportMetricsServiceRequest] = []
        self._logs: list[logs_service_pb2.ExportLogsServiceRequest] = []
        self._runner: web.AppRunner | None = None
        self._loop: asyncio.AbstractEventLoop | None = None  # only when serving from a thread
        self._thread: threading.Thread | None = None

    @property
    def endpoint(self) -> str:
        """The base URL, as OTEL_EXPORTER_OTLP_ENDPOINT wants it (exporters add /v1/traces)."""
        if not self.port:
            raise RuntimeError("the receiver is not started")
        return f"http://{self.host}:{self.port}"

    # --- what it received

    def spans(self) -> list[Span]:
        """A snapshot of the spans received so far, in arrival order."""
        with self._lock:
            return list(self._spans)

    def metrics_requests(self) -> list[metrics_service_pb2.ExportMetricsServiceRequest]:
        with self._lock:
            return list(self._metrics)

    def logs_requests(self) -> list[logs_service_pb2.ExportLogsServiceRequest]:
        with self._lock:
            return list(self._logs)

    def clear(self) -> None:
        with self._lock:
            self._spans.clear()
            self._metrics.clear()
            self._logs.clear()

    def wait_for(self, predicate: Callable[[list[Span]], bool], timeout: float) -> list[Span]:
        """Poll until ``predicate(spans)`` holds and return those spans; TimeoutError if not."""
        deadline = time.monotonic() + timeout
        while True:
            spans = self.spans()
            if predicate(spans):
                return spans
            if time.monotonic() >= deadline:
                raise TimeoutError(
                    f"the spans did not satisfy the predicate within {timeout:g} s; "
                    f"received {len(spans)}: {describe(spans)}"
                )
            time.sleep(_POLL_S)

    # --- the HTTP side

    async def _traces(self, request: web.Request) -> web.Response:
        message = trace_service_pb2.ExportTraceServiceRequest()
        await _parse(request, message)
        spans = decode_spans(message)
        with self._lock:
            self._spans.extend(spans)
        return _answer(trace_service_pb2.ExportTraceServiceResponse())

    async def _metrics_export(self, request: web.Request) -> web.Response:
        message = metrics_service_pb2.ExportMetricsServiceRequest()
        await _parse(request, message)
        with self._lock:
            self._metrics.append(message)
        return _answer(metrics_service_pb2.ExportMetricsServiceResponse())

    async def _logs_export(self, request: web.Request) -> web.Response:
        message = logs_service_pb2.ExportLogsServiceRequest()
        await _parse(request, message)
        with self._lock:
            self._logs.append(message)
        return _answer(logs_service_pb2.ExportLogsServiceResponse())

    async def _serve(self) -> None:
        app = web.Application(client_max_size=MAX_BODY_BYTES)
        app.router.add_post("/v1/traces", self._traces)
        app.router.add_post("/v1/metrics", self._metrics_export)
        app.router.add_post("/v1/logs", self._logs_export)
        # Binding the socket here gives the free port before anyone can take it.
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((self.host, 0))
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        await web.SockSite(self._runner, sock).start()
        self.port = sock.getsockname()[1]

    async def _shutdown(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    # --- on a thread of its own, for synchronous callers

    def start(self) -> OtlpReceiver:
        """Serve from a daemon thread running its own event loop; returns once it listens."""
        if self._thread is not None:
            raise RuntimeError("the receiver is already started")
        loop = asyncio.new_event_loop()
        started = asyncio.run_coroutine_threadsafe(self._serve(), loop)
        self._thread = threading.Thread(target=loop.run_forever, name="otlp-receiver", daemon=True)
        self._loop = loop
        self._thread.start()
        started.result(timeout=10)
        return self

    def stop(self) -> None:
        loop, thread = self._loop, self._thread
        if loop is None or thread is None:
            return
        asyncio.run_coroutine_threadsafe(self._shutdown(), loop).result(timeout=10)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(timeout=10)
        loop.close()
        self._loop = self._thread = None

    def __enter__(self) -> OtlpReceiver:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    # --- on the running event loop, for asynchronous callers

    async def __aenter__(self) -> OtlpReceiver:
        await self._serve()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self._shutdown()


def describe(spans: Sequence[Span], limit: int = 20) -> str:
    """A short summary for messages: how many spans of each (service, name)."""
    counts = Counter((s.service, s.name) for s in spans)
    parts = [f"{service or '?'}/{name} x{n}" for (service, name), n in counts.most_common(limit)]
    more = len(counts) - limit
    return ", ".join(parts) + (f", and {more} more kinds" if more > 0 else "") or "nothing"
