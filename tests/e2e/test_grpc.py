"""The gRPC face, driven by a client generated from proto/tinsmith/v1/service.proto: a full SFT
step and a sample, the same numbers as the tinker SDK gets over HTTP on the same weights,
reflection, health, the catalog, the error tree's status codes, a streamed sample, and sample
calls that end early (deadline, client cancel) cancelling their work in the sampler."""

from __future__ import annotations

import json
import time
import urllib.request
from collections.abc import Iterator
from typing import Any

import grpc
import numpy as np
import pytest
import tinker
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
from tinker import types

from tests.conftest import RunningSystem
from tinsmith._proto import service_pb2 as svc
from tinsmith._proto import service_pb2_grpc as stubs
from tinsmith._proto import tinker_public_pb2 as tp

TOKENS = [5, 17, 99, 3, 250, 42, 7, 64, 128, 11]
PROMPT = [5, 17, 99, 3]


def _datum(tokens: list[int]) -> tp.Datum:
    inputs, targets = tokens[:-1], tokens[1:]
    return tp.Datum(
        model_input=[
            tp.Chunk(encoded_text=tp.EncodedTextChunk(tokens=np.asarray(inputs, "<i4").tobytes()))
        ],
        loss_fn_inputs={
            "target_tokens": tp.Tensor(
                dense=np.asarray(targets, "<i8").tobytes(),
                dtype=tp.DTYPE_INT64,
                shape=[len(targets)],
            ),
            "weights": tp.Tensor(
                dense=np.ones(len(targets), "<f4").tobytes(),
                dtype=tp.DTYPE_FLOAT32,
                shape=[len(targets)],
            ),
        },
    )


def _logprobs(output: tp.ForwardBackwardOutput) -> np.ndarray:
    (record,) = output.loss_fn_outputs
    field = record.fields["logprobs"]
    assert field.dtype == tp.DTYPE_FLOAT32
    return np.frombuffer(field.data, "<f4")


# The caller, as gRPC metadata (the HTTP face's X-API-Key header); the SDK side uses it too, so
# both faces act for the same user, and what this module creates is nobody else's.
API_KEY = "tml-grpc-e2e"


class _WithApiKey(grpc.UnaryUnaryClientInterceptor, grpc.UnaryStreamClientInterceptor):  # type: ignore[misc]
    def _with_key(self, details: Any) -> Any:
        metadata = [*(details.metadata or ()), ("x-api-key", API_KEY)]
        return details._replace(metadata=metadata)

    def intercept_unary_unary(self, continuation: Any, details: Any, request: Any) -> Any:
        return continuation(self._with_key(details), request)

    def intercept_unary_stream(self, continuation: Any, details: Any, request: Any) -> Any:
        return continuation(self._with_key(details), request)


@pytest.fixture(scope="module")
def channel(system: RunningSystem) -> Iterator[grpc.Channel]:
    assert system.grpc_target, "tinsmith up printed no gRPC address"
    with grpc.insecure_channel(system.grpc_target) as chan:
        grpc.channel_ready_future(chan).result(timeout=30)
        yield grpc.intercept_channel(chan, _WithApiKey())


