"""The table of bad and extreme inputs that tests/e2e/test_robustness.py sends, over every HTTP
route (services/gateway/http.py, rest.py) and every gRPC method (proto/tinsmith/v1/service.proto).

Each case is a valid request with exactly one thing wrong: the valid bodies are ``VALID`` (HTTP)
and ``VALID_RPC`` (gRPC), and a case names what it changes. Ids, seq_ids and names come from the
``Ctx`` that the test module builds on the running system (a session, a run on tinsmith/tiny, a
sampler, a checkpoint of each kind, a signed download URL) and are filled in when the case runs.

A case expects an HTTP status (a tuple where several are right, such as 400 or 429 for a bound);
a gRPC case expects the code the error tree gives that status (400 INVALID_ARGUMENT, 404
NOT_FOUND, 422 FAILED_PRECONDITION, 413 and 429 RESOURCE_EXHAUSTED). ``detail`` is a regular
expression that the answer's detail must contain where what to say is obvious (mostly the name of
the field that is wrong).
"""

from __future__ import annotations

import copy
import json
import time
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import httpx
import numpy as np
from google.protobuf.message import Message

from tinsmith._proto import service_pb2 as svc
from tinsmith._proto import tinker_public_pb2 as tp

API_KEY = "tml-robust-e2e"
# Sent only with malformed requests, on both faces: it must never appear in a log.
SECRET_KEY = f"tml-secret-{uuid.uuid4().hex}"

NAN, INF = float("nan"), float("inf")
I32, I64, U64 = 2**31, 2**63, 2**64  # one past the range of int32, int64 and uint64 fields
MIB = 1024 * 1024
SEVERAL_MB = 3 * MIB  # metadata of several MB, yet well under the 8 MiB bus limit
OVER_BUS = 8 * MIB + 4096  # a body over the bus limit (8 MiB)
DEEP = b"[" * 100_000  # JSON nested 100000 levels deep
GARBAGE = b"\xff" * 12 + b" not a protobuf message"
TOKENS = [5, 17, 99, 3, 250, 42, 7, 64, 128, 11]
PROMPT = [5, 17, 99]
HOMELESS = "~no-such-user-robust/model"  # expanding it is an OS-level error

# What an answer's detail must say.
JSON_RE = r"(?i)json"
DEEP_RE = r"(?i)json|nest|deep"
LIMIT_RE = r"(?i)\d[\d,. ]*\s*(bytes|mi?b|megabytes)\b"  # says the limit, in bytes or MiB
GRPC_LIMIT_RE = r"(?i)larger than max|7 ?mi?b|7[ ,]?340[ ,]?032"  # gRPC's 7 MiB message limit
MODEL_RE = r"(?i)base_model|model"
NAME_RE = r"(?i)name"
SIZE_RE = r"(?i)result|size|bytes|mi?b"
TOKENS_RE = r"(?i)num_samples|tokens"
MEMORY_RE = r"(?i)memory|budget|tokens"
METHOD_RE = r"(?i)method"
LONG_RE = r"(?i)long|bytes"
GRPC_CODES = {
    400: "INVALID_ARGUMENT",
    404: "NOT_FOUND",
    413: "RESOURCE_EXHAUSTED",
    422: "FAILED_PRECONDITION",
    429: "RESOURCE_EXHAUSTED",
}


@dataclass
class Ctx:
    """What the cases refer to on the running system, and the counters that keep each case's
    ids fresh (a repeated seq_id would be a retry of an earlier request, not a new one)."""

    session_id: str
    model_id: str  # a run on tinsmith/tiny, rank 4, that only the cases drive
    sampler_id: str  # a sampler on tinsmith/tiny in session_id
    run_id: str  # the run (of the same API key) that holds the checkpoints below
    training_path: str
    sampler_path: str
    external_path: str
    blob_path: str  # a signed download URL below /api/v1: its path, expires and signature
    blob_expires: str
    blob_signature: str
    blob_tenant: str  # the tenant the URL was signed for
    new_session: Callable[[], str]  # a session of its own, for the cases that finish one
    next_seq: int = 1
    next_model_seq: int = 1
    next_sampler_seq: int = 1
    next_sample_seq: int = 0
    next_name: int = 0

    def seq(self) -> int:
        self.next_seq += 1
        return self.next_seq - 1

    def model_seq(self) -> int:
        self.next_model_seq += 1
        return self.next_model_seq - 1

    def sampler_seq(self) -> int:
        self.next_sampler_seq += 1
        return self.next_sampler_seq - 1

    def sample_seq(self) -> int:
        self.next_sample_seq += 1
        return self.next_sample_seq - 1

    def name(self) -> str:
        self.next_name += 1
        return f"robust-{self.next_name}"


class Lazy:
    """A value taken from the Ctx when the case runs."""

    def __init__(self, fn: Callable[[Ctx], Any]) -> None:
        self.fn = fn


class RawJson:
    """A JSON number as written (``1e999``), which json.dumps cannot produce."""

    def __init__(self, text: str) -> None:
        self.text = text


SESSION = Lazy(lambda c: c.session_id)
MODEL = Lazy(lambda c: c.model_id)
SAMPLER = Lazy(lambda c: c.sampler_id)
TRAINING_PATH = Lazy(lambda c: c.training_path)
SAMPLER_PATH = Lazy(lambda c: c.sampler_path)
SEQ = Lazy(lambda c: c.seq())
MODEL_SEQ = Lazy(lambda c: c.model_seq())
SAMPLER_SEQ = Lazy(lambda c: c.sampler_seq())
SAMPLE_SEQ = Lazy(lambda c: c.sample_seq())
NAME = Lazy(lambda c: c.name())
FAR_AHEAD = Lazy(lambda c: c.next_seq + 100_000)  # far ahead of the run's next seq_id
NO_CHECKPOINT = Lazy(lambda c: f"tinker://{c.run_id}/weights/nope")
NEWLINE_CHECKPOINT = Lazy(lambda c: c.training_path + "\n")
DROP = object()  # a change that removes the field


def resolve(value: Any, ctx: Ctx) -> Any:
    if isinstance(value, Lazy):
        return value.fn(ctx)
    if isinstance(value, dict):
        return {k: resolve(v, ctx) for k, v in value.items()}
    if isinstance(value, list):
        return [resolve(v, ctx) for v in value]
    return value


def encode(body: Any) -> bytes:
    """JSON as Python writes it: NaN, Infinity and -Infinity included; RawJson as written."""
    raws: dict[str, str] = {}

    def mark(value: Any) -> Any:
        if isinstance(value, RawJson):
            token = f"@raw{len(raws)}@"
            raws[token] = value.text
            return token
        if isinstance(value, dict):
            return {k: mark(v) for k, v in value.items()}
        if isinstance(value, list):
            return [mark(v) for v in value]
        return value

    text = json.dumps(mark(body), allow_nan=True)
    for token, raw in raws.items():
        text = text.replace(json.dumps(token), raw)
    return text.encode()


# -- valid HTTP bodies --------------------------------------------------------------------------

