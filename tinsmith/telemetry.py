"""OpenTelemetry for a tinsmith process: traces, metrics, and trace ids in the log records.

Configuration is the standard ``OTEL_*`` environment, read by the OpenTelemetry SDK itself:

- **Traces** are exported when ``OTEL_TRACES_EXPORTER`` names an exporter (``otlp``, ``console``)
  or an OTLP endpoint is set (``OTEL_EXPORTER_OTLP_ENDPOINT`` or ``..._TRACES_ENDPOINT``). The
  protocol is ``OTEL_EXPORTER_OTLP_[TRACES_]PROTOCOL``: ``http/protobuf`` (the default) or
  ``grpc``. Batching (``OTEL_BSP_*``), sampling (``OTEL_TRACES_SAMPLER``), headers, timeouts and
  ``OTEL_RESOURCE_ATTRIBUTES`` / ``OTEL_SERVICE_NAME`` apply as documented by OpenTelemetry.
  Unconfigured, tracing is the API's no-op: spans cost a function call and nothing is sent.
- **Metrics** are always kept, for the Prometheus scrape endpoint (``/metrics`` on the health
  port), and are also pushed over OTLP when ``OTEL_METRICS_EXPORTER=otlp`` or an OTLP endpoint is
  set (``OTEL_METRICS_EXPORTER=none`` turns the push off).
- ``OTEL_SDK_DISABLED=true`` turns all of it off.

Owns: the providers and exporters, the tracer and the instruments every service shares, carrying
trace context across NATS (``inject`` / ``extract``, used by tinsmith/bus.py only), the request id
of the work in hand, and the log format (JSON lines by default, ``TINSMITH_LOG_FORMAT=text`` for
people). Does not own: where spans start (the services and the bus decide that).
"""

from __future__ import annotations

import contextlib
import contextvars
import json
import logging
import os
import threading
import time
from collections.abc import Callable, Iterator, Mapping, MutableMapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from opentelemetry import metrics, propagate, trace
from opentelemetry.context import Context
from opentelemetry.metrics import CallbackOptions, Observation
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import MetricReader, PeriodicExportingMetricReader
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, ConsoleSpanExporter, SpanExporter
from opentelemetry.trace import Span, SpanKind, Status, StatusCode

log = logging.getLogger(__name__)

Attributes = Mapping[str, str | int | float | bool]

tracer = trace.get_tracer("tinsmith")
meter = metrics.get_meter("tinsmith")

# -- the instruments every service shares ---------------------------------------------------------
# Created on the API's proxy meter: they start recording once ``setup`` installs the provider.

REQUEST_DURATION = meter.create_histogram(
    "tinsmith.request.duration",
    unit="s",
    description="Time the gateway took to answer a call, by face (http, grpc), operation and "
    "status; its count is the request rate",
)
QUEUE_WAIT = meter.create_histogram(
    "tinsmith.queue.wait",
    unit="s",
    description="Time from a request's acceptance into the log to the start of its work",
)
WORK_DURATION = meter.create_histogram(
    "tinsmith.work.duration",
    unit="s",
    description="Time from the start of a request's work to its recorded outcome, by operation",
)
TOKENS = meter.create_counter(
    "tinsmith.tokens",
    unit="{token}",
    description="Tokens processed: trained (forward and forward_backward inputs), prompt "
    "(sampler prefill) and generated (sampled)",
)


