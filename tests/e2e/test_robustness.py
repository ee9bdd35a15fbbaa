"""The robustness suite: bad and extreme inputs on every HTTP route and gRPC method of a running
``tinsmith up``, each answered with its 4xx (gRPC: the code of the same error tree) and a JSON
``{"detail": ...}`` that says what was wrong, never a 5xx, INTERNAL or UNKNOWN; the poison and
wedge regressions; and, after all of it, a normal SDK training step and seeded samples that give
the numbers of a fresh system, with service logs that hold no traceback, no ERROR caused by the
inputs and none of the API keys sent.

The table is tests/e2e/robustness_cases.py: each case is a valid request with one thing wrong.
The first tests send every valid request as it is, so a case's refusal is due to its one change.
One system serves the whole module, started with small bounds (TINSMITH_TRAIN_MEMORY_MB) so that
the memory bound can be reached on tinsmith/tiny; a second, fresh one with the same settings
serves the comparisons.
"""

from __future__ import annotations

import json
import re
import socket
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import grpc
import httpx
import numpy as np
import pytest
import tinker
from tinker import types

from tests.conftest import RunningSystem, start_system, stop_system
from tests.e2e.robustness_cases import (
    API_KEY,
    GRPC_CODES,
    HTTP_CASES,
    JSON_ROUTES,
    METHODS,
    PROMPT,
    PROTOBUF,
    RPC_CASES,
    SECRET_KEY,
    SIZE_RE,
    STREAMING,
    TOKENS,
    TOO_BIG_RESULT,
    VALID,
    VALID_RPC,
    Ctx,
    Http,
    Rpc,
    datum,
    derive,
    encode,
    fb_request,
    over_bus,
    settle,
    weights_shaped,
)
from tinsmith import limits, models
from tinsmith._proto import service_pb2 as svc
from tinsmith._proto import service_pb2_grpc as stubs
from tinsmith._proto import tinker_public_pb2 as tp

API = "/api/v1"
# Small bounds, so that tinsmith/tiny can reach them: a trainer memory budget for one datum that
# a datum of 1024 tokens exceeds and a step of ten tokens is far below. A short long-poll, so
# that a request that never settles is noticed in seconds.
ENV = {"TINSMITH_TRAIN_MEMORY_MB": "16", "TINSMITH_LONG_POLL_S": "5"}
OTHER_KEY = "tml-robust-other-user"  # the user whose samples the poison must not break
PARSER_KEY = "tml-robust-in-a-malformed-header"  # sent only in requests aiohttp cannot parse
FLOW_KEY = "tml-robust-flow"  # the normal training step compared with a fresh system
KEYS = (API_KEY, SECRET_KEY, OTHER_KEY, FLOW_KEY, PARSER_KEY)
DEADLINE_S = 4.0  # a refusal is immediate; a bad request wrongly accepted waits this long
SEED = 20261124


# -- systems and baselines ---------------------------------------------------------------------


@pytest.fixture(scope="module")
def robust(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningSystem]:
    system = start_system(tmp_path_factory.mktemp("robust"), env=ENV)
    yield system
    stop_system(system)


@pytest.fixture(scope="module")
def fresh(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningSystem]:
    """A second system with the same settings that sees no bad input."""
    system = start_system(tmp_path_factory.mktemp("fresh"), env=ENV)
    yield system
    stop_system(system)


@pytest.fixture(scope="module")
def http(robust: RunningSystem) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=robust.url, headers={"X-API-Key": API_KEY}, timeout=60) as client:
        yield client


@pytest.fixture(scope="module")
def channel(robust: RunningSystem) -> Iterator[grpc.Channel]:
    with grpc.insecure_channel(robust.grpc_target) as chan:
        grpc.channel_ready_future(chan).result(timeout=30)
        yield chan