ADAM = {
    "learning_rate": 1e-4,
    "beta1": 0.9,
    "beta2": 0.95,
    "eps": 1e-12,
    "weight_decay": 0.0,
    "grad_clip_norm": 0.0,
}
VALID: dict[str, dict[str, Any]] = {
    "client_config": {"sdk_version": "0.38.0"},
    "telemetry": {
        "events": [],
        "platform": "Linux",
        "sdk_version": "0.38.0",
        "session_id": SESSION,
        "process_uuid": "00000000-0000-0000-0000-000000000000",
    },
    "create_session": {
        "tags": ["robust"],
        "user_metadata": {"suite": "robustness"},
        "sdk_version": "0.38.0",
        "type": "create_session",
    },
    "heartbeat": {"session_id": SESSION, "type": "session_heartbeat"},
    "finish": {"reason": {"type": "success"}, "detail": None},
    "create_model": {
        "session_id": SESSION,
        "model_seq_id": MODEL_SEQ,
        "base_model": "tinsmith/tiny",
        "lora_config": {
            "rank": 4,
            "seed": 1,
            "train_mlp": True,
            "train_attn": True,
            "train_unembed": True,
        },
        "optimizer_config": {"type": "adamw"},
        "type": "create_model",
    },
    "get_info": {"model_id": MODEL, "type": "get_info"},
    "optim_step": {"model_id": MODEL, "seq_id": SEQ, "type": "optim_step", "adam_params": ADAM},
    "load_weights": {  # create a run from a checkpoint
        "session_id": SESSION,
        "model_seq_id": MODEL_SEQ,
        "path": TRAINING_PATH,
        "optimizer": True,
        "type": "load_weights",
    },
    "load_weights_into": {  # the deprecated load into an existing run
        "model_id": MODEL,
        "seq_id": SEQ,
        "path": TRAINING_PATH,
        "optimizer": True,
        "type": "load_weights",
    },
    "save_weights": {
        "model_id": MODEL,
        "path": NAME,
        "seq_id": SEQ,
        "overwrite": False,
        "type": "save_weights",
    },
    "save_for_sampler": {
        "model_id": MODEL,
        "sampling_session_seq_id": SAMPLER_SEQ,
        "kind": "snapshot",
        "seq_id": SEQ,
        "type": "save_weights_for_sampler",
    },
    "save_external": {
        "model_id": MODEL,
        "path": NAME,
        "seq_id": SEQ,
        "type": "save_weights_external",
    },
    "create_sampling_session": {
        "session_id": SESSION,
        "sampling_session_seq_id": SAMPLER_SEQ,
        "base_model": "tinsmith/tiny",
        "type": "create_sampling_session",
    },
    "asample": {
        "sampling_session_id": SAMPLER,
        "seq_id": SAMPLE_SEQ,
        "num_samples": 1,
        "prompt": {"chunks": [{"type": "encoded_text", "tokens": PROMPT}]},
        "sampling_params": {
            "max_tokens": 4,
            "seed": 1,
            "temperature": 1.0,
            "top_k": -1,
            "top_p": 1.0,
        },
        "prompt_logprobs": False,
        "topk_prompt_logprobs": 0,
        "topk_sample_logprobs": 0,
        "prompt_alt_tokens_k": 0,
        "record_stability_info": False,
        "type": "sample",
    },
    "retrieve_future": {
        "request_id": Lazy(lambda c: f"{c.model_id}:0"),
        "allow_metadata_only": True,
    },
    "weights_info": {"tinker_path": TRAINING_PATH},
    "ttl": {"ttl_seconds": 7200},
}


def derive(route: str, changes: Mapping[str, Any] | None = None) -> Callable[[Ctx], Any]:
    """The valid body of ``route`` with ``changes`` (dotted paths into it; DROP removes)."""

    def build(ctx: Ctx) -> Any:
        body = copy.deepcopy(VALID[route])
        for dotted, value in (changes or {}).items():
            *parents, leaf = dotted.split(".")
            node = body
            for part in parents:
                node = node[part]
            if value is DROP:
                node.pop(leaf, None)
            else:
                node[leaf] = value
        return resolve(body, ctx)

    return build


def padded(route: str) -> Callable[[Ctx], bytes]:
    """The valid body of ``route`` with an unknown field that takes it over the bus limit."""

    def build(ctx: Ctx) -> bytes:
        return encode({**derive(route)(ctx), "padding": "x" * OVER_BUS})

    return build


# -- forward_backward requests (the HTTP route's protobuf body, and gRPC's) ----------------------


def tensor(values: Any, dtype: str, shape: list[int] | None = None) -> tp.Tensor:
    array = np.asarray(values, dtype)
    wire = {"<f4": tp.DTYPE_FLOAT32, "<i8": tp.DTYPE_INT64}[dtype]
    dims = shape if shape is not None else [array.size]
    return tp.Tensor(dense=array.tobytes(), dtype=wire, shape=dims)


def datum(
    tokens: list[int] = TOKENS, *, with_weights: bool = True, **inputs: tp.Tensor
) -> tp.Datum:
    """``tokens[:-1]`` predicting ``tokens[1:]`` (weights 1 unless left out), ``inputs`` added
    or replacing."""
    n = len(tokens) - 1
    loss_fn_inputs = {"target_tokens": tensor(tokens[1:], "<i8")}
    if with_weights:
        loss_fn_inputs["weights"] = tensor(np.ones(n), "<f4")
    loss_fn_inputs.update(inputs)
    ids = np.asarray(tokens[:-1], "<i4").tobytes()
    chunk = tp.Chunk(encoded_text=tp.EncodedTextChunk(tokens=ids))
    return tp.Datum(model_input=[chunk], loss_fn_inputs=loss_fn_inputs)


def ppo_datum(tokens: list[int] = TOKENS) -> tp.Datum:
    n = len(tokens) - 1
    logprobs, advantages = tensor(np.full(n, -1.0), "<f4"), tensor(np.ones(n), "<f4")
    return datum(tokens, with_weights=False, logprobs=logprobs, advantages=advantages)


def weights_shaped(shape: list[int], values: list[float]) -> list[tp.Datum]:
    return [datum(weights=tensor(values, "<f4", shape))]


LONG_DATUMS = [datum([(7 * i + j) % 512 for i in range(1025)]) for j in range(4)]  # 4 x 1024


def fb_request(
    c: Ctx,
    *,
    seq: int | None = None,
    data: list[tp.Datum] | None = None,
    loss_fn: str = "cross_entropy",
    config: Mapping[str, float] | None = None,
    model_id: str | None = None,
) -> tp.ForwardBackwardRequest:
    request = tp.ForwardBackwardRequest(
        model_id=c.model_id if model_id is None else model_id,
        seq_id=c.seq() if seq is None else seq,
        data=data if data is not None else [datum()],
        loss_fn=loss_fn,
    )
    for key, value in (config or {}).items():
        request.loss_fn_config[key] = value
        request.loss_fn_config_v2[key].number = value
    return request


def over_bus(c: Ctx) -> bytes:
    """A valid forward_backward request with an unknown field that takes it over 8 MiB."""
    pad = b"x" * OVER_BUS
    return fb_request(c).SerializeToString() + varint(1000 << 3 | 2) + varint(len(pad)) + pad


def varint(n: int) -> bytes:
    """``n`` as a protobuf varint."""
    out = bytearray()
    while True:
        byte, n = n & 0x7F, n >> 7
        out.append(byte | (0x80 if n else 0))
        if not n:
            return bytes(out)


# -- the HTTP cases -----------------------------------------------------------------------------

Status = int | tuple[int, ...]


@dataclass(frozen=True)
class Http:
    name: str
    method: str
    path: str  # below /api/v1 unless it starts with "//"; {field} is a Ctx field
    body: Any = None  # None, bytes, or Callable[[Ctx], dict | bytes] (a dict is sent as JSON)
    status: Status = 400
    detail: str | None = None
    headers: Mapping[str, str] = field(default_factory=dict)