class _BusyClock:
    """The seconds compute threads have worked, counted live: the work done, plus the work under
    way so far (a scrape in the middle of a long piece of work sees it; counted only at its end,
    a multi-second pass would land in one lump, in whichever interval it happened to end)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()  # the compute threads and the scraping thread
        self._done = 0.0
        self._running: dict[int, float] = {}  # thread ident -> when its work started

    @contextlib.contextmanager
    def working(self) -> Iterator[None]:
        thread = threading.get_ident()
        with self._lock:
            self._running[thread] = time.perf_counter()
        try:
            yield
        finally:
            with self._lock:
                self._done += time.perf_counter() - self._running.pop(thread)

    def seconds(self) -> float:
        now = time.perf_counter()
        with self._lock:
            return self._done + sum(now - started for started in self._running.values())

    def observe(self, _: CallbackOptions) -> list[Observation]:
        return [Observation(self.seconds())]


BUSY = _BusyClock()
meter.create_observable_counter(
    "tinsmith.compute.busy",
    [BUSY.observe],
    unit="s",
    description="Time the compute thread spent working, counted live: its rate is the engine's "
    "duty cycle",
)


# -- set-up -----------------------------------------------------------------------------------


@dataclass
class _State:
    service: str = ""
    tracing: bool = False
    tracer_provider: TracerProvider | None = None
    meter_provider: MeterProvider | None = None
    readers: list[MetricReader] = field(default_factory=list)


_state = _State()


def _env(name: str) -> str:
    return os.environ.get(name, "").strip()


def disabled() -> bool:
    return _env("OTEL_SDK_DISABLED").lower() == "true"


def _exporter_names(kind: str) -> list[str]:
    """What ``OTEL_<KIND>_EXPORTER`` asks for; unset means OTLP when an endpoint is set."""
    names = [n.strip().lower() for n in _env(f"OTEL_{kind}_EXPORTER").split(",") if n.strip()]
    if names:
        return [n for n in names if n != "none"]
    endpoint = _env("OTEL_EXPORTER_OTLP_ENDPOINT") or _env(f"OTEL_EXPORTER_OTLP_{kind}_ENDPOINT")
    return ["otlp"] if endpoint else []


def _protocol(kind: str) -> str:
    protocol = _env(f"OTEL_EXPORTER_OTLP_{kind}_PROTOCOL") or _env("OTEL_EXPORTER_OTLP_PROTOCOL")
    protocol = protocol or "http/protobuf"
    if protocol not in ("http/protobuf", "grpc"):
        raise SystemExit(
            f"OTEL_EXPORTER_OTLP_PROTOCOL={protocol!r}: tinsmith exports OTLP over "
            "'http/protobuf' or 'grpc'"
        )
    return protocol


def _span_exporter(name: str) -> SpanExporter:
    if name == "console":
        return ConsoleSpanExporter()
    if name != "otlp":
        raise SystemExit(f"OTEL_TRACES_EXPORTER={name!r}: the exporters are 'otlp' and 'console'")
    if _protocol("TRACES") == "grpc":
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import (
            OTLPSpanExporter as GrpcSpanExporter,
        )

        return GrpcSpanExporter()
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

    return OTLPSpanExporter()


def _otlp_metric_reader() -> MetricReader:
    if _protocol("METRICS") == "grpc":
        from opentelemetry.exporter.otlp.proto.grpc.metric_exporter import (
            OTLPMetricExporter as GrpcMetricExporter,
        )

        return PeriodicExportingMetricReader(GrpcMetricExporter())
    from opentelemetry.exporter.otlp.proto.http.metric_exporter import OTLPMetricExporter

    return PeriodicExportingMetricReader(OTLPMetricExporter())


def setup(service: str, instance: str = "") -> None:
    """Install the providers for process ``service`` (gateway, trainer, sampler, checkpoint),
    once, before any work. ``instance`` tells replicas apart (``service.instance.id``)."""
    _state.service = service
    if disabled() or _state.meter_provider is not None:
        return
    attributes: dict[str, str] = {"service.namespace": "tinsmith"}
    if not _env("OTEL_SERVICE_NAME"):
        attributes["service.name"] = f"tinsmith-{service}"
    if instance:
        attributes["service.instance.id"] = instance
    resource = Resource.create(attributes)

    span_exporters = [_span_exporter(name) for name in _exporter_names("TRACES")]
    if span_exporters:
        provider = TracerProvider(resource=resource)
        for exporter in span_exporters:
            provider.add_span_processor(BatchSpanProcessor(exporter))
        trace.set_tracer_provider(provider)
        _state.tracer_provider, _state.tracing = provider, True

    from opentelemetry.exporter.prometheus import PrometheusMetricReader

    readers: list[MetricReader] = [PrometheusMetricReader()]
    metric_exporters = _exporter_names("METRICS")
    if "otlp" in metric_exporters:
        readers.append(_otlp_metric_reader())
    _state.meter_provider = MeterProvider(resource=resource, metric_readers=readers)
    metrics.set_meter_provider(_state.meter_provider)
    _observe_memory()
    log.info(
        "telemetry: traces %s, metrics on /metrics%s",
        "to " + ", ".join(_exporter_names("TRACES")) if span_exporters else "off",
        " and over OTLP" if "otlp" in metric_exporters else "",
    )


def tracing() -> bool:
    """Whether spans are recorded and exported in this process."""
    return _state.tracing


def shutdown() -> None:
    """Flush what is buffered (spans, the last metrics) before the process exits."""
    if _state.tracer_provider is not None:
        _state.tracer_provider.shutdown()
    if _state.meter_provider is not None:
        _state.meter_provider.shutdown()


def prometheus_text() -> tuple[bytes, str]:
    """The current metrics in the Prometheus text format, and its content type."""
    from prometheus_client import CONTENT_TYPE_LATEST, REGISTRY, generate_latest

    return generate_latest(REGISTRY), CONTENT_TYPE_LATEST


# -- metrics a service observes ----------------------------------------------------------------

Reading = Callable[[], float | Mapping[tuple[tuple[str, str], ...], float]]


# Every gauge a service observes, by name: what its status reports carry (``status``).
_READINGS: dict[str, Reading] = {}


def observe(name: str, reading: Reading, *, unit: str = "", description: str = "") -> None:
    """Report ``reading()`` as a gauge at each collection: one number, or numbers keyed by
    attribute pairs (``{(("base_model", "x"),): 3.0}``). It runs on the collecting thread, so it
    must only read plain Python state."""
    _READINGS[name] = reading

    def callback(_: CallbackOptions) -> list[Observation]:
        try:
            value = reading()
        except Exception:
            log.exception("gauge %s could not be read", name)
            return []
        if isinstance(value, Mapping):
            return [Observation(v, dict(attrs)) for attrs, v in value.items()]
        return [Observation(value)]

    meter.create_observable_gauge(name, [callback], unit=unit, description=description)


def status() -> dict[str, Any]:
    """What a service tells the operators' view every few seconds (tinsmith/runtime.py): its
    compute thread's busy seconds so far, and each gauge it observes (keyed ``name`` for one
    number, ``name`` then ``attr=value,...`` for numbers by attributes)."""
    gauges: dict[str, Any] = {}
    for name, reading in list(_READINGS.items()):
        try:
            value = reading()
        except Exception:
            continue  # logged where the gauge is collected
        if isinstance(value, Mapping):
            gauges[name] = {
                ",".join(f"{k}={v}" for k, v in attrs): float(number)
                for attrs, number in value.items()
            }
        else:
            gauges[name] = float(value)
    return {"busy_s": BUSY.seconds(), "gauges": gauges}


def observe_models(loaded: Callable[[], Mapping[str, int]]) -> None:
    """Gauges of what an engine holds: ``loaded()`` maps each loaded base model to how many
    adapters (LoRA runs or sampling adapters) are loaded on it."""
    observe(
        "tinsmith.base_models.loaded",
        lambda: float(len(loaded())),
        unit="{model}",
        description="Base models loaded in this process",
    )
    observe(
        "tinsmith.adapters.loaded",
        lambda: {(("tinsmith.base_model", name),): float(n) for name, n in loaded().items()},
        unit="{adapter}",
        description="LoRA adapters loaded in this process, by base model",
    )


def _observe_memory() -> None:
    page = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096

    def rss() -> float:
        try:
            with open("/proc/self/statm") as statm:
                return float(int(statm.read().split()[1]) * page)
        except OSError:
            import resource

            return float(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)

    observe(
        "process.memory.usage",
        rss,
        unit="By",
        description="Resident memory of the process (the peak where /proc is missing)",
    )


# -- trace context ------------------------------------------------------------------------------


def inject(carrier: MutableMapping[str, str]) -> None:
    """Write the current trace context into message headers (W3C ``traceparent``)."""
    propagate.inject(carrier)


def extract(carrier: Mapping[str, str] | None) -> Context:
    """The trace context that ``carrier`` (message or HTTP headers) brings, or an empty one."""
    return propagate.extract(carrier or {})


def annotate(attributes: Attributes) -> None:
    """Add ``attributes`` to the current span."""
    trace.get_current_span().set_attributes(attributes)


def record_error(span: Span, kind: str, detail: str) -> None:
    """Mark ``span`` failed, with the error tree's kind (tinsmith/failures.py)."""
    span.set_status(Status(StatusCode.ERROR, detail))
    span.set_attribute("error.type", kind)