@pytest.fixture(scope="module")
def ctx(robust: RunningSystem, http: httpx.Client) -> Iterator[Ctx]:
    """The valid things the cases refer to: checkpoints of each kind (through the SDK), and a
    session, a run and a sampler that only the cases use (through HTTP, so that the cases choose
    every seq_id)."""
    service = tinker.ServiceClient(base_url=robust.url, api_key=API_KEY)
    training = _ready(service.create_lora_training_client("tinsmith/tiny", rank=4, seed=1))
    training.forward_backward([_sdk_datum()], "cross_entropy").result(timeout=120)
    training.optim_step(types.AdamParams(learning_rate=1e-3)).result(timeout=120)
    training_path = training.save_state("ckpt").result(timeout=120).path
    sampler_path = training.save_weights_for_sampler("samp").result(timeout=120).path
    external_path = training.save_weights_external("ext").result(timeout=120).path
    rest = tinker.RestClient(base_url=robust.url, api_key=API_KEY)
    url = httpx.URL(
        next(iter(rest.get_external_weights_urls(external_path).result().urls.values()))
    )
    assert http.get(url).status_code == 200, "the signed download URL does not work"
    path, _, _ = url.raw_path.decode().partition("?")

    def new_session() -> str:
        reply = http.post(API + "/create_session", content=encode(VALID["create_session"]))
        assert reply.status_code == 200, reply.text
        return str(reply.json()["session_id"])

    session_id = new_session()
    create = {**VALID["create_model"], "session_id": session_id, "model_seq_id": 0}
    accepted = http.post(API + "/create_model", content=encode(create))
    assert accepted.status_code == 200, accepted.text
    assert settle(http, accepted.json()["request_id"], 60).status_code == 200
    sampling = {
        **VALID["create_sampling_session"],
        "session_id": session_id,
        "sampling_session_seq_id": 0,
    }
    sampler = http.post(API + "/create_sampling_session", content=encode(sampling))
    assert sampler.status_code == 200, sampler.text
    yield Ctx(
        session_id=session_id,
        model_id=accepted.json()["model_id"],
        sampler_id=sampler.json()["sampling_session_id"],
        run_id=training.model_id,
        training_path=training_path,
        sampler_path=sampler_path,
        external_path=external_path,
        blob_path=path.removeprefix(API),
        blob_expires=url.params["expires"],
        blob_signature=url.params["signature"],
        blob_tenant=url.params["tenant"],
        new_session=new_session,
    )
    service.close("success").result(timeout=30)


def _ready(client: Any) -> Any:
    """A client from a create_* call (0.38.0 answers a future that is also the client)."""
    return client.result() if hasattr(client, "result") else client


def _sdk_datum(tokens: list[int] = TOKENS) -> types.Datum:
    return types.Datum(
        model_input=types.ModelInput.from_ints(tokens[:-1]),
        loss_fn_inputs={"target_tokens": tokens[1:], "weights": [1.0] * (len(tokens) - 1)},
    )


# -- sending a case ----------------------------------------------------------------------------


class _Fields(dict[str, Any]):
    """The Ctx fields a case's path names; ``{new_session}`` makes a session of its own."""

    def __init__(self, ctx: Ctx) -> None:
        super().__init__()
        self.ctx = ctx

    def __missing__(self, key: str) -> Any:
        return self.ctx.new_session() if key == "new_session" else getattr(self.ctx, key)


def send(http: httpx.Client, ctx: Ctx, case: Http) -> httpx.Response:
    path = case.path.format_map(_Fields(ctx))
    url = path[1:] if path.startswith("//") else API + path
    body = case.body(ctx) if callable(case.body) else case.body
    if isinstance(body, dict | list):
        body = encode(body)
    headers = dict(case.headers)
    if body is not None:
        headers.setdefault("Content-Type", "application/json")
    return http.request(case.method, url, content=body, headers=headers)


def _statuses(status: int | tuple[int, ...]) -> tuple[int, ...]:
    return (status,) if isinstance(status, int) else status