def route(key: str, method: str, path: str, label: str = "") -> Callable[..., Http]:
    """A maker of cases for one route, each the route's valid body with ``changes``."""

    def case(
        name: str,
        changes: Mapping[str, Any] | None,
        detail: str | None = None,
        status: Status = 400,
    ) -> Http:
        return Http(f"{label or key}: {name}", method, path, derive(key, changes), status, detail)

    return case


PROTOBUF = {"Content-Type": "application/x-protobuf"}


def fb(name: str, build: Callable[[Ctx], Any], detail: str | None, status: Status = 400) -> Http:
    """A forward_backward case: ``build`` gives the request (or its bytes)."""

    def body(c: Ctx) -> bytes:
        message = build(c)
        return message if isinstance(message, bytes) else message.SerializeToString()

    return Http(
        f"forward_backward: {name}", "POST", "/forward_backward", body, status, detail, PROTOBUF
    )


def get(name: str, path: str, detail: str | None = None, status: Status = 400) -> Http:
    return Http(name, "GET", path, None, status, detail)


CKPT = "/training_runs/{run_id}/checkpoints"
TTL = CKPT + "/weights/ckpt/ttl"
USAGE = "/billing/usage/checkpoints/current"

# Every route that takes a JSON body: (label, method, path, the VALID body).
JSON_ROUTES = [
    ("client_config", "POST", "/client/config", "client_config"),
    ("dynamic_config", "POST", "/client/dynamic_config", "client_config"),
    ("telemetry", "POST", "/telemetry", "telemetry"),
    ("create_session", "POST", "/create_session", "create_session"),
    ("session_heartbeat", "POST", "/session_heartbeat", "heartbeat"),
    ("finish", "POST", "/sessions/{new_session}/finish", "finish"),
    ("create_model", "POST", "/create_model", "create_model"),
    ("get_info", "POST", "/get_info", "get_info"),
    ("optim_step", "POST", "/optim_step", "optim_step"),
    ("load_weights", "POST", "/load_weights", "load_weights"),
    ("load_weights_into", "POST", "/load_weights", "load_weights_into"),
    ("save_weights", "POST", "/save_weights", "save_weights"),
    ("save_for_sampler", "POST", "/save_weights_for_sampler", "save_for_sampler"),
    ("save_external", "POST", "/save_weights_external", "save_external"),
    ("create_sampling_session", "POST", "/create_sampling_session", "create_sampling_session"),
    ("asample", "POST", "/asample", "asample"),
    ("retrieve_future", "POST", "/retrieve_future", "retrieve_future"),
    ("weights_info", "POST", "/weights_info", "weights_info"),
    ("set_ttl", "PUT", TTL, "ttl"),
]


def _malformed_bodies() -> list[Http]:
    cases = []
    for name, method, path, key in JSON_ROUTES:
        cases += [
            Http(f"{name}: JSON nested 100000 deep", method, path, DEEP, 400, DEEP_RE),
            Http(f"{name}: not JSON", method, path, b"\xff\xfe{not json", 400, JSON_RE),
            Http(f"{name}: a JSON array", method, path, b"[1, 2]", 400, r"(?i)object"),
            Http(f"{name}: a body over 8 MiB", method, path, padded(key), 413, LIMIT_RE),
        ]
    return cases


session = route("create_session", "POST", "/create_session")
heartbeat = route("heartbeat", "POST", "/session_heartbeat", "session_heartbeat")
finish = route("finish", "POST", "/sessions/{new_session}/finish")
model = route("create_model", "POST", "/create_model")
info = route("get_info", "POST", "/get_info")
optim = route("optim_step", "POST", "/optim_step")
load = route("load_weights", "POST", "/load_weights")
load_into = route("load_weights_into", "POST", "/load_weights", "load_weights into a run")
save = route("save_weights", "POST", "/save_weights")
save_sampler = route("save_for_sampler", "POST", "/save_weights_for_sampler")
save_external = route("save_external", "POST", "/save_weights_external")
sampling_session = route("create_sampling_session", "POST", "/create_sampling_session")
sample = route("asample", "POST", "/asample")
future = route("retrieve_future", "POST", "/retrieve_future")
weights_info = route("weights_info", "POST", "/weights_info")
ttl = route("ttl", "PUT", TTL, "set_ttl")
lr = "adam_params.learning_rate"
sp = "sampling_params"
META = {"k": "v" * SEVERAL_MB}
HUGE_LR = RawJson("1e999")  # parsed as infinity
TOO_BIG_RESULT = {"num_samples": 128, "topk_sample_logprobs": 20, f"{sp}.max_tokens": 500}
TOO_MANY_TOKENS = {"num_samples": 1024, f"{sp}.max_tokens": 1021, f"{sp}.stop": []}  # 1024 x 1024