def finished_span(
    name: str,
    start_ns: int,
    end_ns: int,
    attributes: Attributes | None = None,
    parent: Context | None = None,
) -> None:
    """Record a span whose start and end are already known (a wait measured afterwards)."""
    span = tracer.start_span(name, context=parent, attributes=attributes, start_time=start_ns)
    span.end(end_time=max(start_ns, end_ns))


def queue_wait(op: str, published_ns: int, parent: Context | None = None) -> None:
    """Record a request's wait from its acceptance into the log until now, as a span under
    ``parent`` and in the ``tinsmith.queue.wait`` histogram."""
    now = time.time_ns()
    start = min(published_ns or now, now)
    finished_span("queue_wait", start, now, {"tinsmith.op": op}, parent)
    QUEUE_WAIT.record((now - start) / 1e9, {"tinsmith.service": _state.service, "tinsmith.op": op})


def work_done(op: str, seconds: float, failure_kind: str = "") -> None:
    """Record a request's work in ``tinsmith.work.duration``; a failure marks the current span."""
    outcome = failure_kind or "ok"
    WORK_DURATION.record(
        seconds, {"tinsmith.service": _state.service, "tinsmith.op": op, "outcome": outcome}
    )


@dataclass
class Call:
    """One call the gateway serves: its span, and the status its face sets for the metrics."""

    span: Span
    status: str = "ok"


