"""Tracing and metrics across the services, with each service in its own process (``tinsmith up``)
exporting OTLP to a receiver on loopback: one SDK call is one trace, parented from the gateway's
server span through NATS down to the trainer's compute; a client's own trace context is honoured
on both faces; every service serves its Prometheus metrics."""

from __future__ import annotations

import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
import tinker
from tinker import types

from bench.otlp import OtlpReceiver, Span, describe
from tests.conftest import RunningSystem, start_system, stop_system
from tinsmith._proto import service_pb2 as svc
from tinsmith._proto import service_pb2_grpc as stubs

BASE = "tinsmith/tiny"
TOKENS = [5, 17, 99, 3, 250, 42, 7]
# A client's own trace: W3C trace context, as an instrumented client sends it.
CLIENT_TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"
CLIENT_SPAN = "00f067aa0ba902b7"
TRACEPARENT = f"00-{CLIENT_TRACE}-{CLIENT_SPAN}-01"


@pytest.fixture(scope="module")
def receiver() -> Iterator[OtlpReceiver]:
    with OtlpReceiver() as running:
        yield running


@pytest.fixture(scope="module")
def traced_system(
    receiver: OtlpReceiver, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[RunningSystem]:
    env = {
        "OTEL_EXPORTER_OTLP_ENDPOINT": receiver.endpoint,
        "OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf",
        "OTEL_BSP_SCHEDULE_DELAY": "100",
        "OTEL_METRICS_EXPORTER": "none",
        "TINSMITH_BASE_MODELS": BASE,
    }
    running = start_system(tmp_path_factory.mktemp("traced"), env=env)
    yield running
    stop_system(running)


@pytest.fixture(scope="module")
def training(traced_system: RunningSystem) -> Iterator[tinker.TrainingClient]:
    service = tinker.ServiceClient(base_url=traced_system.url, api_key="tml-tracing")
    yield service.create_lora_training_client(base_model=BASE, rank=4).result()
    service.close("success").result(timeout=60)  # its session's heartbeat ends with it


def _datum() -> types.Datum:
    return types.Datum(
        model_input=types.ModelInput.from_ints(TOKENS[:-1]),
        loss_fn_inputs={"target_tokens": TOKENS[1:], "weights": [1.0] * (len(TOKENS) - 1)},
    )


def _trace_of(spans: list[Span], name: str) -> list[Span]:
    roots = [s for s in spans if s.name == name]
    assert roots, f"no span named {name!r}:\n{describe(spans)}"
    return [s for s in spans if s.trace_id == roots[-1].trace_id]


def _parent(trace: list[Span], span: Span) -> Span:
    found = [s for s in trace if s.span_id == span.parent_span_id]
    assert len(found) == 1, f"{span.name} has no parent in its trace:\n{describe(trace)}"
    return found[0]


def _one(trace: list[Span], service: str, name: str, **attributes: object) -> Span:
    found = [
        s
        for s in trace
        if s.service == f"tinsmith-{service}"
        and s.name == name
        and all(s.attributes.get(k) == v for k, v in attributes.items())
    ]
    assert len(found) == 1, f"{service} {name} {attributes}:\n{describe(trace)}"
    return found[0]


def test_forward_backward_is_one_trace_from_gateway_to_compute(
    receiver: OtlpReceiver, training: tinker.TrainingClient
) -> None:
    receiver.clear()
    training.forward_backward([_datum()], "cross_entropy").result()
    gateway_call = "POST /api/v1/forward_backward"

    def complete(spans: list[Span]) -> bool:
        names = {s.name for s in spans}
        computed = any(s.attributes.get("tinsmith.op") == "forward_backward" for s in spans)
        return gateway_call in names and computed and "trainer forward_backward" in names

    trace = _trace_of(receiver.wait_for(complete, 30.0), gateway_call)

    # One root, the gateway's server span; every other span's parent is in the same trace.
    roots = [s for s in trace if not s.parent_span_id]
    assert [(s.service, s.name, s.kind) for s in roots] == [
        ("tinsmith-gateway", gateway_call, "SERVER")
    ], describe(trace)
    for span in trace:
        if span.parent_span_id:
            _parent(trace, span)
    assert {s.service for s in trace} >= {"tinsmith-gateway", "tinsmith-trainer"}

    # The chain, hop by hop: gateway call -> publish -> trainer receive -> its work -> compute.
    compute = _one(trace, "trainer", "compute", **{"tinsmith.op": "forward_backward"})
    work = _parent(trace, compute)
    assert (work.service, work.name) == ("tinsmith-trainer", "trainer forward_backward")
    receive = _parent(trace, work)
    assert (receive.name, receive.kind) == ("receive tinsmith.events.run.*", "CONSUMER")
    publish = _parent(trace, receive)
    assert (publish.service, publish.name, publish.kind) == (
        "tinsmith-gateway",
        "publish tinsmith.events.run.*",
        "PRODUCER",
    )
    assert _parent(trace, publish) == roots[0]
    wait = _one(trace, "trainer", "queue_wait")
    assert _parent(trace, wait) == receive
    assert wait.end_ns <= compute.start_ns

    # The compute span says what ran, where and how big.
    model_id = compute.attributes["tinsmith.model_id"]
    assert compute.attributes["tinsmith.base_model"] == BASE
    assert compute.attributes["tinsmith.adapter"] == model_id
    assert compute.attributes["tinsmith.tokens"] == len(TOKENS) - 1
    assert compute.attributes["tinsmith.batch_size"] == 1
    assert compute.attributes["tinsmith.device"] == "cpu"
    assert work.attributes["tinsmith.request_id"] == roots[0].attributes["tinsmith.request_id"]
    # The outcome's result and completion are published from within the work.
    producers = [s for s in trace if s.kind == "PRODUCER" and s.service == "tinsmith-trainer"]
    assert all(_parent(trace, s) == work for s in producers)
    published = {s.name for s in producers}
    assert published == {"publish tinsmith.results.*", "publish tinsmith.events.run.*"}


def test_sampling_traces_adapter_io_batch_formation_and_compute(
    receiver: OtlpReceiver, training: tinker.TrainingClient
) -> None:
    sampler = training.save_weights_and_get_sampling_client().result()
    receiver.clear()
    prompt = types.ModelInput.from_ints(TOKENS[:3])
    sampler.sample(prompt, 2, types.SamplingParams(max_tokens=4, temperature=1.0)).result()

    def sampled(spans: list[Span]) -> bool:
        return {"sampler sample", "POST /api/v1/asample"} <= {s.name for s in spans}

    trace = _trace_of(receiver.wait_for(sampled, 30.0), "POST /api/v1/asample")
    work = _one(trace, "sampler", "sampler sample")
    receive = _one(trace, "sampler", "receive tinsmith.events.sampler.*")
    assert _parent(trace, _one(trace, "sampler", "queue_wait")) == _parent(trace, work) == receive
    load = _one(trace, "sampler", "compute", **{"tinsmith.op": "load_adapter"})
    fetch = _one(trace, "sampler", "blob.get")
    assert _parent(trace, load) == _parent(trace, fetch) == work
    assert fetch.attributes["tinsmith.blob.bytes"] > 0
    formation = _one(trace, "sampler", "batch_formation")
    compute = _one(trace, "sampler", "compute", **{"tinsmith.op": "sample"})
    assert _parent(trace, formation) == _parent(trace, compute) == work
    assert compute.start_ns == formation.start_ns <= formation.end_ns <= compute.end_ns
    assert compute.attributes["tinsmith.tokens.prompt"] == 3
    assert 2 <= compute.attributes["tinsmith.tokens.generated"] <= 8
    assert compute.attributes["tinsmith.batch_sequences"] >= 2
    assert compute.attributes["tinsmith.steps"] >= 1
    assert compute.attributes["tinsmith.adapter"] == fetch.attributes["tinsmith.blob.key"]
    assert compute.attributes["tinsmith.model_id"] == training.model_id
    assert compute.attributes["tinsmith.base_model"] == BASE
    assert compute.attributes["tinsmith.device"] == "cpu"


def test_a_clients_trace_context_is_the_parent_on_both_faces(
    receiver: OtlpReceiver, traced_system: RunningSystem
) -> None:
    receiver.clear()
    request = urllib.request.Request(
        traced_system.url + "/api/v1/get_server_capabilities",
        headers={"traceparent": TRACEPARENT, "X-API-Key": "tml-tracing"},
    )
    with urllib.request.urlopen(request, timeout=10) as response:
        assert response.status == 200
    with grpc.insecure_channel(traced_system.grpc_target) as channel:
        catalog = stubs.CatalogStub(channel)
        with pytest.raises(grpc.RpcError) as missing:
            catalog.GetSession(
                svc.GetSessionRequest(session_id="no-such-session"),
                metadata=[("traceparent", TRACEPARENT), ("x-api-key", "tml-tracing")],
                timeout=10,
            )
        assert missing.value.code() == grpc.StatusCode.NOT_FOUND

    names = ("GET /api/v1/get_server_capabilities", "/tinsmith.v1.Catalog/GetSession")

    def served(spans: list[Span]) -> dict[str, Span]:
        return {s.name: s for s in spans if s.trace_id == CLIENT_TRACE and s.name in names}

    found = served(receiver.wait_for(lambda spans: len(served(spans)) == len(names), 30.0))
    http, call = (found[name] for name in names)
    assert http.kind == call.kind == "SERVER"
    assert http.parent_span_id == call.parent_span_id == CLIENT_SPAN
    assert http.attributes["http.response.status_code"] == 200
    assert (call.status, call.attributes["rpc.grpc.status_code"]) == ("ERROR", 5)


def _scrape(url: str) -> dict[str, float]:
    """Prometheus text -> {'name{labels}': value}."""
    with urllib.request.urlopen(url, timeout=10) as response:
        text = response.read().decode()
    samples = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            samples[name] = float(value)
    return samples


def _total(samples: dict[str, float], name: str, *labels: str) -> float:
    return sum(
        v
        for k, v in samples.items()
        if k.split("{")[0] == name and all(label in k for label in labels)
    )


def test_every_service_serves_prometheus_metrics(
    traced_system: RunningSystem, training: tinker.TrainingClient
) -> None:
    training.forward_backward([_datum()], "cross_entropy").result()
    assert set(traced_system.metrics) == {"gateway", "trainer", "sampler", "checkpoint"}
    scraped = {name: _scrape(url) for name, url in traced_system.metrics.items()}
    for samples in scraped.values():
        assert _total(samples, "process_memory_usage_bytes") > 10 << 20

    gateway = scraped["gateway"]
    call = 'tinsmith_operation="POST /api/v1/forward_backward"'
    assert _total(gateway, "tinsmith_request_duration_seconds_count", call) >= 1
    assert _total(gateway, "tinsmith_queue_depth", 'tinsmith_queue="trainer"') == 0

    trainer = scraped["trainer"]
    # A request's work duration is recorded once its outcome is in the log, which the client
    # may have read first: the count catches up within moments.
    done = (
        "tinsmith_work_duration_seconds_count",
        'tinsmith_op="forward_backward"',
        'outcome="ok"',
    )
    deadline = time.monotonic() + 10
    while _total(trainer, *done) < 2 and time.monotonic() < deadline:
        time.sleep(0.1)
        trainer = _scrape(traced_system.metrics["trainer"])
    assert _total(trainer, "tinsmith_compute_busy_seconds_total") > 0
    trained = 'tinsmith_tokens="trained"'
    assert _total(trainer, "tinsmith_tokens_total", trained) >= 2 * (len(TOKENS) - 1)
    op = 'tinsmith_op="forward_backward"'
    assert _total(trainer, "tinsmith_queue_wait_seconds_count", op) >= 2
    assert _total(trainer, *done) >= 2
    assert _total(trainer, "tinsmith_base_models_loaded") == 1
    assert _total(trainer, "tinsmith_adapters_loaded", 'tinsmith_base_model="tinsmith/tiny"') >= 1

    sampler = scraped["sampler"]
    assert _total(sampler, "tinsmith_tokens_total", 'tinsmith_tokens="generated"') >= 2
    assert _total(sampler, "tinsmith_compute_busy_seconds_total") > 0


def test_service_logs_are_json_lines_with_request_and_trace_ids(
    traced_system: RunningSystem,
) -> None:
    import json

    records = [
        json.loads(line)
        for line in (Path(traced_system.data_dir) / "logs" / "trainer.log").read_text().splitlines()
        if line.startswith("{")
    ]
    assert records, "the trainer wrote no JSON log lines"
    assert all({"time", "level", "logger", "message", "service"} <= set(r) for r in records)
    assert {r["service"] for r in records} == {"trainer"}