@pytest.fixture(scope="module")
def trained(channel: grpc.Channel) -> dict[str, object]:
    """One SFT step over gRPC, then a training checkpoint and a sampler checkpoint."""
    training = stubs.TrainingStub(channel)
    session = training.CreateSession(svc.CreateSessionRequest(tags=["grpc"]), timeout=60)
    model = training.CreateModel(
        svc.CreateModelRequest(
            session_id=session.session_id,
            model_seq_id=0,
            base_model="tinsmith/tiny",
            lora_rank=8,
            seed=1,
        ),
        timeout=120,
    )
    model_id = model.model_id
    request = tp.ForwardBackwardRequest(
        model_id=model_id, seq_id=1, data=[_datum(TOKENS)], loss_fn="cross_entropy"
    )
    fb = training.ForwardBackward(request, timeout=120)
    assert fb.metrics["loss:sum"] > 0
    step = training.OptimStep(
        svc.OptimStepRequest(
            model_id=model_id, seq_id=2, adam_params=svc.OptimizerParams(learning_rate=5e-3)
        ),
        timeout=120,
    )
    assert step.metrics["grad_norm:mean"] > 0
    state = training.SaveState(
        svc.SaveRequest(model_id=model_id, seq_id=3, path="grpc-step1"), timeout=120
    )
    sampler = training.SaveForSampler(
        svc.SaveRequest(model_id=model_id, seq_id=4, path="grpc-step1"), timeout=120
    )
    forward = training.Forward(
        tp.ForwardBackwardRequest(
            model_id=model_id, seq_id=5, data=[_datum(TOKENS)], loss_fn="cross_entropy"
        ),
        timeout=120,
    )
    return {
        "session_id": session.session_id,
        "model_id": model_id,
        "state_path": state.path,
        "sampler_path": sampler.path,
        "forward": forward,
        "first_loss": fb.metrics["loss:sum"],
    }


@pytest.fixture(scope="module")
def service(system: RunningSystem) -> Iterator[tinker.ServiceClient]:
    client = tinker.ServiceClient(base_url=system.url, api_key=API_KEY)
    yield client
    client.close("success").result(timeout=30)


def test_an_sft_step_over_grpc_lowers_the_loss(trained: dict[str, object]) -> None:
    forward = trained["forward"]
    assert isinstance(forward, tp.ForwardBackwardOutput)
    assert forward.metrics["loss:sum"] < trained["first_loss"]
    assert trained["state_path"] == f"tinker://{trained['model_id']}/weights/grpc-step1"
    assert trained["sampler_path"] == f"tinker://{trained['model_id']}/sampler_weights/grpc-step1"


def test_forward_over_grpc_matches_the_sdk_on_the_same_weights(
    trained: dict[str, object], service: tinker.ServiceClient
) -> None:
    forward = trained["forward"]
    assert isinstance(forward, tp.ForwardBackwardOutput)
    client = service.create_training_client_from_state(str(trained["state_path"]))
    client = client.result() if hasattr(client, "result") else client
    datum = types.Datum(
        model_input=types.ModelInput.from_ints(TOKENS[:-1]),
        loss_fn_inputs={"target_tokens": TOKENS[1:], "weights": [1.0] * (len(TOKENS) - 1)},
    )
    sdk = client.forward([datum], "cross_entropy").result()
    np.testing.assert_allclose(
        _logprobs(forward), sdk.loss_fn_outputs[0]["logprobs"].to_numpy(), rtol=1e-5, atol=1e-6
    )
    assert forward.metrics["loss:sum"] == pytest.approx(sdk.metrics["loss:sum"], rel=1e-5)


def test_a_seeded_sample_over_grpc_matches_the_sdk(
    channel: grpc.Channel, trained: dict[str, object], service: tinker.ServiceClient
) -> None:
    sampling = stubs.SamplingStub(channel)
    path = str(trained["sampler_path"])
    sampler = sampling.CreateSamplingSession(
        svc.CreateSamplingSessionRequest(
            session_id=str(trained["session_id"]), sampling_session_seq_id=0, model_path=path
        ),
        timeout=60,
    )
    response = sampling.Sample(
        svc.SampleRequest(
            sampling_session_id=sampler.sampling_session_id,
            seq_id=0,
            prompt=PROMPT,
            sampling_params=tp.SamplingParams(max_tokens=8, seed=7, temperature=1.0),
            num_samples=2,
            prompt_logprobs=True,
        ),
        timeout=120,
    )
    ours = [np.frombuffer(s.tokens, "<i4").tolist() for s in response.sequences]
    assert len(ours) == 2 and all(len(tokens) == 8 for tokens in ours)
    sdk_sampler = service.create_sampling_client(model_path=path)
    if hasattr(sdk_sampler, "result"):
        sdk_sampler = sdk_sampler.result()
    sdk = sdk_sampler.sample(
        types.ModelInput.from_ints(PROMPT),
        num_samples=2,
        sampling_params=types.SamplingParams(max_tokens=8, seed=7, temperature=1.0),
        include_prompt_logprobs=True,
    ).result()
    assert ours == [list(s.tokens) for s in sdk.sequences]
    prompt_logprobs = np.frombuffer(response.prompt_logprobs, "<f4")
    assert sdk.prompt_logprobs is not None
    np.testing.assert_allclose(prompt_logprobs[1:], sdk.prompt_logprobs[1:], rtol=1e-5)