HTTP_CASES: list[Http] = [
    *_malformed_bodies(),
    # -- methods, routes and content types --------------------------------------------------
    Http("GET on a POST route", "GET", "/create_model", None, 405, METHOD_RE),
    Http("GET on asample", "GET", "/asample", None, 405, METHOD_RE),
    Http("PUT on forward_backward", "PUT", "/forward_backward", b"", 405, METHOD_RE),
    Http("POST on healthz", "POST", "/healthz", b"{}", 405, METHOD_RE),
    Http("PATCH on healthz", "PATCH", "/healthz", b"{}", 405, METHOD_RE),
    Http("POST on get_server_capabilities", "POST", "/get_server_capabilities", b"{}", 405),
    Http("DELETE on get_server_capabilities", "DELETE", "/get_server_capabilities", None, 405),
    Http("POST on samplers", "POST", "/samplers/{sampler_id}", b"{}", 405, METHOD_RE),
    Http("POST on storage usage", "POST", USAGE, b"{}", 405, METHOD_RE),
    Http("an unknown route", "GET", "/no_such_route", None, 404, r"(?i)not found|no_such"),
    Http("an unknown API version", "POST", "//api/v2/create_session", b"{}", 404),
    Http("the root", "GET", "//", None, 404),
    get("healthz: a request line over 8 KiB", "/healthz?" + "x" * 10000, LONG_RE, (400, 414)),
    get(
        "get_server_capabilities: a request line over 8 KiB",
        "/get_server_capabilities?" + "x" * 10000,
        LONG_RE,
        (400, 414),
    ),
    Http(
        "create_session: a protobuf body",
        "POST",
        "/create_session",
        svc.CreateSessionRequest(tags=["x"]).SerializeToString(),
        (400, 415),
        JSON_RE,
        PROTOBUF,
    ),
    Http(
        "create_session: gzip that is not gzip",
        "POST",
        "/create_session",
        b"\x1f\x8b not really gzip",
        (400, 415),
        None,
        {"Content-Encoding": "gzip"},
    ),
    Http(
        "asample: a form body",
        "POST",
        "/asample",
        b"sampling_session_id=x&seq_id=1",
        (400, 415),
        JSON_RE,
        {"Content-Type": "application/x-www-form-urlencoded"},
    ),
    Http(
        "forward_backward: a JSON body",
        "POST",
        "/forward_backward",
        derive("optim_step"),
        (400, 415),
        r"(?i)ForwardBackwardRequest|protobuf",
    ),
    Http(
        "forward_backward: zstd",
        "POST",
        "/forward_backward",
        lambda c: fb_request(c).SerializeToString(),
        (400, 415),
        r"(?i)compress|encoding",
        {**PROTOBUF, "Content-Encoding": "zstd"},
    ),
    Http(
        "a malformed request with a secret API key",
        "POST",
        "/create_session",
        DEEP,
        400,
        DEEP_RE,
        {"X-API-Key": SECRET_KEY},
    ),
    # -- create_session, session_heartbeat, finish --------------------------------------------
    session("tags a string", {"tags": "x"}, "tags"),
    session("tags of numbers", {"tags": [1]}, "tags"),
    session("user_metadata a list", {"user_metadata": [1]}, "user_metadata"),
    session("project_id an object", {"project_id": {}}, "project_id"),
    session("tags of several MB", {"tags": ["t" * SEVERAL_MB]}, "tags"),
    session("user_metadata of several MB", {"user_metadata": META}, "user_metadata"),
    heartbeat("no session_id", {"session_id": DROP}, "session_id"),
    heartbeat("session_id a number", {"session_id": 5}, "session_id"),
    heartbeat("unknown session", {"session_id": "nope"}, "nope", 404),
    heartbeat("session_id of 10000 chars", {"session_id": "s" * 10000}, "session", (400, 404)),
    Http("finish: unknown session", "POST", "/sessions/nope/finish", derive("finish"), 404, "nope"),
    Http(
        "finish: session id ending in a newline",
        "POST",
        "/sessions/{new_session}%0A/finish",
        derive("finish"),
        (400, 404),
        "session",
    ),
    finish("reason a number", {"reason": 5}, "reason"),
    # -- create_model ---------------------------------------------------------------------------
    Http("create_model: empty body", "POST", "/create_model", b"", 400, "session_id"),
    model("no base_model", {"base_model": DROP}, "base_model"),
    model("base_model a number", {"base_model": 7}, "base_model"),
    model("base_model of 10000 chars", {"base_model": "m" * 10000}, MODEL_RE),
    model("base_model with a NUL", {"base_model": "tinsmith/tiny\x00"}, MODEL_RE),
    model("base_model in an unknown home", {"base_model": HOMELESS}, MODEL_RE),
    model("unknown session", {"session_id": "nope"}, "nope", 404),
    model("model_seq_id negative", {"model_seq_id": -1}, "model_seq_id"),
    model("model_seq_id beyond int64", {"model_seq_id": I64}, "model_seq_id"),
    model("model_seq_id a string", {"model_seq_id": "1"}, "model_seq_id"),
    model("lora rank 100000", {"lora_config.rank": 100000}, "rank"),
    model("lora rank 0", {"lora_config.rank": 0}, "rank"),
    model("lora rank a string", {"lora_config.rank": "8"}, "rank"),
    model("seed beyond uint64", {"lora_config.seed": U64}, "seed"),
    model("seed negative", {"lora_config.seed": -1}, "seed"),
    model("lora_config a list", {"lora_config": []}, "lora_config"),
    model("optimizer sgd", {"optimizer_config": {"type": "sgd"}}, "sgd"),
    model("user_metadata of several MB", {"user_metadata": META}, "user_metadata"),
    model(
        "trains nothing",
        {f"lora_config.train_{part}": False for part in ("mlp", "attn", "unembed")},
        r"(?i)at least one",
    ),
    # -- get_info ---------------------------------------------------------------------------------
    info("no model_id", {"model_id": DROP}, "model_id"),
    info("model_id a list", {"model_id": ["x"]}, "model_id"),
    info("unknown run", {"model_id": "nope:train:0"}, "nope:train:0", 404),
    info("model_id of 10000 chars", {"model_id": "m" * 10000}, "model_id|run", (400, 404)),
    # -- forward_backward -------------------------------------------------------------------------
    fb("garbage", lambda c: GARBAGE, "ForwardBackwardRequest"),
    fb("empty", lambda c: b"", "model_id", (400, 404)),
    fb("a body over 8 MiB", over_bus, LIMIT_RE, 413),
    fb("unknown run", lambda c: fb_request(c, model_id="nope:train:0", seq=1), "nope", 404),
    fb("seq_id negative", lambda c: fb_request(c, seq=-1), "seq_id"),
    fb("seq_id far ahead", lambda c: fb_request(c, seq=c.next_seq + 100_000), "seq_id", 429),
    fb(
        "weights of shape [-1, -1]",
        lambda c: fb_request(c, data=weights_shaped([-1, -1], [1.0])),
        "weights",
    ),
    fb(
        "weights of shape [2**62, 2**62]",
        lambda c: fb_request(c, data=weights_shaped([2**62, 2**62], [1.0])),
        "weights",
    ),
    fb(
        "weights of shape [2**32, 2**32], no values",
        lambda c: fb_request(c, data=weights_shaped([2**32, 2**32], [])),
        "weights",
    ),
    fb(
        "target_tokens of shape [-9]",
        lambda c: fb_request(c, data=[datum(target_tokens=tensor(TOKENS[1:], "<i8", [-9]))]),
        "target_tokens",
    ),
    fb(
        "weights NaN",
        lambda c: fb_request(c, data=[datum(weights=tensor([NAN] * 9, "<f4"))]),
        "weights",
    ),
    fb(
        "loss_fn_config NaN",
        lambda c: fb_request(
            c, data=[ppo_datum()], loss_fn="ppo", config={"clip_low_threshold": NAN}
        ),
        "loss_fn_config",
    ),
    fb(
        "loss_fn_config infinity",
        lambda c: fb_request(
            c, data=[ppo_datum()], loss_fn="ppo", config={"clip_high_threshold": INF}
        ),
        "loss_fn_config",
    ),
    fb("no data", lambda c: fb_request(c, data=[]), "datum"),
    fb("unknown loss_fn", lambda c: fb_request(c, loss_fn="nope"), "loss_fn"),
    fb(
        "4 datums of 1024 tokens, each over the memory budget",
        lambda c: fb_request(c, data=LONG_DATUMS),
        MEMORY_RE,
        (400, 429),
    ),
    # -- optim_step -------------------------------------------------------------------------------
    optim("learning_rate NaN", {lr: NAN}, "learning_rate"),
    optim("learning_rate Infinity", {lr: INF}, "learning_rate"),
    optim("learning_rate 1e999", {lr: HUGE_LR}, "learning_rate"),
    optim("learning_rate a 400-digit integer", {lr: 10**400}, "learning_rate"),
    optim("learning_rate a string", {lr: "0.1"}, "learning_rate"),
    optim("eps Infinity", {"adam_params.eps": INF}, "eps"),
    optim("weight_decay -Infinity", {"adam_params.weight_decay": -INF}, "weight_decay"),
    optim("grad_clip_norm NaN", {"adam_params.grad_clip_norm": NAN}, "grad_clip_norm"),
    optim("beta1 NaN", {"adam_params.beta1": NAN}, "beta1"),
    optim("beta2 Infinity", {"adam_params.beta2": INF}, "beta2"),
    optim("seq_id beyond int64", {"seq_id": I64}, "seq_id"),
    optim("seq_id far ahead", {"seq_id": FAR_AHEAD}, "seq_id", 429),
    optim("seq_id 0", {"seq_id": 0}, "seq_id"),
    optim("no seq_id", {"seq_id": DROP}, "seq_id"),
    optim("adam_params a number", {"adam_params": 3}, "adam_params"),
    optim("unknown run", {"model_id": "nope:train:0", "seq_id": 1}, "nope:train:0", 404),
    # -- load_weights -----------------------------------------------------------------------------
    load("no path", {"path": DROP}, "path"),
    load("not a tinker path", {"path": "s3://x/y"}, "tinker://"),
    load("name ending in a newline", {"path": NEWLINE_CHECKPOINT}, NAME_RE),
    load("path of 10000 chars", {"path": "tinker://" + "p" * 10000}, "path|tinker://"),
    load("unknown checkpoint", {"path": NO_CHECKPOINT}, "nope", 404),
    load("model_seq_id beyond int64", {"model_seq_id": I64}, "model_seq_id"),
    load("base_model with a NUL", {"base_model": "tinsmith/tiny\x00"}, MODEL_RE),
    load("base_model in an unknown home", {"base_model": HOMELESS}, MODEL_RE),
    load("the optimizer of sampler weights", {"path": SAMPLER_PATH}, "sampler"),
    load_into("seq_id beyond int64", {"seq_id": I64}, "seq_id"),
    load_into("unknown checkpoint", {"path": NO_CHECKPOINT}, "nope", 404),
    # -- save_weights, save_weights_for_sampler, save_weights_external ----------------------------
    save("name ending in a newline", {"path": "step1\n"}, NAME_RE),
    save("name with a slash", {"path": "../x"}, NAME_RE),
    save("name of 10000 chars", {"path": "n" * 10000}, NAME_RE),
    save("name a number", {"path": 5}, "path"),
    save("ttl_seconds beyond int64", {"ttl_seconds": I64}, "ttl_seconds"),
    save("ttl_seconds 2**62", {"ttl_seconds": 2**62}, "ttl_seconds"),
    save("ttl_seconds negative", {"ttl_seconds": -5}, "ttl_seconds"),
    save("seq_id beyond int64", {"seq_id": I64}, "seq_id"),
    save("user_metadata of several MB", {"user_metadata": META}, "user_metadata"),
    save("unknown run", {"model_id": "nope:train:0", "seq_id": 1}, "nope:train:0", 404),
    save_sampler(
        "name ending in a newline",
        {"path": "s1\n", "sampling_session_seq_id": DROP},
        NAME_RE,
    ),
    save_sampler(
        "sampling_session_seq_id beyond int64",
        {"sampling_session_seq_id": I64},
        "sampling_session_seq_id",
    ),
    save_sampler(
        "sampling_session_seq_id negative",
        {"sampling_session_seq_id": -1},
        "sampling_session_seq_id",
    ),
    save_sampler(
        "neither a name nor sampling_session_seq_id",
        {"sampling_session_seq_id": DROP},
        "sampling_session_seq_id|path|name",
    ),
    save_external("name ending in a newline", {"path": "e1\n"}, NAME_RE),
    save_external("ttl_seconds beyond int64", {"ttl_seconds": I64}, "ttl_seconds"),
    save_external(
        "age recipients", {"age_encryption_recipients": ["age1x"]}, "age_encryption_recipients"
    ),
    # -- create_sampling_session, samplers --------------------------------------------------------
    sampling_session("no session_id", {"session_id": DROP}, "session_id"),
    sampling_session("unknown session", {"session_id": "nope"}, "nope", 404),
    sampling_session(
        "sampling_session_seq_id beyond int64",
        {"sampling_session_seq_id": I64},
        "sampling_session_seq_id",
    ),
    sampling_session(
        "sampling_session_seq_id negative",
        {"sampling_session_seq_id": -1},
        "sampling_session_seq_id",
    ),
    sampling_session("base_model of 10000 chars", {"base_model": "m" * 10000}, MODEL_RE),
    sampling_session("base_model with a NUL", {"base_model": "tinsmith/tiny\x00"}, MODEL_RE),
    sampling_session("base_model in an unknown home", {"base_model": HOMELESS}, MODEL_RE),
    sampling_session("neither model", {"base_model": DROP}, "base_model"),
    sampling_session(
        "unknown model_path",
        {"base_model": DROP, "model_path": Lazy(lambda c: f"tinker://{c.run_id}/weights/nope")},
        "nope",
        404,
    ),
    sampling_session(
        "model_path ending in a newline",
        {"base_model": DROP, "model_path": Lazy(lambda c: c.sampler_path + "\n")},
        NAME_RE,
    ),
    get("samplers: unknown", "/samplers/nope:sample:0", "nope:sample:0", 404),
    get("samplers: id ending in a newline", "/samplers/{sampler_id}%0A", "sampler", (400, 404)),
    get("samplers: id of 10000 chars", "/samplers/" + "s" * 10000, None, (400, 404, 414)),
    # -- asample ----------------------------------------------------------------------------------
    Http("asample: empty body", "POST", "/asample", b"", 400, "sampling_session_id"),
    sample("unknown sampler", {"sampling_session_id": "nope:sample:0"}, "nope:sample:0", 404),
    sample("temperature NaN", {f"{sp}.temperature": NAN}, "temperature"),
    sample("temperature Infinity", {f"{sp}.temperature": INF}, "temperature"),
    sample("top_p NaN", {f"{sp}.top_p": NAN}, "top_p"),
    sample("top_p -Infinity", {f"{sp}.top_p": -INF}, "top_p"),
    sample("max_tokens beyond int64", {f"{sp}.max_tokens": I64}, "max_tokens"),
    sample("max_tokens 0", {f"{sp}.max_tokens": 0}, "max_tokens"),
    sample("top_k beyond int32", {f"{sp}.top_k": I32}, "top_k"),
    sample("seed beyond uint64", {f"{sp}.seed": U64}, "seed"),
    sample("stop token id beyond int64", {f"{sp}.stop": [I64]}, "stop"),
    sample("stop a number", {f"{sp}.stop": 5}, "stop"),
    sample("sampling_params a list", {sp: [1]}, "sampling_params"),
    sample("seq_id beyond int64", {"seq_id": I64}, "seq_id"),
    sample("seq_id negative", {"seq_id": -1}, "seq_id"),
    sample("num_samples beyond int32", {"num_samples": I32}, "num_samples"),
    sample("num_samples 0", {"num_samples": 0}, "num_samples"),
    sample("prompt_logprobs_last_n beyond int32", {"prompt_logprobs_last_n": I32}, "last_n"),
    sample("topk_sample_logprobs beyond int64", {"topk_sample_logprobs": I64}, "topk_sample"),
    sample(
        "prompt token beyond int64",
        {"prompt.chunks": [{"type": "encoded_text", "tokens": [1, I64]}]},
        "prompt",
    ),
    sample("empty prompt", {"prompt.chunks": []}, "prompt"),
    sample("no prompt", {"prompt": DROP}, "prompt"),
    sample(
        "an image chunk",
        {"prompt.chunks": [{"type": "image", "data": "", "format": "png"}]},
        "image",
    ),
    sample(
        "target_prompt_logprobs of shape [-1, -1]",
        {"target_prompt_logprobs": {"data": [1], "dtype": "int64", "shape": [-1, -1]}},
        "target_prompt_logprobs",
    ),
    sample("1024 samples x 1021 tokens", TOO_MANY_TOKENS, TOKENS_RE, (400, 429)),
    sample("a result too large to store", TOO_BIG_RESULT, SIZE_RE),
    # -- retrieve_future --------------------------------------------------------------------------
    future("no request_id", {"request_id": DROP}, "request_id"),
    future("request_id a number", {"request_id": 12}, "request_id"),
    future("unknown", {"request_id": "nope:1"}, "nope:1", 404),
    future(
        "request_id of 10000 chars", {"request_id": "r" * 10000}, "request_id|future", (400, 404)
    ),
    # -- REST: training runs and checkpoints ------------------------------------------------------
    get("training_runs: limit not a number", "/training_runs?limit=abc", "limit"),
    get("training_runs: limit beyond int64", f"/training_runs?limit={I64}", "limit"),
    get("training_runs: offset negative", "/training_runs?offset=-1", "offset"),
    get("training_runs: offset beyond int64", f"/training_runs?offset={I64}", "offset"),
    get("training_runs: unknown access_scope", "/training_runs?access_scope=all", "access_scope"),
    get("training_run: unknown", "/training_runs/nope:train:0", "nope:train:0", 404),
    get("training_run: bad id", "/training_runs/a%20b", "id"),
    get(
        "training_run: unknown access_scope",
        "/training_runs/{run_id}?access_scope=all",
        "access_scope",
    ),
    get("run checkpoints: unknown run", "/training_runs/nope:train:0/checkpoints", "nope", 404),
    get("run checkpoints: id of 1000 chars", "/training_runs/" + "r" * 1000 + "/checkpoints", "id"),
    get("checkpoints: limit beyond int64", f"/checkpoints?limit={I64}", "limit"),
    get("checkpoints: limit not a number", "/checkpoints?limit=x", "limit"),
    get("checkpoints: offset negative", "/checkpoints?offset=-1", "offset"),
    Http("delete checkpoint: unknown", "DELETE", CKPT + "/weights/nope", None, 404, "nope"),
    Http(
        "delete checkpoint: name ending in a newline",
        "DELETE",
        CKPT + "/weights/ckpt%0A",
        None,
        400,
        NAME_RE,
    ),
    Http("delete checkpoint: unknown kind", "DELETE", CKPT + "/bogus/ckpt", None, 400, "bogus"),
    Http(
        "delete checkpoint: name of 200 chars",
        "DELETE",
        CKPT + "/weights/" + "n" * 200,
        None,
        400,
        NAME_RE,
    ),
    Http("publish: unknown", "POST", CKPT + "/weights/nope/publish", None, 404, "nope"),
    Http(
        "publish: name of 200 chars",
        "POST",
        CKPT + "/weights/" + "n" * 200 + "/publish",
        None,
        400,
        NAME_RE,
    ),
    Http(
        "publish: name ending in a newline",
        "POST",
        CKPT + "/weights/ckpt%0A/publish",
        None,
        400,
        NAME_RE,
    ),
    Http("unpublish: unknown", "DELETE", CKPT + "/weights/nope/publish", None, 404, "nope"),
    Http(
        "unpublish: name of 200 chars",
        "DELETE",
        CKPT + "/weights/" + "n" * 200 + "/publish",
        None,
        400,
        NAME_RE,
    ),
    Http(
        "unpublish: name ending in a newline",
        "DELETE",
        CKPT + "/weights/ckpt%0A/publish",
        None,
        400,
        NAME_RE,
    ),
    ttl("ttl_seconds a string", {"ttl_seconds": "7200"}, "ttl_seconds"),
    ttl("ttl_seconds beyond int64", {"ttl_seconds": I64}, "ttl_seconds"),
    ttl("ttl_seconds 2**62", {"ttl_seconds": 2**62}, "ttl_seconds"),
    ttl("ttl_seconds negative", {"ttl_seconds": -5}, "ttl_seconds"),
    ttl("ttl_seconds NaN", {"ttl_seconds": NAN}, "ttl_seconds"),
    Http(
        "set_ttl: unknown checkpoint", "PUT", CKPT + "/weights/nope/ttl", derive("ttl"), 404, "nope"
    ),
    get(
        "external_weights_urls: unknown",
        CKPT + "/external_weights/nope/external_weights_urls",
        "nope",
        404,
    ),
    get(
        "external_weights_urls: name of 200 chars",
        CKPT + "/external_weights/" + "n" * 200 + "/external_weights_urls",
        NAME_RE,
    ),
    get(
        "external_weights_urls: name ending in a newline",
        CKPT + "/external_weights/ext%0A/external_weights_urls",
        NAME_RE,
    ),
    weights_info("no tinker_path", {"tinker_path": DROP}, "tinker_path"),
    weights_info("tinker_path a number", {"tinker_path": 5}, "tinker_path"),
    weights_info("unknown", {"tinker_path": NO_CHECKPOINT}, "nope", 404),
    weights_info("name ending in a newline", {"tinker_path": NEWLINE_CHECKPOINT}, NAME_RE),
    weights_info("a run id escaping storage", {"tinker_path": "tinker://../weights/x"}, "id"),
    # -- REST: sessions, usage, downloads ---------------------------------------------------------
    get("sessions: limit beyond int64", f"/sessions?limit={I64}", "limit"),
    get("sessions: limit not a number", "/sessions?limit=many", "limit"),
    get("sessions: offset negative", "/sessions?offset=-1", "offset"),
    get("session: unknown", "/sessions/nope", "nope", 404),
    get("session: bad id", "/sessions/a.b", "id"),
    get("session: id of 300 chars", "/sessions/" + "s" * 300, "id"),
    get("storage usage: project_id with a NUL", USAGE + "?project_id=%00", "project_id"),
    get(
        "storage usage: project_id of 10000 chars, a request line over 8 KiB",
        USAGE + "?project_id=" + "p" * 10000,
        r"(?i)project_id|long|bytes",
    ),
    get(
        "download: a non-ASCII signature",
        "{blob_path}?tenant={blob_tenant}&expires={blob_expires}&signature=%C3%A9",
        "signature",
        (400, 403),
    ),
    get(
        "download: no signature",
        "{blob_path}?tenant={blob_tenant}&expires={blob_expires}",
        "signature",
        (400, 403),
    ),
    get(
        "download: expires not a number",
        "{blob_path}?tenant={blob_tenant}&expires=soon&signature={blob_signature}",
        "expires",
        (400, 403),
    ),
    get(
        "download: expired",
        "{blob_path}?tenant={blob_tenant}&expires=1&signature={blob_signature}",
        "expired",
        (400, 403),
    ),
    get(
        "download: expires beyond int64",
        "{blob_path}?tenant={blob_tenant}&expires=" + "9" * 40 + "&signature={blob_signature}",
        "signature|expires",
        (400, 403),
    ),
    get(
        "download: no tenant",
        "{blob_path}?expires={blob_expires}&signature={blob_signature}",
        "tenant",
        (400, 403),
    ),
    get(
        "download: signed for another tenant",
        "{blob_path}?tenant=someone-else&expires={blob_expires}&signature={blob_signature}",
        "signature",
        (400, 403),
    ),
    get(
        "download: a forged signature",
        "{blob_path}?tenant={blob_tenant}&expires={blob_expires}&signature=" + "0" * 64,
        "signature",
        (400, 403),
    ),
]