def check_refusal(case: Http, reply: httpx.Response) -> None:
    """The expected status, with a JSON body whose detail says what was wrong."""
    seen = f"{case.method} {case.path[:80]} answered {reply.status_code}: {reply.text[:300]!r}"
    assert reply.status_code in _statuses(case.status), f"expected {case.status}; {seen}"
    assert "application/json" in reply.headers.get("content-type", ""), f"not JSON; {seen}"
    body = reply.json()
    detail = body.get("detail") if isinstance(body, dict) else None
    assert isinstance(detail, str) and detail.strip(), f"no detail; {seen}"
    if case.detail:
        assert re.search(case.detail, detail), f"the detail does not match {case.detail!r}; {seen}"


def _raw(data: bytes) -> bytes:
    return data


def call(
    channel: grpc.Channel, ctx: Ctx, method: str, request: Any, key: str, timeout: float
) -> tuple[grpc.StatusCode, str]:
    """Send one request (a message, or bytes as they are) to ``tinsmith.v1.<method>``: the
    status code and detail it ends with (a stream is read to its end)."""
    data = request if isinstance(request, bytes) else request.SerializeToString()
    path = f"/tinsmith.v1.{method}"
    metadata = [("x-api-key", key)]
    try:
        if method in STREAMING:
            stream = channel.unary_stream(path, request_serializer=_raw, response_deserializer=_raw)
            for _ in stream(data, timeout=timeout, metadata=metadata):
                pass
        else:
            unary = channel.unary_unary(path, request_serializer=_raw, response_deserializer=_raw)
            unary(data, timeout=timeout, metadata=metadata)
    except grpc.RpcError as error:
        return error.code(), error.details() or ""
    return grpc.StatusCode.OK, ""


# -- the valid requests the cases derive from ---------------------------------------------------

VALID_GETS = [
    "/training_runs",
    "/training_runs/{run_id}",
    "/training_runs/{run_id}/checkpoints",
    "/checkpoints",
    "/sessions",
    "/sessions/{session_id}",
    "/billing/usage/checkpoints/current",
    "/samplers/{sampler_id}",
    "/get_server_capabilities",
    "/healthz",
    "{blob_path}?tenant={blob_tenant}&expires={blob_expires}&signature={blob_signature}",
]


@pytest.mark.parametrize(
    ("name", "method", "path", "key"), JSON_ROUTES, ids=[r[0] for r in JSON_ROUTES]
)
def test_the_valid_body_of_each_route_is_accepted(
    http: httpx.Client, ctx: Ctx, name: str, method: str, path: str, key: str
) -> None:
    reply = send(http, ctx, Http(name, method, path, derive(key)))
    assert reply.status_code == 200, reply.text[:300]


@pytest.mark.parametrize("path", VALID_GETS)
def test_each_valid_get_is_answered(http: httpx.Client, ctx: Ctx, path: str) -> None:
    reply = send(http, ctx, Http(path, "GET", path))
    assert reply.status_code == 200, reply.text[:300]


def test_a_valid_forward_backward_is_accepted(http: httpx.Client, ctx: Ctx) -> None:
    body = fb_request(ctx).SerializeToString()
    reply = http.post(API + "/forward_backward", content=body, headers=PROTOBUF)
    assert reply.status_code == 200, reply.text[:300]


@pytest.mark.parametrize("method", METHODS)
def test_the_valid_request_of_each_method_is_answered(
    channel: grpc.Channel, ctx: Ctx, method: str
) -> None:
    code, detail = call(channel, ctx, method, VALID_RPC[method](ctx), API_KEY, 120)
    assert code == grpc.StatusCode.OK, f"{code.name}: {detail}"


# -- the table ----------------------------------------------------------------------------------


@pytest.mark.parametrize("case", HTTP_CASES, ids=[c.name for c in HTTP_CASES])
def test_http(http: httpx.Client, ctx: Ctx, case: Http) -> None:
    check_refusal(case, send(http, ctx, case))