@contextlib.contextmanager
def serve_call(
    face: str, operation: str, carrier: Mapping[str, str], attributes: Attributes | None = None
) -> Iterator[Call]:
    """The server span of one call (its parent is whatever trace context the client sent), and
    its duration in ``tinsmith.request.duration``."""
    started = time.perf_counter()
    with tracer.start_as_current_span(
        operation, context=extract(carrier), kind=SpanKind.SERVER, attributes=attributes
    ) as span:
        call = Call(span)
        try:
            yield call
        finally:
            REQUEST_DURATION.record(
                time.perf_counter() - started,
                {"tinsmith.face": face, "tinsmith.operation": operation, "status": call.status},
            )


# -- the request in hand, for the logs ------------------------------------------------------------

_request_id: contextvars.ContextVar[str] = contextvars.ContextVar("tinsmith_request_id", default="")


@contextlib.contextmanager
def request_scope(request_id: str) -> Iterator[None]:
    """Log records written inside carry ``request_id``; so does the current span."""
    token = _request_id.set(request_id)
    trace.get_current_span().set_attribute("tinsmith.request_id", request_id)
    try:
        yield
    finally:
        _request_id.reset(token)


def current_ids() -> dict[str, str]:
    """The trace, span and request ids of the work in hand; empty strings where there are none."""
    context = trace.get_current_span().get_span_context()
    valid = context.is_valid
    return {
        "trace_id": format(context.trace_id, "032x") if valid else "",
        "span_id": format(context.span_id, "016x") if valid else "",
        "request_id": _request_id.get(),
    }


# -- logs ------------------------------------------------------------------------------------------

_STANDARD_RECORD_KEYS = frozenset(logging.makeLogRecord({}).__dict__) | {"message", "asctime"}


class JsonFormatter(logging.Formatter):
    """One JSON object per line: time, level, logger, message, service, the trace, span and
    request ids of the work in hand, any ``extra`` fields, and the exception if there is one."""

    def format(self, record: logging.LogRecord) -> str:
        entry: dict[str, Any] = {
            "time": datetime.fromtimestamp(record.created, UTC).isoformat(timespec="milliseconds"),
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
            "service": _state.service,
        }
        entry.update({k: v for k, v in current_ids().items() if v})
        for key, value in record.__dict__.items():
            if key not in _STANDARD_RECORD_KEYS and key not in entry:
                entry[key] = value if isinstance(value, str | int | float | bool) else repr(value)
        if record.exc_info:
            entry["exception"] = self.formatException(record.exc_info)
        return json.dumps(entry, ensure_ascii=False)


class TextFormatter(logging.Formatter):
    """For people: the usual line, with the request and trace ids when there are some."""

    def __init__(self) -> None:
        super().__init__("%(asctime)s %(levelname)s %(name)s: %(message)s")

    def format(self, record: logging.LogRecord) -> str:
        line = super().format(record)
        ids = current_ids()
        tags = [f"request={ids['request_id']}"] if ids["request_id"] else []
        tags += [f"trace={ids['trace_id']}"] if ids["trace_id"] else []
        return f"{line} [{' '.join(tags)}]" if tags else line


def configure_logging(service: str) -> None:
    """Log to stderr in ``TINSMITH_LOG_FORMAT`` (``json``, the default, or ``text``) at
    ``TINSMITH_LOG_LEVEL`` (INFO)."""
    _state.service = service
    kind = os.environ.get("TINSMITH_LOG_FORMAT", "json").strip().lower() or "json"
    if kind not in ("json", "text"):
        raise SystemExit(f"TINSMITH_LOG_FORMAT={kind!r}: use 'json' or 'text'")
    handler = logging.StreamHandler()
    handler.setFormatter(JsonFormatter() if kind == "json" else TextFormatter())
    logging.basicConfig(
        level=os.environ.get("TINSMITH_LOG_LEVEL", "INFO").upper(), handlers=[handler], force=True
    )