def test_reflection_lists_the_services(channel: grpc.Channel) -> None:
    reflection = reflection_pb2_grpc.ServerReflectionStub(channel)
    (answer,) = reflection.ServerReflectionInfo(
        iter([reflection_pb2.ServerReflectionRequest(list_services="")]), timeout=30
    )
    names = {s.name for s in answer.list_services_response.service}
    assert {
        "tinsmith.v1.Training",
        "tinsmith.v1.Sampling",
        "tinsmith.v1.Catalog",
        "grpc.health.v1.Health",
        "grpc.reflection.v1alpha.ServerReflection",
    } <= names


def test_the_health_service_says_serving(channel: grpc.Channel) -> None:
    checks = health_pb2_grpc.HealthStub(channel)
    for name in ("", "tinsmith.v1.Training"):
        answer = checks.Check(health_pb2.HealthCheckRequest(service=name), timeout=30)
        assert answer.status == health_pb2.HealthCheckResponse.SERVING


def test_the_catalog_over_grpc(channel: grpc.Channel, trained: dict[str, object]) -> None:
    catalog = stubs.CatalogStub(channel)
    checkpoints = json.loads(
        catalog.ListCheckpoints(
            svc.ListCheckpointsRequest(training_run_id=str(trained["model_id"])), timeout=30
        ).json
    )
    paths = {c["tinker_path"] for c in checkpoints["checkpoints"]}
    assert {trained["state_path"], trained["sampler_path"]} <= paths
    session = json.loads(
        catalog.GetSession(
            svc.GetSessionRequest(session_id=str(trained["session_id"])), timeout=30
        ).json
    )
    assert trained["model_id"] in session["training_run_ids"]
    runs = json.loads(catalog.ListTrainingRuns(svc.ListTrainingRunsRequest(), timeout=30).json)
    assert "training_runs" in runs


def test_errors_carry_the_status_code_and_detail_of_the_error_tree(
    channel: grpc.Channel, trained: dict[str, object]
) -> None:
    training, sampling = stubs.TrainingStub(channel), stubs.SamplingStub(channel)
    with pytest.raises(grpc.RpcError) as missing:
        training.OptimStep(svc.OptimStepRequest(model_id="nope:train:0", seq_id=1), timeout=30)
    assert missing.value.code() == grpc.StatusCode.NOT_FOUND
    assert "no training run with model_id 'nope:train:0'" in missing.value.details()

    with pytest.raises(grpc.RpcError) as bad:
        sampling.CreateSamplingSession(
            svc.CreateSamplingSessionRequest(
                session_id=str(trained["session_id"]), sampling_session_seq_id=99
            ),
            timeout=30,
        )
    assert bad.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "needs base_model or model_path" in bad.value.details()

    sampler = sampling.CreateSamplingSession(
        svc.CreateSamplingSessionRequest(
            session_id=str(trained["session_id"]),
            sampling_session_seq_id=1,
            base_model="tinsmith/tiny",
        ),
        timeout=30,
    )
    with pytest.raises(grpc.RpcError) as vocab:
        sampling.Sample(
            svc.SampleRequest(
                sampling_session_id=sampler.sampling_session_id, seq_id=0, prompt=[1, 10**6]
            ),
            timeout=30,
        )
    assert vocab.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "outside the vocabulary" in vocab.value.details()


