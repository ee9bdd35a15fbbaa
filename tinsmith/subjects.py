"""Every NATS subject and JetStream stream name tinsmith uses, and the ids that go into them.

Owns: the names, and the validation of any id before it becomes a subject token. No other module
writes a subject string literal. Does not own: publishing or consuming (tinsmith/bus.py).
"""

from __future__ import annotations

import re

from tinsmith.failures import InvalidRequest

# The event log: every state change, on one subject per aggregate.
EVENTS_STREAM = "TINSMITH_EVENTS"
EVENTS_ALL = "tinsmith.events.>"
_EVENTS = "tinsmith.events"

# Results of requests (ForwardBackwardOutput, SampleResponse, small JSON), kept for a while.
RESULTS_STREAM = "TINSMITH_RESULTS"
RESULTS_ALL = "tinsmith.results.>"
_RESULTS = "tinsmith.results"

# Durable consumers of the event log that turn accepted requests into work.
TRAINER_CONSUMER = "trainer"  # the durable consumer trainers used before leases: removed
# JetStream KV buckets of the trainer fleet (tinsmith/leases.py): its live replicas, and which
# replica holds each run.
TRAINERS_BUCKET = "TINSMITH_TRAINERS"
RUN_OWNERS_BUCKET = "TINSMITH_RUN_OWNERS"
# The JetStream object store of the projections' snapshots (tinsmith/snapshots.py): each kind's
# state at a log position, from which a process replays only the log after it.
SNAPSHOTS_BUCKET = "TINSMITH_SNAPSHOTS"
SAMPLER_CONSUMER = "sampler"

# Cancelled sample requests: a RequestCancelled is an event of its sampler, on a subject one
# token below the sampler's (``event_subject``), so that every sampler replica can follow just
# the cancellations (an ordered consumer each) while its shared work queue takes the rest.
SAMPLES_CANCELLED = f"{_EVENTS}.sampler.*.cancelled"
_OWN_SUBJECT = {"request_cancelled": "cancelled"}

# Tokens of streamed sample requests as a sampler generates them (core NATS, not stored): one
# subject per gateway replica that relays them (``sample_stream_subject``).
_SAMPLE_STREAMS = "tinsmith.samples.stream"

# Liveness of sessions (core NATS, not stored): the gateway publishes a session id each time the
# SDK heart-beats; the trainer lets go of the runs of sessions that fall silent.
SESSION_HEARTBEATS = "tinsmith.heartbeats.session"

# Request-reply services.
# Every question and change the REST API asks of the checkpoint service's catalog, one subject
# each (``catalog_subject``): a bus.CatalogQuery in, a bus.CatalogReply out.
CATALOG_OPS = (
    "training_run",
    "training_runs",
    "checkpoints",
    "user_checkpoints",
    "weights_info",
    "sessions",
    "session",
    "delete_checkpoint",
    "publish_checkpoint",
    "set_checkpoint_ttl",
    "external_weights_urls",
    "checkpoint_archive_url",
    "storage_usage",
    "gc",
    "run_metrics",
    "run_requests",
    "report_metrics",
    "console_runs",
    "sweep",
    "trace_export",
    "copy_weights",
    "assign_session_project",
    "search_sessions",
    "audit_log",
    "billing_usage",
)

AGGREGATES = ("session", "run", "sampler", "key")

# Ids become subject tokens, so they exclude ".", "*", ">" and whitespace. The SDK builds run ids
# itself as "<session_id>:train:<n>", so ":" is allowed.
_ID = re.compile(r"[A-Za-z0-9_:\-]{1,200}")


def check_id(what: str, value: str) -> str:
    """Return ``value`` when it is safe as a subject token, else raise InvalidRequest."""
    if not isinstance(value, str) or not _ID.fullmatch(value):
        raise InvalidRequest(
            f"{what} {value!r:.220} is not a valid id: use 1-200 characters from A-Z, a-z, 0-9, "
            "'_', '-' and ':'"
        )
    return value


def event_subject(aggregate: str, aggregate_id: str, kind: str = "") -> str:
    """The subject of one aggregate's events, e.g. ``tinsmith.events.run.<model_id>``; an event
    ``kind`` that others follow alone goes one token below it
    (``tinsmith.events.sampler.<sampler_id>.cancelled``)."""
    if aggregate not in AGGREGATES:
        raise ValueError(f"unknown aggregate {aggregate!r}")
    subject = f"{_EVENTS}.{aggregate}.{check_id(aggregate + ' id', aggregate_id)}"
    own = _OWN_SUBJECT.get(kind)
    return f"{subject}.{own}" if own else subject


def template(subject: str) -> str:
    """``subject`` with its id token replaced by ``*``: a name of bounded cardinality for spans
    and metrics (``tinsmith.events.run.*``)."""
    tokens = subject.split(".")
    if subject.startswith(_EVENTS + ".") and len(tokens) > 3:
        return ".".join([*tokens[:3], "*", *tokens[4:]])
    if subject.startswith(_RESULTS + "."):
        return _RESULTS + ".*"
    if subject.startswith(_SAMPLE_STREAMS + "."):
        return _SAMPLE_STREAMS + ".*"
    return subject


def events_of(aggregate: str) -> str:
    """The wildcard over every event of one aggregate type, e.g. ``tinsmith.events.run.>``."""
    if aggregate not in AGGREGATES:
        raise ValueError(f"unknown aggregate {aggregate!r}")
    return f"{_EVENTS}.{aggregate}.>"


def result_subject(request_id: str) -> str:
    """Where the result of one request is stored in the results stream."""
    return f"{_RESULTS}.{check_id('request id', request_id)}"


def sample_stream_subject(gateway: str) -> str:
    """Where samplers publish the tokens of the streamed requests that gateway replica
    ``gateway`` relays (``bus.Sample.stream_to``)."""
    return f"{_SAMPLE_STREAMS}.{check_id('gateway id', gateway)}"


def catalog_subject(op: str) -> str:
    """The request-reply subject of one catalog operation, e.g. tinsmith.rpc.catalog.sessions."""
    if op not in CATALOG_OPS:
        raise ValueError(f"unknown catalog operation {op!r}")
    return f"tinsmith.rpc.catalog.{op}"


STATUS = "tinsmith.status"


def status_subject(service: str) -> str:
    """Where a service's replicas publish their status reports (core NATS); ``*`` for all."""
    return f"{STATUS}.{service}"


def ping_subject(service: str) -> str:
    """Each service answers on this subject once it is ready; the launcher waits for all four."""
    return f"tinsmith.ping.{check_id('service', service)}"