# -- gRPC requests --------------------------------------------------------------------------------


def g_model(c: Ctx, **fields: Any) -> svc.CreateModelRequest:
    base: dict[str, Any] = {"session_id": c.session_id, "base_model": "tinsmith/tiny"}
    base.update({"lora_rank": 4, "seed": 1, **fields})
    if "model_seq_id" not in base:
        base["model_seq_id"] = c.model_seq()
    return svc.CreateModelRequest(**base)


def g_load(c: Ctx, **fields: Any) -> svc.LoadStateRequest:
    base: dict[str, Any] = {"session_id": c.session_id, "path": c.training_path, **fields}
    if "model_seq_id" not in base:
        base["model_seq_id"] = c.model_seq()
    return svc.LoadStateRequest(**base)


def g_optim(c: Ctx, seq: int | None = None, **adam: float) -> svc.OptimStepRequest:
    params = svc.OptimizerParams(**{"learning_rate": 1e-4, **adam})
    seq_id = c.seq() if seq is None else seq
    return svc.OptimStepRequest(model_id=c.model_id, seq_id=seq_id, adam_params=params)


def g_save(c: Ctx, **fields: Any) -> svc.SaveRequest:
    base: dict[str, Any] = {"model_id": c.model_id, **fields}
    if "path" not in base and "sampling_session_seq_id" not in base:
        base["path"] = c.name()
    if "seq_id" not in base:
        base["seq_id"] = c.seq()
    return svc.SaveRequest(**base)