def test_a_body_that_cannot_be_read_ends_its_connection_and_says_so(
    http: httpx.Client, ctx: Ctx
) -> None:
    """Where such a body ends is unknown, so the gateway closes the connection after its answer;
    without ``Connection: close`` a client sent its next request on it, now and then, and had
    it reset."""
    case = next(c for c in HTTP_CASES if c.name == "create_session: gzip that is not gzip")
    reply = send(http, ctx, case)
    check_refusal(case, reply)
    assert reply.headers.get("connection") == "close"


@pytest.mark.parametrize("case", RPC_CASES, ids=[c.name for c in RPC_CASES])
def test_grpc(channel: grpc.Channel, ctx: Ctx, case: Rpc) -> None:
    request = case.request(ctx) if callable(case.request) else case.request
    code, detail = call(channel, ctx, case.method, request, case.api_key, DEADLINE_S)
    expected = {GRPC_CODES[status] for status in _statuses(case.status)}
    assert code.name in expected, f"expected {sorted(expected)}, got {code.name}: {detail[:300]!r}"
    assert detail.strip(), f"{code.name} without a detail"
    if case.detail:
        assert re.search(case.detail, detail), f"{detail[:300]!r} does not match {case.detail!r}"


# -- regressions --------------------------------------------------------------------------------


def _seeded_base_sample(url: str) -> list[list[int]]:
    """The tokens of a seeded sample from tinsmith/tiny itself, through the SDK."""
    service = tinker.ServiceClient(base_url=url, api_key=OTHER_KEY)
    try:
        sampler = _ready(service.create_sampling_client(base_model="tinsmith/tiny"))
        response = sampler.sample(
            types.ModelInput.from_ints(PROMPT),
            2,
            types.SamplingParams(max_tokens=8, seed=SEED, temperature=1.0),
        ).result(timeout=120)
        return [list(sequence.tokens) for sequence in response.sequences]
    finally:
        service.close("success").result(timeout=30)


def test_a_poison_sample_does_not_stop_sampling_for_other_users(
    robust: RunningSystem, fresh: RunningSystem, http: httpx.Client, ctx: Ctx
) -> None:
    """A temperature of 1e-45 passes every check; other users' samples, during and after it,
    all succeed, and a seeded one is what a fresh system answers."""
    poison = {
        "sampling_params.temperature": 1e-45,
        "sampling_params.max_tokens": 16,
        "sampling_params.stop": [],
        "num_samples": 4,
    }
    service = tinker.ServiceClient(base_url=robust.url, api_key=OTHER_KEY)
    try:
        sampler = _ready(service.create_sampling_client(base_model="tinsmith/tiny"))
        prompt = types.ModelInput.from_ints(PROMPT)
        futures, poisons = [], []
        for i in range(6):
            if i % 3 == 0:  # poison before, between and among the other user's samples
                reply = http.post(API + "/asample", content=encode(derive("asample", poison)(ctx)))
                assert reply.status_code == 200, reply.text[:300]
                poisons.append(reply.json()["request_id"])
            params = types.SamplingParams(max_tokens=8, seed=i, temperature=1.0)
            futures.append(sampler.sample(prompt, 2, params))
        for response in [future.result(timeout=120) for future in futures]:
            assert len(response.sequences) == 2
            assert all(sequence.tokens for sequence in response.sequences)
        for request_id in poisons:  # each poison has an outcome of its own, and no 5xx
            outcome = settle(http, request_id, 60)
            assert outcome.status_code == 200, outcome.text[:300]
    finally:
        service.close("success").result(timeout=30)
    assert _seeded_base_sample(robust.url) == _seeded_base_sample(fresh.url)


def test_a_poison_temperature_of_nan_is_refused(http: httpx.Client, ctx: Ctx) -> None:
    """The poison's other form, a NaN temperature (sent raw: JSON has no NaN), never gets in."""
    nan = derive("asample", {"sampling_params.temperature": float("nan")})(ctx)
    refused = http.post(API + "/asample", content=encode(nan))
    assert refused.status_code == 400, refused.text[:300]
    assert "temperature" in refused.json()["detail"], refused.text[:300]