def test_an_oversized_message_is_refused_with_a_clear_error(channel: grpc.Channel) -> None:
    training = stubs.TrainingStub(channel)
    huge = svc.CreateSessionRequest(user_metadata={"blob": "x" * (8 * 1024 * 1024)})
    with pytest.raises(grpc.RpcError) as refused:
        training.CreateSession(huge, timeout=30)
    assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "one request may be at most 7340032 bytes" in refused.value.details()


# -- streaming and cancellation ----------------------------------------------------------------

# tinsmith/tiny generates a few hundred tokens a second here: this many take seconds, far longer
# than the deadlines below.
LONG = 1000
# LONG tokens for each of WIDE samples keep the sampler busy for several seconds (one sample
# alone takes about one), so a request that was not cancelled shows.
WIDE = 16


@pytest.fixture(scope="module")
def base_sampler(channel: grpc.Channel, trained: dict[str, object]) -> str:
    created = stubs.SamplingStub(channel).CreateSamplingSession(
        svc.CreateSamplingSessionRequest(
            session_id=str(trained["session_id"]),
            sampling_session_seq_id=2,
            base_model="tinsmith/tiny",
        ),
        timeout=30,
    )
    return str(created.sampling_session_id)


def _sample(sampler: str, seq_id: int, max_tokens: int, **fields: Any) -> svc.SampleRequest:
    return svc.SampleRequest(
        sampling_session_id=sampler,
        seq_id=seq_id,
        prompt=PROMPT,
        sampling_params=tp.SamplingParams(
            max_tokens=max_tokens, seed=11, temperature=1.0, stop_tokens=tp.StopTokens()
        ),
        **fields,
    )


def _sampler_metric(system: RunningSystem, name: str, label: str = "") -> float:
    with urllib.request.urlopen(system.metrics["sampler"], timeout=10) as response:
        lines = response.read().decode().splitlines()
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in lines
        if line.split("{")[0].split(" ")[0] == name and label in line
    )


def _sampler_lets_go(system: RunningSystem, within_s: float) -> float:
    """Wait until the sampler holds no request; return how long that took. Then check that its
    engine stays idle: a request it still decoded would keep its compute thread busy."""
    started = time.monotonic()
    while _sampler_metric(system, "tinsmith_queue_depth", "sampler.local") > 0:
        assert time.monotonic() - started < within_s, "the sampler still holds the request"
        time.sleep(0.05)
    waited = time.monotonic() - started
    busy = _sampler_metric(system, "tinsmith_compute_busy_seconds_total")
    time.sleep(1.0)
    assert _sampler_metric(system, "tinsmith_compute_busy_seconds_total") - busy < 0.2
    return waited


def _cancelled_future(sampling: stubs.SamplingStub, request: svc.SampleRequest) -> str:
    """The request's outcome in the log, through a retry of the same seq_id: a cancelled one
    answers CANCELLED at once (one still running would answer its tokens, seconds later)."""
    with pytest.raises(grpc.RpcError) as again:
        sampling.Sample(request, timeout=30)
    assert again.value.code() == grpc.StatusCode.CANCELLED, again.value.details()
    return str(again.value.details())