def g_sampling_session(c: Ctx, **fields: Any) -> svc.CreateSamplingSessionRequest:
    base: dict[str, Any] = {"session_id": c.session_id, "base_model": "tinsmith/tiny", **fields}
    if "sampling_session_seq_id" not in base:
        base["sampling_session_seq_id"] = c.sampler_seq()
    return svc.CreateSamplingSessionRequest(**base)


def g_sample(c: Ctx, params: Mapping[str, Any] | None = None, **fields: Any) -> svc.SampleRequest:
    sampling = tp.SamplingParams(
        **{"max_tokens": 4, "seed": 1, "temperature": 1.0, **(params or {})}
    )
    base: dict[str, Any] = {
        "sampling_session_id": c.sampler_id,
        "prompt": PROMPT,
        "sampling_params": sampling,
        "num_samples": 1,
        **fields,
    }
    if "seq_id" not in base:
        base["seq_id"] = c.sample_seq()
    return svc.SampleRequest(**base)


NO_STOP = tp.StopTokens(values=[])


def big_sample(c: Ctx) -> svc.SampleRequest:
    """num_samples 128 x top-20 logprobs x 500 tokens: a result larger than the bus takes."""
    params = {"max_tokens": 500, "stop_tokens": NO_STOP}
    return g_sample(c, params, num_samples=128, topk_sample_logprobs=20)