def _new_run(http: httpx.Client, ctx: Ctx) -> str:
    body = derive("create_model")(ctx)
    accepted = http.post(API + "/create_model", content=encode(body))
    assert accepted.status_code == 200, accepted.text[:300]
    assert settle(http, accepted.json()["request_id"], 60).status_code == 200
    return str(accepted.json()["model_id"])


def test_a_refused_request_does_not_wedge_its_run(http: httpx.Client, ctx: Ctx) -> None:
    """weights of shape [-1, -1] holding one value: 400, and the run's next request (the next
    seq_id) still completes, as does the one after it."""
    model_id = _new_run(http, ctx)
    bad = fb_request(ctx, model_id=model_id, seq=1, data=weights_shaped([-1, -1], [1.0]))
    refused = http.post(
        API + "/forward_backward", content=bad.SerializeToString(), headers=PROTOBUF
    )
    assert refused.status_code == 400, refused.text[:300]
    assert "weights" in refused.json()["detail"]

    good = fb_request(ctx, model_id=model_id, seq=2).SerializeToString()
    accepted = http.post(API + "/forward_backward", content=good, headers=PROTOBUF)
    assert accepted.status_code == 200, accepted.text[:300]
    outcome = settle(http, accepted.json()["request_id"], 30)
    assert outcome.headers["content-type"].startswith("application/x-protobuf"), outcome.text
    assert tp.ForwardBackwardOutput.FromString(outcome.content).metrics["loss:sum"] > 0
    step = {"model_id": model_id, "seq_id": 3, "adam_params": {"learning_rate": 1e-3}}
    accepted = http.post(API + "/optim_step", json=step)
    assert accepted.status_code == 200, accepted.text[:300]
    assert "grad_norm:mean" in settle(http, accepted.json()["request_id"], 30).json()["metrics"]


def test_a_refused_request_does_not_wedge_its_run_over_grpc(
    channel: grpc.Channel, ctx: Ctx
) -> None:
    training = stubs.TrainingStub(channel)
    metadata = [("x-api-key", API_KEY)]
    model_id = training.CreateModel(
        svc.CreateModelRequest(
            session_id=ctx.session_id,
            model_seq_id=ctx.model_seq(),
            base_model="tinsmith/tiny",
            lora_rank=4,
        ),
        timeout=60,
        metadata=metadata,
    ).model_id
    bad = fb_request(ctx, model_id=model_id, seq=1, data=weights_shaped([-1, -1], [1.0]))
    with pytest.raises(grpc.RpcError) as refused:
        training.ForwardBackward(bad, timeout=30, metadata=metadata)
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT, refused.value.details()
    good = fb_request(ctx, model_id=model_id, seq=2)
    assert training.ForwardBackward(good, timeout=30, metadata=metadata).metrics["loss:sum"] > 0
    step = svc.OptimStepRequest(
        model_id=model_id, seq_id=3, adam_params=svc.OptimizerParams(learning_rate=1e-3)
    )
    assert training.OptimStep(step, timeout=30, metadata=metadata).metrics["grad_norm:mean"] > 0


def test_a_forward_backward_refused_for_its_size_does_not_wedge_its_run(
    http: httpx.Client, ctx: Ctx
) -> None:
    """A body over the bus limit is refused with 413 before its seq_id can be read; the SDK has
    spent that seq_id all the same, so the run's next request (the next seq_id) must still run."""
    model_id = _new_run(http, ctx)
    big = over_bus(replace(ctx, model_id=model_id, next_seq=1))  # seq_id 1
    refused = http.post(API + "/forward_backward", content=big, headers=PROTOBUF)
    assert refused.status_code == 413, refused.text[:300]
    good = fb_request(ctx, model_id=model_id, seq=2).SerializeToString()
    accepted = http.post(API + "/forward_backward", content=good, headers=PROTOBUF)
    assert accepted.status_code == 200, accepted.text[:300]
    outcome = settle(http, accepted.json()["request_id"], 30)
    assert outcome.headers["content-type"].startswith("application/x-protobuf"), outcome.text


