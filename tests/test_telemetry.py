"""tinsmith.telemetry in a process of its own each time (OpenTelemetry's providers are set once
per process): configured by OTEL_* or a no-op, JSON log lines with the trace and request ids, and
compute spans that start on the compute thread under the caller's span."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from typing import Any

import pytest

from bench.otlp import OtlpReceiver

_OTEL_VARIABLES = [name for name in os.environ if name.startswith("OTEL_")]


def _run(code: str, **env: str) -> subprocess.CompletedProcess[str]:
    clean = {k: v for k, v in os.environ.items() if k not in _OTEL_VARIABLES}
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        capture_output=True,
        text=True,
        timeout=60,
        env={**clean, **env},
    )


def _json_lines(text: str) -> list[dict[str, Any]]:
    return [json.loads(line) for line in text.splitlines() if line.startswith("{")]


LOG_IN_A_REQUEST = """
    import logging
    from tinsmith import telemetry
    telemetry.configure_logging("trainer")
    telemetry.setup("trainer")
    log = logging.getLogger("tinsmith.test")
    log.info("outside")
    with telemetry.tracer.start_as_current_span("work") as span:
        with telemetry.request_scope("run-1:7"):
            log.warning("inside %s", "a request", extra={"step": 3})
            context = span.get_span_context()
            print(f"ids {context.trace_id:032x} {context.span_id:016x}", flush=True)
    print("tracing", telemetry.tracing())
    telemetry.shutdown()
"""


def test_unconfigured_is_a_no_op_and_logs_are_json_lines() -> None:
    done = _run(LOG_IN_A_REQUEST)
    assert done.returncode == 0, done.stderr
    assert "tracing False" in done.stdout
    assert "ids 00000000000000000000000000000000 0000000000000000" in done.stdout
    outside, inside = [r for r in _json_lines(done.stderr) if r["logger"] == "tinsmith.test"]
    assert outside["message"] == "outside" and "request_id" not in outside
    assert inside["message"] == "inside a request"
    assert (inside["level"], inside["service"], inside["step"]) == ("WARNING", "trainer", 3)
    assert inside["request_id"] == "run-1:7"
    assert "trace_id" not in inside  # no spans are recorded, so there is no trace id to log


def test_configured_logs_carry_the_trace_and_span_ids() -> None:
    with OtlpReceiver() as receiver:
        done = _run(LOG_IN_A_REQUEST, OTEL_EXPORTER_OTLP_ENDPOINT=receiver.endpoint)
        assert done.returncode == 0, done.stderr
        spans = receiver.wait_for(lambda spans: any(s.name == "work" for s in spans), 10.0)
    assert "tracing True" in done.stdout
    trace_id, span_id = done.stdout.split("ids ")[1].split()[:2]
    (inside,) = [r for r in _json_lines(done.stderr) if r.get("request_id")]
    assert (inside["trace_id"], inside["span_id"]) == (trace_id, span_id)
    (work,) = [s for s in spans if s.name == "work"]
    assert (work.trace_id, work.span_id, work.service) == (trace_id, span_id, "tinsmith-trainer")
    assert work.attributes["tinsmith.request_id"] == "run-1:7"


def test_text_logs_for_people() -> None:
    done = _run(LOG_IN_A_REQUEST, TINSMITH_LOG_FORMAT="text")
    assert done.returncode == 0, done.stderr
    line = next(line for line in done.stderr.splitlines() if "inside a request" in line)
    assert " WARNING tinsmith.test: inside a request [request=run-1:7]" in line


@pytest.mark.parametrize(
    ("variable", "value", "message"),
    [
        ("OTEL_EXPORTER_OTLP_PROTOCOL", "http/json", "'http/protobuf' or 'grpc'"),
        ("OTEL_TRACES_EXPORTER", "zipkin", "the exporters are 'otlp' and 'console'"),
        ("TINSMITH_LOG_FORMAT", "xml", "use 'json' or 'text'"),
    ],
)
def test_a_bad_setting_stops_the_process_with_what_is_accepted(
    variable: str, value: str, message: str
) -> None:
    env = {variable: value, "OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:9"}
    done = _run(LOG_IN_A_REQUEST, **env)
    assert done.returncode != 0
    assert f"{variable}={value!r}" in done.stderr and message in done.stderr


def test_sdk_disabled_turns_everything_off() -> None:
    done = _run(LOG_IN_A_REQUEST, OTEL_SDK_DISABLED="true", OTEL_TRACES_EXPORTER="console")
    assert done.returncode == 0, done.stderr
    assert "tracing False" in done.stdout


COMPUTE = """
    import asyncio, time
    from tinsmith import telemetry
    from tinsmith.compute import ComputeThread
    telemetry.setup("sampler")

    async def main():
        compute = ComputeThread("test-compute", device=lambda: "cpu")
        with telemetry.tracer.start_as_current_span("other") as other:
            pass
        with telemetry.tracer.start_as_current_span("request"):
            await compute.run(time.sleep, 0.05)  # busy, but no span
            await compute.traced("optim_step", {"tinsmith.model_id": "m"}, time.sleep, 0.1)
            # Work done for another request too: its span leads here.
            await compute.linked("fused", {}, [other.get_span_context()], time.sleep, 0.01)
        compute.shutdown()
        body, _ = telemetry.prometheus_text()
        print(body.decode())

    asyncio.run(main())
    telemetry.shutdown()
