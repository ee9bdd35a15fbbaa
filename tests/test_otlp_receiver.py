"""bench.otlp's receiver, fed by the real OpenTelemetry SDK's OTLP/HTTP exporter: what the SDK
records (parents, attributes, the resource's service name, links, status, events) comes back out
of the decoded spans, plain and compressed, from a thread of its own and on an event loop."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import pytest
from opentelemetry.exporter.otlp.proto.http import Compression
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SimpleSpanProcessor
from opentelemetry.trace import Link, SpanKind, StatusCode

from bench.otlp import OtlpReceiver, Span


@pytest.fixture
def receiver() -> Iterator[OtlpReceiver]:
    with OtlpReceiver() as running:
        yield running


def _provider(
    receiver: OtlpReceiver, service: str, compression: Compression = Compression.NoCompression
) -> TracerProvider:
    provider = TracerProvider(resource=Resource.create({"service.name": service}))
    exporter = OTLPSpanExporter(
        endpoint=receiver.endpoint + "/v1/traces", compression=compression, timeout=5
    )
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    return provider


def _by_name(spans: list[Span]) -> dict[str, Span]:
    return {span.name: span for span in spans}


def test_the_endpoint_is_a_loopback_url_with_a_port(receiver: OtlpReceiver) -> None:
    assert receiver.endpoint.startswith("http://127.0.0.1:")
    assert receiver.port > 0


def test_parents_attributes_service_kind_and_status_are_decoded(receiver: OtlpReceiver) -> None:
    provider = _provider(receiver, "tinsmith-test")
    tracer = provider.get_tracer("test")
    with tracer.start_as_current_span("parent", kind=SpanKind.SERVER) as parent:
        parent.set_attribute("tinsmith.op", "forward_backward")
        parent.set_attribute("count", 3)
        parent.set_attribute("ratio", 0.5)
        parent.set_attribute("flag", True)
        parent.set_attribute("tokens", [1, 2, 3])
        with tracer.start_as_current_span("child") as child:
            child.add_event("checkpoint")
            child.set_status(StatusCode.ERROR, "it broke")
    provider.shutdown()

    spans = _by_name(receiver.wait_for(lambda s: len(s) == 2, timeout=10))
    parent_span, child_span = spans["parent"], spans["child"]
    assert parent_span.parent_span_id == ""
    assert child_span.parent_span_id == parent_span.span_id
    assert child_span.trace_id == parent_span.trace_id
    assert len(parent_span.trace_id) == 32 and len(parent_span.span_id) == 16
    assert int(parent_span.span_id, 16) == parent.get_span_context().span_id
    assert parent_span.service == child_span.service == "tinsmith-test"
    assert parent_span.kind == SpanKind.SERVER.name and child_span.kind == SpanKind.INTERNAL.name
    assert parent_span.attributes == {
        "tinsmith.op": "forward_backward",
        "count": 3,
        "ratio": 0.5,
        "flag": True,
        "tokens": [1, 2, 3],
    }
    assert child_span.status == "ERROR" and child_span.status_message == "it broke"
    assert child_span.events == ("checkpoint",)
    assert parent_span.start_ns <= child_span.start_ns <= child_span.end_ns <= parent_span.end_ns
    assert parent_span.duration_ns >= child_span.duration_ns >= 0


def test_links_and_services_of_two_providers_are_decoded(receiver: OtlpReceiver) -> None:
    producer, consumer = _provider(receiver, "producer"), _provider(receiver, "consumer")
    with producer.get_tracer("test").start_as_current_span("send") as send:
        pass
    context = send.get_span_context()
    with consumer.get_tracer("test").start_as_current_span("handle", links=[Link(context)]):
        pass
    producer.shutdown()
    consumer.shutdown()

    spans = _by_name(receiver.wait_for(lambda s: len(s) == 2, timeout=10))
    assert spans["send"].service == "producer" and spans["handle"].service == "consumer"
    assert spans["handle"].links == ((spans["send"].trace_id, spans["send"].span_id),)
    assert spans["handle"].trace_id != spans["send"].trace_id  # a link, not a parent
    assert spans["handle"].parent_span_id == ""


def test_gzip_and_batches_are_received(receiver: OtlpReceiver) -> None:
    provider = TracerProvider(resource=Resource.create({"service.name": "batched"}))
    exporter = OTLPSpanExporter(
        endpoint=receiver.endpoint + "/v1/traces", compression=Compression.Gzip, timeout=5
    )
    provider.add_span_processor(BatchSpanProcessor(exporter))
    tracer = provider.get_tracer("test")
    for i in range(300):
        with tracer.start_as_current_span("compute", attributes={"i": i}):
            pass
    assert provider.force_flush(10_000)
    provider.shutdown()

    spans = receiver.wait_for(lambda s: len(s) == 300, timeout=10)
    assert sorted(s.attributes["i"] for s in spans) == list(range(300))
    assert {s.service for s in spans} == {"batched"}


def test_wait_for_times_out_with_what_it_received(receiver: OtlpReceiver) -> None:
    provider = _provider(receiver, "lonely")
    with provider.get_tracer("test").start_as_current_span("only"):
        pass
    provider.shutdown()
    receiver.wait_for(lambda s: len(s) == 1, timeout=10)
    with pytest.raises(TimeoutError, match="received 1: lonely/only x1"):
        receiver.wait_for(lambda s: len(s) == 2, timeout=0.2)
    receiver.clear()
    assert receiver.spans() == []


def test_other_content_is_refused_and_metrics_are_answered(receiver: OtlpReceiver) -> None:
    import urllib.error
    import urllib.request

    def post(path: str, body: bytes, content_type: str) -> int:
        request = urllib.request.Request(
            receiver.endpoint + path, data=body, headers={"Content-Type": content_type}
        )
        try:
            with urllib.request.urlopen(request, timeout=5) as response:
                return int(response.status)
        except urllib.error.HTTPError as error:
            return error.code

    assert post("/v1/traces", b"{}", "application/json") == 415
    assert post("/v1/traces", b"\xff\xff\xff", "application/x-protobuf") == 400
    assert post("/v1/metrics", b"", "application/x-protobuf") == 200
    assert post("/v1/logs", b"", "application/x-protobuf") == 200
    assert len(receiver.metrics_requests()) == 1 and len(receiver.logs_requests()) == 1


def _export_one(receiver: OtlpReceiver) -> None:
    provider = _provider(receiver, "async")
    with provider.get_tracer("test").start_as_current_span("inside"):
        pass
    provider.shutdown()


def test_it_serves_on_a_running_event_loop_too() -> None:
    async def main() -> list[Span]:
        async with OtlpReceiver() as receiver:
            # The exporter blocks on HTTP: off the loop that has to answer it.
            await asyncio.to_thread(_export_one, receiver)
            return receiver.spans()

    spans = asyncio.run(main())
    assert [(s.service, s.name) for s in spans] == [("async", "inside")]