def many_tokens(c: Ctx) -> svc.SampleRequest:
    """1024 samples x (3 + 1021) tokens."""
    return g_sample(c, {"max_tokens": 1021, "stop_tokens": NO_STOP}, num_samples=1024)


@dataclass(frozen=True)
class Rpc:
    name: str
    method: str  # "<Service>/<Method>" in tinsmith.v1
    request: Any  # bytes, or Callable[[Ctx], Message | bytes]
    status: Status = 400  # the HTTP status whose gRPC code is expected
    detail: str | None = None
    api_key: str = API_KEY


def rpc(method: str) -> Callable[..., Rpc]:
    """A maker of cases for one method: ``build`` gives the request."""

    def case(
        name: str, build: Callable[[Ctx], Any], detail: str | None, status: Status = 400
    ) -> Rpc:
        return Rpc(f"{method.split('/')[1]}: {name}", method, build, status, detail)

    return case


# A valid request of every method (the test module checks that each is answered with OK).
VALID_RPC: dict[str, Callable[[Ctx], Message]] = {
    "Training/CreateSession": lambda c: svc.CreateSessionRequest(tags=["robust"]),
    "Training/CreateModel": g_model,
    "Training/LoadState": g_load,
    "Training/Forward": fb_request,
    "Training/ForwardBackward": fb_request,
    "Training/OptimStep": g_optim,
    "Training/SaveState": g_save,
    "Training/SaveForSampler": g_save,
    "Sampling/CreateSamplingSession": g_sampling_session,
    "Sampling/Sample": g_sample,
    "Sampling/SampleStream": g_sample,
    "Catalog/ListTrainingRuns": lambda c: svc.ListTrainingRunsRequest(limit=5),
    "Catalog/ListCheckpoints": lambda c: svc.ListCheckpointsRequest(training_run_id=c.run_id),
    "Catalog/GetSession": lambda c: svc.GetSessionRequest(session_id=c.session_id),
}
METHODS = list(VALID_RPC)
STREAMING = {"Sampling/SampleStream"}

create_session_ = rpc("Training/CreateSession")
create_model = rpc("Training/CreateModel")
load_state = rpc("Training/LoadState")
forward = rpc("Training/Forward")
forward_backward = rpc("Training/ForwardBackward")
optim_step = rpc("Training/OptimStep")
save_state = rpc("Training/SaveState")
save_for_sampler = rpc("Training/SaveForSampler")
create_sampling_session = rpc("Sampling/CreateSamplingSession")
sample_ = rpc("Sampling/Sample")
sample_stream = rpc("Sampling/SampleStream")
list_runs = rpc("Catalog/ListTrainingRuns")
list_checkpoints = rpc("Catalog/ListCheckpoints")
get_session = rpc("Catalog/GetSession")


def far(c: Ctx) -> int:
    return c.next_seq + 100_000


def shaped(shape: list[int], values: list[float]) -> Callable[[Ctx], tp.ForwardBackwardRequest]:
    return lambda c: fb_request(c, data=weights_shaped(shape, values))