def test_a_forward_backward_of_many_datums_each_within_the_bound_is_trained(
    http: httpx.Client, ctx: Ctx
) -> None:
    """The memory bound is on one datum, which is one pass of the trainer; the datums of a
    request run in as many passes as the trainer's memory asks. 16 datums of 600 tokens, which
    need many times the 16 MiB bound in one pass and fit it one by one, are accepted and
    trained; one datum of 1024 tokens, which does not fit it alone, is refused up front."""
    tiny, bound = models.get(models.TINY), int(ENV["TINSMITH_TRAIN_MEMORY_MB"]) << 20
    lengths = [600] * 16
    assert limits.pass_bytes(tiny.shape, tiny.vocab_size, lengths, backward=True) > 4 * bound
    assert limits.datum_bytes(tiny.shape, tiny.vocab_size, 600, backward=True) <= bound
    model_id = _new_run(http, ctx)
    data = [datum([(5 * i + j) % 512 for i in range(n + 1)]) for j, n in enumerate(lengths)]
    many = fb_request(ctx, model_id=model_id, seq=1, data=data).SerializeToString()
    accepted = http.post(API + "/forward_backward", content=many, headers=PROTOBUF)
    assert accepted.status_code == 200, accepted.text[:300]
    outcome = settle(http, accepted.json()["request_id"], 120)
    assert outcome.headers["content-type"].startswith("application/x-protobuf"), outcome.text
    output = tp.ForwardBackwardOutput.FromString(outcome.content)
    assert [record.num_datums for record in output.loss_fn_outputs] == [16]
    assert output.metrics["loss:sum"] > 0

    long = [datum([(5 * i) % 512 for i in range(1025)])]
    refused = http.post(
        API + "/forward_backward",
        content=fb_request(ctx, model_id=model_id, seq=2, data=long).SerializeToString(),
        headers=PROTOBUF,
    )
    assert refused.status_code == 400, refused.text[:300]
    detail = refused.json()["detail"]
    assert "datum 0" in detail and "1024 tokens" in detail, detail
    assert "TINSMITH_TRAIN_MEMORY_MB" in detail and "at most 619 tokens" in detail, detail


def test_a_save_with_a_ttl_beyond_ten_years_is_refused_and_cannot_break_the_catalog(
    http: httpx.Client, ctx: Ctx
) -> None:
    """ttl_seconds 2**62 (set_checkpoint_ttl refuses it: 3600 to ten years) is refused by
    save_weights too, and the run's checkpoints can still be listed."""
    model_id = _new_run(http, ctx)
    save = {"model_id": model_id, "seq_id": 1, "path": "far-future", "ttl_seconds": 2**62}
    reply = http.post(API + "/save_weights", json=save)
    if reply.status_code == 200:
        settle(http, reply.json()["request_id"], 30)
    listed = http.get(f"{API}/training_runs/{model_id}/checkpoints")
    assert listed.status_code == 200, listed.text[:300]
    assert reply.status_code == 400, reply.text[:300]
    assert "ttl_seconds" in reply.json()["detail"]


def test_a_sample_whose_result_cannot_be_stored_is_refused_up_front(
    http: httpx.Client, ctx: Ctx
) -> None:
    """128 samples x top-20 logprobs x 500 tokens: more than one message on the bus can hold.
    It is refused before any work, saying so; it never runs, so it cannot come back."""
    body = derive("asample", {**TOO_BIG_RESULT, "sampling_params.stop": []})(ctx)
    reply = http.post(API + "/asample", content=encode(body))
    if reply.status_code == 200:  # accepted: say how it ended
        outcome = settle(http, reply.json()["request_id"], 120)
        pytest.fail(
            f"accepted; its future then answered {outcome.status_code}: {outcome.text[:300]!r}"
        )
    assert 400 <= reply.status_code < 500, reply.text[:300]
    assert re.search(SIZE_RE, reply.json()["detail"]), reply.text[:300]
    later = derive("asample")(ctx)  # and the sampler keeps serving
    accepted = http.post(API + "/asample", content=encode(later))
    assert accepted.status_code == 200, accepted.text[:300]
    assert settle(http, accepted.json()["request_id"], 60).status_code == 200