def test_a_streamed_sample_sends_tokens_as_they_come_and_adds_up_to_the_sample(
    channel: grpc.Channel, trained: dict[str, object]
) -> None:
    sampling = stubs.SamplingStub(channel)
    sampler = sampling.CreateSamplingSession(
        svc.CreateSamplingSessionRequest(
            session_id=str(trained["session_id"]),
            sampling_session_seq_id=3,
            model_path=str(trained["sampler_path"]),
        ),
        timeout=30,
    ).sampling_session_id
    fields = {"num_samples": 2, "prompt_logprobs": True, "topk_sample_logprobs": 2}
    whole = sampling.Sample(_sample(sampler, 0, 200, **fields), timeout=60)

    arrivals, chunks = [], []
    sent = time.monotonic()
    for chunk in sampling.SampleStream(_sample(sampler, 1, 200, **fields), timeout=60):
        arrivals.append(time.monotonic())
        chunks.append(chunk)
    *streamed, last = chunks
    assert last.HasField("response") and not any(c.HasField("response") for c in streamed)
    assert len(streamed) > 10 and all(c.deltas for c in streamed)
    # Sent as generated: the first tokens came in the first half of the request's time, not
    # with the last (a time of its own, as the sampler's speed is the machine's).
    assert arrivals[0] - sent < 0.5 * (arrivals[-1] - sent), (sent, arrivals[0], arrivals[-1])

    tokens: dict[int, list[int]] = {0: [], 1: []}
    logprobs: dict[int, list[float]] = {0: [], 1: []}
    for chunk in chunks:
        for delta in chunk.deltas:
            assert delta.offset == len(tokens[delta.index])
            tokens[delta.index] += np.frombuffer(delta.tokens, "<i4").tolist()
            logprobs[delta.index] += np.frombuffer(delta.logprobs, "<f4").tolist()
    # The same seed: the same tokens as the call that waited for the whole answer.
    assert [tokens[0], tokens[1]] == [
        np.frombuffer(s.tokens, "<i4").tolist() for s in whole.sequences
    ]
    for index, sequence in enumerate(whole.sequences):
        np.testing.assert_allclose(
            logprobs[index], np.frombuffer(sequence.logprobs, "<f4"), atol=1e-4
        )
    # Exactly the stored result, which a retry of the streamed request's seq_id answers.
    stored = sampling.Sample(_sample(sampler, 1, 200, **fields), timeout=60)
    for index, sequence in enumerate(stored.sequences):
        assert tokens[index] == np.frombuffer(sequence.tokens, "<i4").tolist()
        assert logprobs[index] == np.frombuffer(sequence.logprobs, "<f4").tolist()
    # The rest of the answer comes last: stop reasons, top-k, prompt logprobs.
    response = last.response
    assert [s.stop_reason for s in response.sequences] == [tp.STOP_REASON_LENGTH] * 2
    assert all(not s.tokens and not s.logprobs for s in response.sequences)
    assert response.sequences[1].topk_sampled_logprobs == stored.sequences[1].topk_sampled_logprobs
    assert response.prompt_logprobs == stored.prompt_logprobs


def test_a_deadline_cancels_the_sample_and_frees_the_sampler(
    channel: grpc.Channel, base_sampler: str, system: RunningSystem
) -> None:
    sampling = stubs.SamplingStub(channel)
    request = _sample(base_sampler, 0, LONG, num_samples=WIDE)
    started = time.monotonic()
    with pytest.raises(grpc.RpcError) as expired:
        sampling.Sample(request, timeout=0.5)
    assert expired.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert time.monotonic() - started < 1.5

    assert "deadline passed" in _cancelled_future(sampling, request)
    _sampler_lets_go(system, within_s=2.0)
    # A request after it is answered as usual.
    answer = sampling.Sample(_sample(base_sampler, 1, 8), timeout=30)
    assert len(answer.sequences[0].tokens) == 8 * 4


def test_a_cancelled_stream_cancels_its_sample(
    channel: grpc.Channel, base_sampler: str, system: RunningSystem
) -> None:
    sampling = stubs.SamplingStub(channel)
    request = _sample(base_sampler, 2, LONG, num_samples=WIDE)
    call = sampling.SampleStream(request, timeout=60)
    first = next(call)
    assert first.deltas and not first.HasField("response")
    call.cancel()

    assert "client cancelled" in _cancelled_future(sampling, request)
    _sampler_lets_go(system, within_s=2.0)