# Strings of 20000 characters: a detail that echoes one whole is over gRPC's 16 KiB limit on
# the metadata of an answer, which the client then refuses (RESOURCE_EXHAUSTED), every time.
RPC_CASES: list[Rpc] = [
    *(Rpc(f"{m.split('/')[1]}: undecodable bytes", m, GARBAGE, 400) for m in METHODS),
    Rpc(
        "an undecodable request with a secret API key",
        "Training/CreateSession",
        GARBAGE,
        400,
        None,
        SECRET_KEY,
    ),
    # -- Training ---------------------------------------------------------------------------------
    create_session_(
        "tags of several MB", lambda c: svc.CreateSessionRequest(tags=["t" * SEVERAL_MB]), "tags"
    ),
    create_session_(
        "user_metadata of several MB",
        lambda c: svc.CreateSessionRequest(user_metadata=META),
        "user_metadata",
    ),
    create_session_(
        "a message over 8 MiB",
        lambda c: svc.CreateSessionRequest(tags=["t" * OVER_BUS]),
        GRPC_LIMIT_RE,
        413,
    ),
    create_model("lora_rank 100000", lambda c: g_model(c, lora_rank=100000), "rank"),
    create_model("lora_rank negative", lambda c: g_model(c, lora_rank=-4), "rank"),
    create_model("model_seq_id negative", lambda c: g_model(c, model_seq_id=-1), "model_seq_id"),
    create_model(
        "base_model of 20000 chars", lambda c: g_model(c, base_model="m" * 20000), MODEL_RE
    ),
    create_model(
        "base_model with a NUL", lambda c: g_model(c, base_model="tinsmith/tiny\x00"), MODEL_RE
    ),
    create_model(
        "base_model in an unknown home", lambda c: g_model(c, base_model=HOMELESS), MODEL_RE
    ),
    create_model("unknown session", lambda c: g_model(c, session_id="nope"), "nope", 404),
    create_model(
        "user_metadata of several MB", lambda c: g_model(c, user_metadata=META), "user_metadata"
    ),
    load_state(
        "name ending in a newline", lambda c: g_load(c, path=c.training_path + "\n"), NAME_RE
    ),
    load_state(
        "unknown checkpoint",
        lambda c: g_load(c, path=f"tinker://{c.run_id}/weights/nope"),
        "nope",
        404,
    ),
    load_state("model_seq_id negative", lambda c: g_load(c, model_seq_id=-1), "model_seq_id"),
    load_state("not a tinker path", lambda c: g_load(c, path="/etc/passwd"), "tinker://"),
    forward("weights of shape [-1, -1]", shaped([-1, -1], [1.0]), "weights"),
    forward("seq_id far ahead", lambda c: fb_request(c, seq=far(c)), "seq_id", 429),
    forward("unknown run", lambda c: fb_request(c, model_id="nope:train:0", seq=1), "nope", 404),
    forward_backward("weights of shape [-1, -1]", shaped([-1, -1], [1.0]), "weights"),
    forward_backward("weights of shape [2**62, 2**62]", shaped([2**62, 2**62], [1.0]), "weights"),
    forward_backward(
        "weights of shape [2**32, 2**32], no values", shaped([2**32, 2**32], []), "weights"
    ),
    forward_backward("seq_id negative", lambda c: fb_request(c, seq=-5), "seq_id"),
    forward_backward("seq_id far ahead", lambda c: fb_request(c, seq=far(c)), "seq_id", 429),
    forward_backward(
        "loss_fn_config NaN",
        lambda c: fb_request(
            c, data=[ppo_datum()], loss_fn="ppo", config={"clip_low_threshold": NAN}
        ),
        "loss_fn_config",
    ),
    forward_backward(
        "4 datums of 1024 tokens, each over the memory budget",
        lambda c: fb_request(c, data=LONG_DATUMS),
        MEMORY_RE,
        (400, 429),
    ),
    forward_backward("a message over 8 MiB", over_bus, GRPC_LIMIT_RE, 413),
    optim_step("learning_rate NaN", lambda c: g_optim(c, learning_rate=NAN), "learning_rate"),
    optim_step("learning_rate infinity", lambda c: g_optim(c, learning_rate=INF), "learning_rate"),
    optim_step("eps infinity", lambda c: g_optim(c, eps=INF), "eps"),
    optim_step("weight_decay -infinity", lambda c: g_optim(c, weight_decay=-INF), "weight_decay"),
    optim_step("grad_clip_norm NaN", lambda c: g_optim(c, grad_clip_norm=NAN), "grad_clip_norm"),
    optim_step("beta1 NaN", lambda c: g_optim(c, beta1=NAN), "beta1"),
    optim_step("seq_id 0", lambda c: g_optim(c, seq=0), "seq_id"),
    optim_step("seq_id far ahead", lambda c: g_optim(c, seq=far(c)), "seq_id", 429),
    optim_step(
        "unknown run",
        lambda c: svc.OptimStepRequest(model_id="nope:train:0", seq_id=1),
        "nope:train:0",
        404,
    ),
    save_state("name ending in a newline", lambda c: g_save(c, path="step1\n"), NAME_RE),
    save_state("name of 20000 chars", lambda c: g_save(c, path="n" * 20000), NAME_RE),
    save_state("ttl_seconds 2**62", lambda c: g_save(c, ttl_seconds=2**62), "ttl_seconds"),
    save_state("ttl_seconds negative", lambda c: g_save(c, ttl_seconds=-1), "ttl_seconds"),
    save_state(
        "user_metadata of several MB", lambda c: g_save(c, user_metadata=META), "user_metadata"
    ),
    save_state("seq_id far ahead", lambda c: g_save(c, seq_id=far(c)), "seq_id", 429),
    save_state(
        "unknown run", lambda c: g_save(c, model_id="nope:train:0", seq_id=1), "nope:train:0", 404
    ),
    save_for_sampler("name ending in a newline", lambda c: g_save(c, path="s1\n"), NAME_RE),
    save_for_sampler(
        "sampling_session_seq_id negative",
        lambda c: g_save(c, sampling_session_seq_id=-1),
        "sampling_session_seq_id",
    ),
    # -- Sampling ---------------------------------------------------------------------------------
    create_sampling_session(
        "sampling_session_seq_id negative",
        lambda c: g_sampling_session(c, sampling_session_seq_id=-1),
        "sampling_session_seq_id",
    ),
    create_sampling_session(
        "base_model with a NUL",
        lambda c: g_sampling_session(c, base_model="tinsmith/tiny\x00"),
        MODEL_RE,
    ),
    create_sampling_session(
        "base_model in an unknown home",
        lambda c: g_sampling_session(c, base_model=HOMELESS),
        MODEL_RE,
    ),
    create_sampling_session(
        "model_path ending in a newline",
        lambda c: g_sampling_session(c, base_model="", model_path=c.sampler_path + "\n"),
        NAME_RE,
    ),
    create_sampling_session(
        "unknown session", lambda c: g_sampling_session(c, session_id="nope"), "nope", 404
    ),
    sample_("temperature NaN", lambda c: g_sample(c, {"temperature": NAN}), "temperature"),
    sample_("temperature infinity", lambda c: g_sample(c, {"temperature": INF}), "temperature"),
    sample_("top_p NaN", lambda c: g_sample(c, {"top_p": NAN}), "top_p"),
    sample_("max_tokens negative", lambda c: g_sample(c, {"max_tokens": -1}), "max_tokens"),
    sample_("top_k 0", lambda c: g_sample(c, {"top_k": 0}), "top_k"),
    sample_("seq_id negative", lambda c: g_sample(c, seq_id=-1), "seq_id"),
    sample_("empty prompt", lambda c: g_sample(c, prompt=[]), "prompt"),
    sample_("num_samples negative", lambda c: g_sample(c, num_samples=-1), "num_samples"),
    sample_(
        "stop token id 2**31 - 1",
        lambda c: g_sample(c, {"stop_tokens": tp.StopTokens(values=[I32 - 1])}),
        "stop",
    ),
    sample_(
        "unknown sampler",
        lambda c: g_sample(c, sampling_session_id="nope:sample:0"),
        "nope:sample:0",
        404,
    ),
    sample_("1024 samples x 1021 tokens", many_tokens, TOKENS_RE, (400, 429)),
    sample_("a result too large to store", big_sample, SIZE_RE),
    sample_stream("temperature NaN", lambda c: g_sample(c, {"temperature": NAN}), "temperature"),
    sample_stream("a result too large to store", big_sample, SIZE_RE),
    sample_stream(
        "unknown sampler",
        lambda c: g_sample(c, sampling_session_id="nope:sample:0"),
        "nope:sample:0",
        404,
    ),
    # -- Catalog ----------------------------------------------------------------------------------
    list_runs("limit negative", lambda c: svc.ListTrainingRunsRequest(limit=-1), "limit"),
    list_runs("offset negative", lambda c: svc.ListTrainingRunsRequest(offset=-1), "offset"),
    list_checkpoints("bad id", lambda c: svc.ListCheckpointsRequest(training_run_id="a b"), "id"),
    list_checkpoints(
        "id of 20000 chars",
        lambda c: svc.ListCheckpointsRequest(training_run_id="r" * 20000),
        "id",
    ),
    list_checkpoints(
        "unknown run",
        lambda c: svc.ListCheckpointsRequest(training_run_id="nope:train:0"),
        "nope:train:0",
        404,
    ),
    get_session("unknown", lambda c: svc.GetSessionRequest(session_id="nope"), "nope", 404),
    get_session("id of 300 chars", lambda c: svc.GetSessionRequest(session_id="s" * 300), "id"),
    get_session(
        "id ending in a newline",
        lambda c: svc.GetSessionRequest(session_id=c.session_id + "\n"),
        "id",
    ),
]


def settle(
    http: httpx.Client,
    request_id: str,
    timeout_s: float,
    headers: Mapping[str, str] | None = None,
) -> httpx.Response:
    """retrieve_future until the request has an outcome (a result or a failure)."""
    deadline = time.monotonic() + timeout_s
    while True:
        reply = http.post(
            "/api/v1/retrieve_future",
            json={"request_id": request_id, "allow_metadata_only": False},
            headers={"Accept": "application/x-protobuf", **(headers or {})},
        )
        pending = reply.status_code == 408 or (
            reply.status_code == 200
            and reply.headers.get("content-type", "").startswith("application/json")
            and reply.json().get("type") == "try_again"
        )
        if not pending:
            return reply
        assert time.monotonic() < deadline, f"{request_id} has no outcome after {timeout_s} s"