def _not_http(robust: RunningSystem, request: bytes) -> tuple[int, str, dict[str, Any]]:
    """Send bytes that are not valid HTTP to the gateway: its status, content type and body."""
    url = httpx.URL(robust.url)
    with socket.create_connection((url.host, url.port), timeout=30) as conn:
        conn.sendall(request)
        answer = b""
        while chunk := conn.recv(65536):
            answer += chunk
    head, _, body = answer.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    headers = dict(line.split(": ", 1) for line in lines[1:] if ": " in line)
    content_type = {k.lower(): v for k, v in headers.items()}.get("content-type", "")
    return int(lines[0].split()[1]), content_type, json.loads(body)


@pytest.mark.parametrize(
    "request_bytes",
    [
        b"POST /api/v1/create_session HTTP/1.1\r\nHost: x\r\nX-API-Key: %s\x01\r\n"
        b"Content-Length: 2\r\n\r\n{}",
        b"POST /api/v1/create_session HTTP/1.1\r\nHost: x\r\nX-API-Key %s\r\n\r\n",
        b"POST /api/v1/create_session HTTP/1.1\r\nHost: x\r\nX-API-Key: %s\r\n"
        b"Transfer-Encoding: chunked\r\n\r\nzz\r\n{}\r\n0\r\n\r\n",
        b"%s /api/v1/create_session HTTP/1.1\r\nHost: x\r\n\r\n",
    ],
    ids=["control character in a header", "header without a colon", "bad chunk size", "method"],
)
def test_what_aiohttp_cannot_parse_is_answered_in_json_and_never_logged(
    robust: RunningSystem, request_bytes: bytes
) -> None:
    """aiohttp's own parser errors answered plain text, and its log quoted the header bytes,
    API key included (the log test below looks for ``PARSER_KEY`` in every log)."""
    raw = request_bytes.replace(b"%s", PARSER_KEY.encode())
    status, content_type, body = _not_http(robust, raw)
    assert status == 400
    assert content_type.startswith("application/json")
    assert "not valid HTTP" in body["detail"]


def test_download_urls_never_take_their_host_from_the_request(
    robust: RunningSystem, ctx: Ctx
) -> None:
    """The gateway listens on 127.0.0.1 here: its download URLs name that address, whatever Host
    header the caller sent."""
    route = f"{API}/training_runs/{ctx.run_id}/checkpoints/external_weights/ext"
    with httpx.Client(base_url=robust.url, timeout=30) as client:
        reply = client.get(
            route + "/external_weights_urls",
            headers={"X-API-Key": API_KEY, "Host": "attacker.example:80"},
        )
    assert reply.status_code == 200, reply.text
    urls = [url for url in json.dumps(reply.json()).split('"') if url.startswith("http")]
    assert urls and all(url.startswith(robust.url + "/") for url in urls), urls


# -- after everything ---------------------------------------------------------------------------


def _normal_flow(url: str) -> dict[str, Any]:
    """A seeded LoRA training step on tinsmith/tiny through the SDK, a forward after it, and
    seeded samples from its weights: every number they answer."""
    service = tinker.ServiceClient(base_url=url, api_key=FLOW_KEY)
    try:
        training = _ready(service.create_lora_training_client("tinsmith/tiny", rank=4, seed=SEED))
        data = [_sdk_datum(), _sdk_datum([3, 250, 42, 7, 64, 128, 11, 5, 17])]
        step = training.forward_backward(data, "cross_entropy").result(timeout=120)
        optim = training.optim_step(types.AdamParams(learning_rate=1e-2)).result(timeout=120)
        after = training.forward(data, "cross_entropy").result(timeout=120)
        sampler = _ready(training.save_weights_and_get_sampling_client())
        sample = sampler.sample(
            types.ModelInput.from_ints(PROMPT),
            2,
            types.SamplingParams(max_tokens=8, seed=SEED, temperature=1.0),
            include_prompt_logprobs=True,
        ).result(timeout=120)
    finally:
        service.close("success").result(timeout=30)

    def logprobs(output: Any) -> list[list[float]]:
        return [out["logprobs"].to_numpy().tolist() for out in output.loss_fn_outputs]

    return {
        "forward_backward metrics": step.metrics,
        "forward_backward logprobs": logprobs(step),
        "optim_step metrics": optim.metrics,
        "forward after the step": after.metrics,
        "logprobs after the step": logprobs(after),
        "sampled tokens": [list(s.tokens) for s in sample.sequences],
        "sampled logprobs": [list(s.logprobs or []) for s in sample.sequences],
        "prompt logprobs": [np.nan if p is None else p for p in sample.prompt_logprobs or []],
    }