"""


def test_compute_spans_start_on_the_thread_under_the_callers_span() -> None:
    with OtlpReceiver() as receiver:
        done = _run(COMPUTE, OTEL_EXPORTER_OTLP_ENDPOINT=receiver.endpoint)
        assert done.returncode == 0, done.stderr
        spans = receiver.wait_for(lambda spans: len(spans) >= 4, 10.0)
    (request,) = [s for s in spans if s.name == "request"]
    (other,) = [s for s in spans if s.name == "other"]
    compute, fused = sorted(
        (s for s in spans if s.name == "compute"),
        key=lambda s: s.attributes["tinsmith.op"] == "fused",
    )
    assert compute.parent_span_id == request.span_id and not compute.links
    assert fused.parent_span_id == request.span_id
    assert fused.links == ((other.trace_id, other.span_id),)
    assert compute.attributes == {
        "tinsmith.op": "optim_step",
        "tinsmith.device": "cpu",
        "tinsmith.model_id": "m",
    }
    assert 0.1 <= compute.duration_ns / 1e9 < 0.5
    (busy,) = [
        line
        for line in done.stdout.splitlines()
        if line.startswith("tinsmith_compute_busy_seconds_total")
    ]
    assert 0.16 <= float(busy.split()[-1]) < 1.0


BUSY_UNDER_WAY = """
    import asyncio, time
    from tinsmith import telemetry
    from tinsmith.compute import ComputeThread
    telemetry.setup("trainer")

    def busy() -> float:
        body, _ = telemetry.prometheus_text()
        (line,) = [
            line for line in body.decode().splitlines()
            if line.startswith("tinsmith_compute_busy_seconds_total")
        ]
        return float(line.split()[-1])

    async def main():
        compute = ComputeThread("test-compute")
        work = asyncio.ensure_future(compute.run(time.sleep, 0.6))
        await asyncio.sleep(0.3)
        print("during", busy())
        await work
        print("after", busy())
        compute.shutdown()

    asyncio.run(main())
    telemetry.shutdown()
"""


def test_the_busy_counter_counts_work_while_it_runs() -> None:
    """A scrape in the middle of long work sees the time it has run so far, not nothing until
    it ends (the duty cycle would show a multi-second pass as one spike after it)."""
    done = _run(BUSY_UNDER_WAY)
    assert done.returncode == 0, done.stderr
    during, after = (float(line.split()[-1]) for line in done.stdout.splitlines())
    assert 0.2 <= during < 0.5
    assert 0.6 <= after < 1.0