def test_after_the_table_training_and_sampling_give_the_numbers_of_a_fresh_system(
    robust: RunningSystem, fresh: RunningSystem
) -> None:
    """Training is exact (one run's batch is its own). Sampled tokens are exact (each sequence
    has its own seeded generator); their logprobs may differ in the last bits, because the
    batch they share a step with differs."""
    here, there = _normal_flow(robust.url), _normal_flow(fresh.url)
    for name in (
        "forward_backward metrics",
        "forward_backward logprobs",
        "optim_step metrics",
        "forward after the step",
        "logprobs after the step",
        "sampled tokens",
    ):
        assert here[name] == there[name], f"{name}: {here[name]} != {there[name]}"
    # Sequence by sequence: one that stopped early is shorter than the other (the tokens,
    # compared above, are the same).
    for ours, theirs in zip(here["sampled logprobs"], there["sampled logprobs"], strict=True):
        np.testing.assert_allclose(ours, theirs, rtol=0, atol=1e-5, err_msg="sampled logprobs")
    np.testing.assert_allclose(
        here["prompt logprobs"], there["prompt logprobs"], rtol=0, atol=1e-5, err_msg="prompt"
    )


def _problems(data_dir: Path) -> list[str]:
    """Every log line that holds a traceback or is at ERROR level or above."""
    found = []
    for log in sorted((data_dir / "logs").glob("*")):
        for line in log.read_text(errors="replace").splitlines():
            try:
                level = str(json.loads(line).get("level", ""))
            except (ValueError, AttributeError):
                level = ""
            if (
                "Traceback" in line
                or level in ("ERROR", "CRITICAL")
                or re.search(r"\[(ERR|FTL)\]", line)
            ):
                found.append(f"{log.name}: {line[:600]}")
    return found


def _shape(line: str) -> str:
    """A log line without its times, ids and numbers, to match the same message elsewhere."""
    try:
        record = json.loads(line.split(": ", 1)[1])
        line = f"{record.get('logger')}: {record.get('message')}"
    except (ValueError, IndexError, AttributeError):
        pass
    return re.sub(r"[0-9a-f]{8,}|\d+", "#", line)


def test_the_logs_hold_no_traceback_no_error_and_no_api_key(
    robust: RunningSystem, fresh: RunningSystem
) -> None:
    logs = {
        log.name: log.read_text(errors="replace") for log in (robust.data_dir / "logs").glob("*")
    }
    assert logs, "tinsmith up wrote no logs"
    # The gateway keeps no access log: its calls are in the event log, traced and counted.
    assert '"aiohttp.access"' not in logs["gateway.log"]
    for key in KEYS:
        leaks = [name for name, text in logs.items() if key in text]
        assert not leaks, f"the API key {key[:14]}... is in {leaks}"
    # An ERROR that a fresh system logs as well is not the inputs' doing; a traceback always is.
    usual = {_shape(line) for line in _problems(fresh.data_dir)}
    caused = [
        line
        for line in _problems(robust.data_dir)
        if "Traceback" in line or _shape(line) not in usual
    ]
    assert not caused, f"{len(caused)} log lines with errors:\n" + "\n".join(caused[:40])
