"""Tenancy end to end (issue 14): one ``tinsmith up`` in ``TINSMITH_AUTH=keys`` mode, keys issued
through the event log for alice, bob, a second alice key (revoked before the matrix runs) and an
admin; alice sets up a session, runs, checkpoints (private, published, external), a sampler and
futures with the official SDK and plain HTTP.

The matrix: every operation of every face (the Tinker HTTP routes, the REST catalog, gRPC) as
alice (it works), as bob (404 / NOT_FOUND, answered exactly as a made-up id of the same shape is,
and nothing else in the body), without a key (401 / UNAUTHENTICATED) and with the revoked key
(401 / UNAUTHENTICATED, saying it was revoked). Operations that name nothing of alice's (a new
session, the lists, the usage) answer bob with bob's own things, none of alice's. Then the one
exception (published checkpoints: any tenant may sample, load, inspect and download them, and
sees nothing else of their run), the signed downloads, the usage views, unknown keys, the health
check, seq_ids that another tenant cannot take, and a key's own quota.

Keys are issued and revoked as ``tinsmith keys`` does it (tinsmith/keyadmin.py: ``KeyIssued`` and
``KeyRevoked`` appended to the log), on the NATS that ``tinsmith up`` records in its data dir.
"""

from __future__ import annotations

import asyncio
import itertools
import re
import secrets
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, fields
from typing import Any

import grpc
import httpx
import pytest
import tinker
from grpc_health.v1 import health_pb2, health_pb2_grpc
from tinker import types

from tests.conftest import RunningSystem, start_system, stop_system
from tests.e2e import robustness_cases
from tests.e2e.robustness_cases import PROMPT, PROTOBUF, TOKENS, datum, varint
from tinsmith import keyadmin, tenants
from tinsmith._proto import bus_pb2 as bus
from tinsmith._proto import service_pb2 as svc
from tinsmith._proto import service_pb2_grpc as stubs
from tinsmith._proto import tinker_public_pb2 as tp
from tinsmith.bus import MAX_BODY_BYTES
from tinsmith.keyadmin import KeyAdmin, Source

API = "/api/v1"
# A short long-poll: the owner's retrieve_future of a request that never settles answers 408 soon.
ENV = {"TINSMITH_AUTH": "keys", "TINSMITH_LONG_POLL_S": "2"}
BASE = "tinsmith/tiny"
RANK = 4
LORA = {"rank": RANK, "seed": 1, "train_mlp": True, "train_attn": True, "train_unembed": True}
SAMPLING: dict[str, Any] = {"max_tokens": 4, "seed": 1, "temperature": 1.0}

OWNER, OTHER, NO_KEY, REVOKED = "owner", "other-tenant", "no-key", "revoked-key"
WHO = (OWNER, OTHER, NO_KEY, REVOKED)
UUID = re.compile(r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}")
# Every private checkpoint of alice's is named secret-*, every published one shared-*.
SECRET = "secret"

# -- keys, through the log ---------------------------------------------------------------------


def issue(
    system: RunningSystem,
    tenant: str,
    *,
    admin: bool = False,
    quotas: bus.Quotas | None = None,
    label: str = "",
) -> tuple[str, str]:
    """A new key for ``tenant``, as ``tinsmith keys create`` issues it: the key and its id."""

    async def run() -> tuple[str, str]:
        async with KeyAdmin.connect(_source(system)) as keys:
            issued, row = await keys.issue(
                tenant, admin=admin, overrides=quotas or bus.Quotas(), label=label
            )
        return issued, row.key_id

    return asyncio.run(run())


def revoke(system: RunningSystem, key_id: str) -> None:
    """What ``tinsmith keys revoke`` does."""

    async def run() -> None:
        async with KeyAdmin.connect(_source(system)) as keys:
            _, already = await keys.revoke(key_id, "tenancy test")
        assert not already

    asyncio.run(run())


def _source(system: RunningSystem) -> Source:
    """The system's NATS, as ``tinsmith up`` recorded it in its data directory."""
    return keyadmin.locate(None, system.data_dir, environ={})


# -- what the cases name -----------------------------------------------------------------------


@dataclass(frozen=True)
class Ids:
    """Alice's things. ``made_up()``: the same ids with made-up session ids (every other id of
    hers derives from a session id), so that each names nothing that exists."""

    session: str  # S: a session made with plain HTTP
    sdk_session: str  # the SDK's session
    run: str  # A: the SDK's run, which holds the checkpoints below
    model: str  # B: a run in S that only the cases drive (they choose its seq_ids)
    pending_run: str  # C: a run in S whose request 2 waits for a request 1 that never comes
    sampler: str  # Z: a sampler in S on secret-sampler
    sample_request: str  # Z's settled sample request
    training_path: str  # secret-state (save_state)
    sampler_path: str  # secret-sampler (save_weights_for_sampler)
    external_path: str  # secret-ext (save_weights_external)
    victim_path: str  # secret-victim: what bob tries to delete, publish, re-TTL
    toggle_path: str  # secret-toggle: what alice publishes and unpublishes
    shared_path: str  # shared: published
    shared_victim_path: str  # shared-victim: published; what bob tries to change
    revocable_path: str  # shared-revocable: published, unpublished by the download test
    fake: bool = False

    def made_up(self) -> Ids:
        swap = {self.session: str(uuid.uuid4()), self.sdk_session: str(uuid.uuid4())}

        def sub(value: str) -> str:
            for real, fake in swap.items():
                value = value.replace(real, fake)
            return value

        values = {f.name: sub(getattr(self, f.name)) for f in fields(self) if f.name != "fake"}
        return Ids(**values, fake=True)


@dataclass
class World:
    system: RunningSystem
    http: httpx.Client
    channel: grpc.Channel
    keys: dict[str, str | None]  # who -> the key it calls with
    admin_key: str
    alice: Ids
    training: Any  # alice's SDK TrainingClient of run A (throwaway checkpoints)
    bob_session: str
    bob_model: str  # bob's run, rank 4
    b_next: int  # the next seq_id of alice's run B
    bob_next: int  # the next seq_id of bob's run
    counters: dict[str, Iterator[int]] = field(default_factory=dict)

    def next(self, name: str, start: int = 0) -> int:
        """A fresh value of the counter ``name`` (model_seq_ids, sampler seq_ids, names)."""
        return next(self.counters.setdefault(name, itertools.count(start)))

    def bob_seq(self) -> int:
        self.bob_next += 1
        return self.bob_next - 1

    def throwaway_session(self, ids: Ids) -> str:
        """A session of alice's to finish (or, for made-up ids, a session id nobody has)."""
        if ids.fake:
            return str(uuid.uuid4())
        reply = self.http.post(API + "/create_session", json={}, headers=key(self.keys[OWNER]))
        assert reply.status_code == 200, reply.text
        return str(reply.json()["session_id"])

    def throwaway_checkpoint(self, *, published: bool = False) -> str:
        path = str(self.training.save_state(f"{SECRET}-bin-{self.next('bin')}").result(60).path)
        if published:
            reply = self.http.post(API + route(path) + "/publish", headers=key(self.keys[OWNER]))
            assert reply.status_code == 200, reply.text
        return path


def key(value: str | None) -> dict[str, str]:
    return {"X-API-Key": value} if value else {}


def route(tinker_path: str) -> str:
    """The REST route of a checkpoint: /training_runs/<run>/checkpoints/<segment>/<name>."""
    run, segment, name = tinker_path.removeprefix("tinker://").split("/")
    return f"/training_runs/{run}/checkpoints/{segment}/{name}"


@dataclass
class Answer:
    status: int | str  # the HTTP status, or the gRPC code's name
    detail: str = ""
    body: Any = None  # HTTP: the JSON body; gRPC: the response
    text: str = ""  # everything that came back, to look for what must not be there
    outcome: httpx.Response | None = None  # the owner's future, settled

    @property
    def refused_early(self) -> bool:
        """Refused before the operation spent anything (a seq_id)."""
        return self.status in (401, 404, "UNAUTHENTICATED", "NOT_FOUND")


def _ready(client: Any) -> Any:
    return client.result() if hasattr(client, "result") else client


def _sdk_datum() -> types.Datum:
    inputs: Any = {"target_tokens": TOKENS[1:], "weights": [1.0] * (len(TOKENS) - 1)}
    return types.Datum(
        model_input=types.ModelInput.from_ints(TOKENS[:-1]),
        loss_fn_inputs=inputs,
    )


def settle(
    http: httpx.Client, api_key: str | None, request_id: str, timeout_s: float = 120
) -> httpx.Response:
    """retrieve_future, as ``api_key``'s tenant, until the request has an outcome."""
    return robustness_cases.settle(http, request_id, timeout_s, headers=key(api_key))


def succeeded(outcome: httpx.Response) -> bool:
    """A settled future that is a result, not a failure."""
    if outcome.status_code != 200:
        return False
    if not outcome.headers.get("content-type", "").startswith("application/json"):
        return True  # protobuf: a forward_backward or sample result
    body = outcome.json()
    return isinstance(body, dict) and "error" not in body


def accepted(reply: httpx.Response) -> dict[str, Any]:
    assert reply.status_code == 200, f"{reply.status_code}: {reply.text[:300]}"
    body = reply.json()
    assert isinstance(body, dict)
    return body


# -- the system --------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def w(tmp_path_factory: pytest.TempPathFactory) -> Iterator[World]:
    system = start_system(tmp_path_factory.mktemp("tenancy"), env=ENV)
    service: Any = None
    try:
        alice, _ = issue(system, "alice")
        bob, _ = issue(system, "bob")
        alice2, alice2_id = issue(system, "alice", label="alice's second key")
        admin, _ = issue(system, "ops", admin=True)
        http = httpx.Client(base_url=system.url, timeout=120)
        channel = grpc.insecure_channel(system.grpc_target)
        grpc.channel_ready_future(channel).result(timeout=30)

        # Alice, with the SDK: a run with a step, and checkpoints of every kind.
        service = tinker.ServiceClient(base_url=system.url, api_key=alice)
        training = _ready(service.create_lora_training_client(BASE, rank=RANK, seed=1))
        training.forward_backward([_sdk_datum()], "cross_entropy").result(timeout=120)
        training.optim_step(types.AdamParams(learning_rate=1e-3)).result(timeout=120)

        def saved(future: Any) -> str:
            return str(future.result(timeout=120).path)

        paths: dict[str, Any] = {
            "training_path": saved(training.save_state(f"{SECRET}-state")),
            "sampler_path": saved(training.save_weights_for_sampler(f"{SECRET}-sampler")),
            "external_path": saved(training.save_weights_external(f"{SECRET}-ext")),
            "victim_path": saved(training.save_state(f"{SECRET}-victim")),
            "toggle_path": saved(training.save_state(f"{SECRET}-toggle")),
            "shared_path": saved(training.save_weights_for_sampler("shared")),
            "shared_victim_path": saved(training.save_weights_for_sampler("shared-victim")),
            "revocable_path": saved(training.save_weights_for_sampler("shared-revocable")),
        }
        rest = tinker.RestClient(base_url=system.url, api_key=alice)
        for name in ("shared_path", "shared_victim_path", "revocable_path"):
            rest.publish_checkpoint_from_tinker_path(paths[name]).result(timeout=60)

        # Alice, with plain HTTP: a session, runs and a sampler whose seq_ids the cases choose.
        as_alice = key(alice)
        session = accepted(http.post(API + "/create_session", json={}, headers=as_alice))
        session_id = session["session_id"]

        def new_run(api_key: str, session: str, model_seq: int) -> str:
            body = {"session_id": session, "model_seq_id": model_seq, "base_model": BASE}
            reply = accepted(
                http.post(
                    API + "/create_model", json={**body, "lora_config": LORA}, headers=key(api_key)
                )
            )
            assert succeeded(settle(http, api_key, reply["request_id"]))
            return str(reply["model_id"])

        model = new_run(alice, session_id, 0)
        pending_run = new_run(alice, session_id, 1)
        step = {"model_id": pending_run, "seq_id": 2, "adam_params": {"learning_rate": 1e-4}}
        accepted(http.post(API + "/optim_step", json=step, headers=as_alice))  # waits for seq 1
        sampler = accepted(
            http.post(
                API + "/create_sampling_session",
                json={
                    "session_id": session_id,
                    "sampling_session_seq_id": 0,
                    "model_path": paths["sampler_path"],
                },
                headers=as_alice,
            )
        )["sampling_session_id"]
        sample = accepted(http.post(API + "/asample", json=_sample(sampler, 0), headers=as_alice))
        assert succeeded(settle(http, alice, sample["request_id"]))

        # Bob: a session, a run (rank 4, so that loading alice's weights is only a matter of
        # whose they are) and a checkpoint of his own.
        bob_session = accepted(http.post(API + "/create_session", json={}, headers=key(bob)))
        bob_model = new_run(bob, bob_session["session_id"], 0)
        save = {"model_id": bob_model, "seq_id": 1, "path": "bob-state"}
        saved_bob = accepted(http.post(API + "/save_weights", json=save, headers=key(bob)))
        assert succeeded(settle(http, bob, saved_bob["request_id"]))

        # alice2 is alice's until it is revoked.
        beat = http.post(
            API + "/session_heartbeat", json={"session_id": session_id}, headers=key(alice2)
        )
        assert beat.status_code == 200, beat.text
        revoke(system, alice2_id)
        # Until the gateway has folded the revocation; if it never refuses the key, the matrix's
        # revoked-key cases say so, one by one.
        deadline = time.monotonic() + 10
        while beat.status_code == 200 and time.monotonic() < deadline:
            time.sleep(0.1)
            beat = http.post(
                API + "/session_heartbeat", json={"session_id": session_id}, headers=key(alice2)
            )

        world = World(
            system=system,
            http=http,
            channel=channel,
            keys={OWNER: alice, OTHER: bob, NO_KEY: None, REVOKED: alice2},
            admin_key=admin,
            alice=Ids(
                session=session_id,
                sdk_session=training.model_id.split(":")[0],
                run=training.model_id,
                model=model,
                pending_run=pending_run,
                sampler=sampler,
                sample_request=sample["request_id"],
                **paths,
            ),
            training=training,
            bob_session=bob_session["session_id"],
            bob_model=bob_model,
            b_next=1,
            bob_next=2,
        )
        world.counters["alice model"] = itertools.count(2)
        world.counters["alice sampler"] = itertools.count(1)
        world.counters["bob model"] = itertools.count(1)
        world.counters["sample"] = itertools.count(1)
        yield world
        channel.close()
        http.close()
    finally:
        if service is not None:
            service.close("success").result(timeout=30)
        stop_system(system)


def _sample(sampler: str, seq: int) -> dict[str, Any]:
    return {
        "sampling_session_id": sampler,
        "seq_id": seq,
        "num_samples": 1,
        "prompt": {"chunks": [{"type": "encoded_text", "tokens": PROMPT}]},
        "sampling_params": SAMPLING,
    }


# -- sending -----------------------------------------------------------------------------------


def send(
    w: World,
    who: str,
    method: str,
    path: str,
    body: Any = None,
    *,
    future: bool = False,
    protobuf: bytes | None = None,
    api_key: str | None = None,
) -> Answer:
    """One HTTP request as ``who``; the owner's accepted future is settled."""
    api_key = api_key if api_key is not None else w.keys[who]
    headers = key(api_key)
    if protobuf is not None:
        reply = w.http.request(
            method, API + path, content=protobuf, headers={**headers, **PROTOBUF}
        )
    else:
        reply = w.http.request(method, API + path, json=body, headers=headers)
    try:
        parsed = reply.json()
    except ValueError:
        parsed = None
    detail = parsed.get("detail") if isinstance(parsed, dict) else None
    answer = Answer(
        reply.status_code, detail if isinstance(detail, str) else "", parsed, reply.text
    )
    if future and who == OWNER and reply.status_code == 200 and isinstance(parsed, dict):
        answer.outcome = settle(w.http, api_key, parsed["request_id"])
    return answer


def rpc(w: World, who: str, method: str, request: Any, *, api_key: str | None = None) -> Answer:
    """One gRPC call (``Service/Method``) as ``who``; a stream is read to its end."""
    service, name = method.split("/")
    stub = getattr(stubs, f"{service}Stub")(w.channel)
    api_key = api_key if api_key is not None else w.keys[who]
    metadata = [("x-api-key", api_key)] if api_key else []
    try:
        response = getattr(stub, name)(request, timeout=120, metadata=metadata)
        if name == "SampleStream":
            response = list(response)
    except grpc.RpcError as error:
        return Answer(error.code().name, error.details() or "")
    text = response.json if isinstance(response, svc.CatalogDocument) else str(response)
    return Answer("OK", "", response, text)


def own_session(w: World, who: str, ids: Ids) -> str:
    """The caller's own session: bob's for bob, alice's otherwise."""
    return w.bob_session if who == OTHER else ids.session


def model_seq(w: World, who: str) -> int:
    return w.next("bob model" if who == OTHER else "alice model")


def fb_proto(model_id: str, seq: int, *, forward_only: bool) -> tp.ForwardBackwardRequest:
    return tp.ForwardBackwardRequest(
        model_id=model_id,
        seq_id=seq,
        data=[datum()],
        loss_fn="cross_entropy",
        forward_only=forward_only,
    )


# -- the cases ---------------------------------------------------------------------------------

HIDDEN = "hidden"  # bob: 404 / NOT_FOUND, exactly as for a made-up id
OWN = "own"  # bob: his own answer, with nothing of alice's in it


@dataclass(frozen=True)
class Case:
    name: str
    send: Callable[[World, str, Ids], Answer]
    other: str = HIDDEN
    seq: bool = False  # the owner's call spends the next seq_id of alice's run B
    owner_statuses: tuple[int | str, ...] = (200, "OK")


def _http_cases() -> list[Case]:
    def create_model(w: World, who: str, ids: Ids) -> Answer:
        body = {
            "session_id": ids.session,
            "model_seq_id": w.next("alice model"),
            "base_model": BASE,
            "lora_config": LORA,
        }
        return send(w, who, "POST", "/create_model", body, future=True)

    def load_create(w: World, who: str, ids: Ids) -> Answer:
        body = {
            "session_id": ids.session,
            "model_seq_id": w.next("alice model"),
            "path": ids.training_path,
            "optimizer": True,
        }
        return send(w, who, "POST", "/load_weights", body, future=True)

    def load_create_own_session(w: World, who: str, ids: Ids) -> Answer:
        body = {
            "session_id": own_session(w, who, ids),
            "model_seq_id": model_seq(w, who),
            "path": ids.training_path,
            "optimizer": True,
        }
        return send(w, who, "POST", "/load_weights", body, future=True)

    def load_into(w: World, who: str, ids: Ids) -> Answer:
        body = {"model_id": ids.model, "seq_id": w.b_next, "path": ids.training_path}
        return send(w, who, "POST", "/load_weights", {**body, "optimizer": True}, future=True)

    def load_into_own_run(w: World, who: str, ids: Ids) -> Answer:
        # Bob's refusal spends his run's seq_id (it is his run): each of his tries takes a new one.
        run, seq = (w.bob_model, w.bob_seq()) if who == OTHER else (ids.model, w.b_next)
        body = {"model_id": run, "seq_id": seq, "path": ids.training_path, "optimizer": True}
        return send(w, who, "POST", "/load_weights", body, future=True)

    def get_info(w: World, who: str, ids: Ids) -> Answer:
        return send(w, who, "POST", "/get_info", {"model_id": ids.model})

    def forward(w: World, who: str, ids: Ids) -> Answer:
        proto = fb_proto(ids.model, w.b_next, forward_only=True).SerializeToString()
        return send(w, who, "POST", "/forward_backward", protobuf=proto, future=True)

    def forward_backward(w: World, who: str, ids: Ids) -> Answer:
        proto = fb_proto(ids.model, w.b_next, forward_only=False).SerializeToString()
        return send(w, who, "POST", "/forward_backward", protobuf=proto, future=True)

    def optim_step(w: World, who: str, ids: Ids) -> Answer:
        body = {"model_id": ids.model, "seq_id": w.b_next, "adam_params": {"learning_rate": 1e-4}}
        return send(w, who, "POST", "/optim_step", body, future=True)

    def save(route_name: str, name: str) -> Callable[[World, str, Ids], Answer]:
        def case(w: World, who: str, ids: Ids) -> Answer:
            body = {"model_id": ids.model, "seq_id": w.b_next, "path": name, "overwrite": True}
            return send(w, who, "POST", route_name, body, future=True)

        return case

    def create_sampler(w: World, who: str, ids: Ids) -> Answer:
        body = {
            "session_id": ids.session,
            "sampling_session_seq_id": w.next("alice sampler"),
            "base_model": BASE,
        }
        return send(w, who, "POST", "/create_sampling_session", body)

    def create_sampler_own_session(w: World, who: str, ids: Ids) -> Answer:
        body = {
            "session_id": own_session(w, who, ids),
            "sampling_session_seq_id": w.next("bob sampler" if who == OTHER else "alice sampler"),
            "model_path": ids.sampler_path,
        }
        return send(w, who, "POST", "/create_sampling_session", body)

    def asample(w: World, who: str, ids: Ids) -> Answer:
        return send(w, who, "POST", "/asample", _sample(ids.sampler, w.next("sample")), future=True)

    def retrieve(request_id: Callable[[Ids], str]) -> Callable[[World, str, Ids], Answer]:
        def case(w: World, who: str, ids: Ids) -> Answer:
            body = {"request_id": request_id(ids), "allow_metadata_only": False}
            return send(w, who, "POST", "/retrieve_future", body)

        return case

    def get_sampler(w: World, who: str, ids: Ids) -> Answer:
        return send(w, who, "GET", f"/samplers/{ids.sampler}")

    def heartbeat(w: World, who: str, ids: Ids) -> Answer:
        return send(w, who, "POST", "/session_heartbeat", {"session_id": ids.session})

    def finish(w: World, who: str, ids: Ids) -> Answer:
        session = w.throwaway_session(ids)
        answer = send(
            w, who, "POST", f"/sessions/{session}/finish", {"reason": {"type": "success"}}
        )
        if who != OWNER and not ids.fake:  # the session is still alice's, and open
            beat = send(w, OWNER, "POST", "/session_heartbeat", {"session_id": session})
            assert beat.status == 200, f"alice's session is gone after {who}'s finish: {beat.text}"
        return answer

    return [
        Case("http create_model", create_model),
        Case("http load_weights create in alice's session", load_create),
        Case("http load_weights create from alice's private checkpoint", load_create_own_session),
        Case("http load_weights into alice's run", load_into, seq=True),
        Case("http load_weights into own run from alice's private", load_into_own_run, seq=True),
        Case("http get_info", get_info),
        Case("http forward", forward, seq=True),
        Case("http forward_backward", forward_backward, seq=True),
        Case("http optim_step", optim_step, seq=True),
        Case("http save_weights", save("/save_weights", f"{SECRET}-http-state"), seq=True),
        Case(
            "http save_weights_for_sampler",
            save("/save_weights_for_sampler", f"{SECRET}-http-sampler"),
            seq=True,
        ),
        Case(
            "http save_weights_external",
            save("/save_weights_external", f"{SECRET}-http-ext"),
            seq=True,
        ),
        Case("http create_sampling_session in alice's session", create_sampler),
        Case(
            "http create_sampling_session from alice's private checkpoint",
            create_sampler_own_session,
        ),
        Case("http asample", asample),
        Case("http retrieve_future of a sample", retrieve(lambda ids: ids.sample_request)),
        Case("http retrieve_future of a training request", retrieve(lambda ids: f"{ids.model}:0")),
        Case(
            "http retrieve_future of a pending request",
            retrieve(lambda ids: f"{ids.pending_run}:2"),
            owner_statuses=(408,),
        ),
        Case("http GET samplers", get_sampler),
        Case("http session_heartbeat", heartbeat),
        Case("http sessions finish", finish),
    ]


def as_alice_sees(w: World, tinker_path: str) -> dict[str, Any] | None:
    """The checkpoint as its owner lists it (None: it is gone)."""
    run = tinker_path.removeprefix("tinker://").split("/")[0]
    listed = send(w, OWNER, "GET", f"/training_runs/{run}/checkpoints")
    assert listed.status == 200, listed.text
    found = [c for c in listed.body["checkpoints"] if c["tinker_path"] == tinker_path]
    return found[0] if found else None


def unchanged(w: World, ids: Ids, tinker_path: str, change: Callable[[], Answer]) -> Answer:
    """``change()``, tried by someone else on alice's checkpoint: it must leave it as it was."""
    if ids.fake:
        return change()
    before = as_alice_sees(w, tinker_path)
    assert before is not None, f"{tinker_path} is gone before the case"
    answer = change()
    after = as_alice_sees(w, tinker_path)
    assert after == before, f"{tinker_path} changed: {before} -> {after}; the call: {answer}"
    return answer


def _rest_cases() -> list[Case]:
    def get(path: Callable[[Ids], str]) -> Callable[[World, str, Ids], Answer]:
        return lambda w, who, ids: send(w, who, "GET", path(ids))

    def throwaway(published: bool) -> Callable[[World, str, Ids], Answer]:
        def case(w: World, who: str, ids: Ids) -> Answer:
            if who == OWNER:
                path = w.throwaway_checkpoint(published=published)
                answer = send(w, who, "DELETE", route(path))
                if answer.status == 200:
                    gone = send(w, OWNER, "POST", "/weights_info", {"tinker_path": path})
                    assert gone.status == 404, f"deleted, yet {gone.status}: {gone.text}"
                return answer
            path = ids.shared_victim_path if published else ids.victim_path
            return unchanged(w, ids, path, lambda: send(w, who, "DELETE", route(path)))

        return case

    def toggled(
        method: str, suffix: str, others: Callable[[Ids], str], body: Any = None
    ) -> Callable[[World, str, Ids], Answer]:
        """Publish, unpublish or TTL: the owner's is on secret-toggle (left private after),
        everyone else's on ``others``."""

        def case(w: World, who: str, ids: Ids) -> Answer:
            if who == OWNER:
                path = ids.toggle_path
                if suffix == "/publish" and method == "DELETE":
                    published = send(w, OWNER, "POST", route(path) + "/publish")
                    assert published.status == 200, published.text
                answer = send(w, who, method, route(path) + suffix, body)
                private = send(w, OWNER, "DELETE", route(path) + "/publish")
                assert private.status == 200, private.text
                return answer
            path = others(ids)
            return unchanged(w, ids, path, lambda: send(w, who, method, route(path) + suffix, body))

        return case

    def weights_info(path: Callable[[Ids], str]) -> Callable[[World, str, Ids], Answer]:
        return lambda w, who, ids: send(w, who, "POST", "/weights_info", {"tinker_path": path(ids)})

    ttl = {"ttl_seconds": 7200}
    return [
        Case("rest GET training_run", get(lambda ids: f"/training_runs/{ids.run}")),
        Case(
            "rest GET training_run accessible without a published checkpoint",
            get(lambda ids: f"/training_runs/{ids.model}?access_scope=accessible"),
        ),
        Case("rest GET checkpoints", get(lambda ids: f"/training_runs/{ids.run}/checkpoints")),
        Case(
            "rest GET checkpoints accessible without a published checkpoint",
            get(lambda ids: f"/training_runs/{ids.model}/checkpoints?access_scope=accessible"),
        ),
        Case("rest GET session", get(lambda ids: f"/sessions/{ids.session}")),
        Case("rest DELETE checkpoint", throwaway(published=False)),
        Case("rest DELETE published checkpoint", throwaway(published=True)),
        Case("rest publish", toggled("POST", "/publish", lambda ids: ids.victim_path)),
        Case("rest unpublish", toggled("DELETE", "/publish", lambda ids: ids.shared_victim_path)),
        Case("rest ttl", toggled("PUT", "/ttl", lambda ids: ids.victim_path, ttl)),
        Case(
            "rest ttl of a published checkpoint",
            toggled("PUT", "/ttl", lambda ids: ids.shared_victim_path, ttl),
        ),
        Case("rest weights_info", weights_info(lambda ids: ids.training_path)),
        Case("rest weights_info of sampler weights", weights_info(lambda ids: ids.sampler_path)),
        Case(
            "rest external_weights_urls",
            get(lambda ids: route(ids.external_path) + "/external_weights_urls"),
        ),
        Case(
            "rest external_weights_urls of sampler weights",
            get(lambda ids: route(ids.sampler_path) + "/external_weights_urls"),
        ),
    ]


def _grpc_cases() -> list[Case]:
    def create_model(w: World, who: str, ids: Ids) -> Answer:
        request = svc.CreateModelRequest(
            session_id=ids.session,
            model_seq_id=w.next("alice model"),
            base_model=BASE,
            lora_rank=RANK,
        )
        return rpc(w, who, "Training/CreateModel", request)

    def load_state(session: Callable[[World, str, Ids], str]) -> Callable[..., Answer]:
        def case(w: World, who: str, ids: Ids) -> Answer:
            request = svc.LoadStateRequest(
                session_id=session(w, who, ids),
                model_seq_id=model_seq(w, who) if session is own_session else w.next("alice model"),
                path=ids.training_path,
                with_optimizer=True,
            )
            return rpc(w, who, "Training/LoadState", request)

        return case

    def fb(method: str, forward_only: bool) -> Callable[[World, str, Ids], Answer]:
        return lambda w, who, ids: rpc(
            w, who, method, fb_proto(ids.model, w.b_next, forward_only=forward_only)
        )

    def optim(w: World, who: str, ids: Ids) -> Answer:
        request = svc.OptimStepRequest(
            model_id=ids.model,
            seq_id=w.b_next,
            adam_params=svc.OptimizerParams(learning_rate=1e-4),
        )
        return rpc(w, who, "Training/OptimStep", request)

    def save(method: str, name: str) -> Callable[[World, str, Ids], Answer]:
        return lambda w, who, ids: rpc(
            w,
            who,
            method,
            svc.SaveRequest(model_id=ids.model, seq_id=w.b_next, path=name, overwrite=True),
        )

    def create_sampler(w: World, who: str, ids: Ids) -> Answer:
        request = svc.CreateSamplingSessionRequest(
            session_id=ids.session,
            sampling_session_seq_id=w.next("alice sampler"),
            base_model=BASE,
        )
        return rpc(w, who, "Sampling/CreateSamplingSession", request)

    def create_sampler_own_session(w: World, who: str, ids: Ids) -> Answer:
        request = svc.CreateSamplingSessionRequest(
            session_id=own_session(w, who, ids),
            sampling_session_seq_id=w.next("bob sampler" if who == OTHER else "alice sampler"),
            model_path=ids.sampler_path,
        )
        return rpc(w, who, "Sampling/CreateSamplingSession", request)

    def sample(method: str) -> Callable[[World, str, Ids], Answer]:
        def case(w: World, who: str, ids: Ids) -> Answer:
            request = svc.SampleRequest(
                sampling_session_id=ids.sampler,
                seq_id=w.next("sample"),
                prompt=PROMPT,
                sampling_params=tp.SamplingParams(**SAMPLING),
                num_samples=1,
            )
            return rpc(w, who, method, request)

        return case

    def alices_session(w: World, who: str, ids: Ids) -> str:
        return ids.session

    return [
        Case("grpc CreateModel", create_model),
        Case("grpc LoadState in alice's session", load_state(alices_session)),
        Case("grpc LoadState from alice's private checkpoint", load_state(own_session)),
        Case("grpc Forward", fb("Training/Forward", True), seq=True),
        Case("grpc ForwardBackward", fb("Training/ForwardBackward", False), seq=True),
        Case("grpc OptimStep", optim, seq=True),
        Case("grpc SaveState", save("Training/SaveState", f"{SECRET}-grpc-state"), seq=True),
        Case(
            "grpc SaveForSampler",
            save("Training/SaveForSampler", f"{SECRET}-grpc-sampler"),
            seq=True,
        ),
        Case("grpc CreateSamplingSession in alice's session", create_sampler),
        Case(
            "grpc CreateSamplingSession from alice's private checkpoint",
            create_sampler_own_session,
        ),
        Case("grpc Sample", sample("Sampling/Sample")),
        Case("grpc SampleStream", sample("Sampling/SampleStream")),
        Case(
            "grpc ListCheckpoints",
            lambda w, who, ids: rpc(
                w,
                who,
                "Catalog/ListCheckpoints",
                svc.ListCheckpointsRequest(training_run_id=ids.run),
            ),
        ),
        Case(
            "grpc GetSession",
            lambda w, who, ids: rpc(
                w, who, "Catalog/GetSession", svc.GetSessionRequest(session_id=ids.session)
            ),
        ),
    ]


def _keyed_cases() -> list[Case]:
    """Operations that name nothing of anyone's: bob gets his own answer."""

    def http(method: str, path: str, body: Any = None, face: str = "http") -> Case:
        return Case(
            f"{face} {method} {path}",
            lambda w, who, ids: send(w, who, method, path, body),
            other=OWN,
        )

    return [
        http("POST", "/create_session", {"tags": ["tenancy"]}),
        http("POST", "/client/config", {"sdk_version": "0.38.0"}),
        http("POST", "/client/dynamic_config", {}),
        http("POST", "/telemetry", {"events": []}),
        http("GET", "/get_server_capabilities"),
        http("GET", "/usage"),
        http("GET", "/training_runs", face="rest"),
        http("GET", "/checkpoints", face="rest"),
        http("GET", "/sessions", face="rest"),
        http("GET", "/billing/usage/checkpoints/current", face="rest"),
        Case(
            "grpc CreateSession",
            lambda w, who, ids: rpc(w, who, "Training/CreateSession", svc.CreateSessionRequest()),
            other=OWN,
        ),
        Case(
            "grpc ListTrainingRuns",
            lambda w, who, ids: rpc(
                w, who, "Catalog/ListTrainingRuns", svc.ListTrainingRunsRequest(limit=100)
            ),
            other=OWN,
        ),
    ]


CASES = [*_http_cases(), *_rest_cases(), *_grpc_cases(), *_keyed_cases()]


def normalized(detail: str) -> str:
    """A detail without its ids (every id of the cases holds a session id, a UUID)."""
    return UUID.sub("<id>", detail)


def forbidden(w: World) -> list[str]:
    """What nothing answered to bob about his own things may contain."""
    return [w.alice.session, w.alice.sdk_session, SECRET, '"alice"']


@pytest.mark.parametrize("who", WHO)
@pytest.mark.parametrize("case", CASES, ids=[case.name for case in CASES])
def test_matrix(w: World, case: Case, who: str) -> None:
    answer = case.send(w, who, w.alice)
    seen = f"{case.name} as {who}: {answer.status} {answer.detail or answer.text[:300]!r}"
    if who == OWNER:
        if case.seq and not answer.refused_early:
            w.b_next += 1  # spent, whatever came of it
        assert answer.status in case.owner_statuses, f"expected success; {seen}"
        if answer.outcome is not None:
            outcome = answer.outcome
            assert succeeded(outcome), (
                f"{seen}; its future: {outcome.status_code} {outcome.text[:300]}"
            )
    elif who == OTHER and case.other == OWN:
        assert answer.status in (200, "OK"), f"expected bob's own answer; {seen}"
        leaks = [word for word in forbidden(w) if word in answer.text]
        assert not leaks, f"bob's answer holds {leaks}; {seen}"
    elif who == OTHER:
        made_up = case.send(w, who, w.alice.made_up())
        assert answer.status in (404, "NOT_FOUND"), f"expected 404 / NOT_FOUND; {seen}"
        assert made_up.status == answer.status, (
            f"a made-up id answered {made_up.status} {made_up.detail!r}; {seen}"
        )
        assert answer.detail.strip(), f"no detail; {seen}"
        assert normalized(answer.detail) == normalized(made_up.detail), (
            f"alice's thing and a made-up id answer differently:\n  {answer.detail!r}\n"
            f"  {made_up.detail!r}"
        )
        if isinstance(answer.body, dict) or answer.status == 404:
            assert answer.body == {"detail": answer.detail}, f"more than a detail; {seen}"
    else:
        assert answer.status in (401, "UNAUTHENTICATED"), f"expected 401; {seen}"
        if isinstance(answer.status, int):
            assert answer.body == {"detail": answer.detail}, f"more than a detail; {seen}"
        expected = "no API key" if who == NO_KEY else "revoked"
        assert expected in answer.detail, f"the detail does not say {expected!r}; {seen}"


# -- the front-run -----------------------------------------------------------------------------


def _padded(message: bytes, size: int) -> bytes:
    """``message`` with an unknown length-delimited field (number 1000) of ``size`` bytes."""
    return message + varint(1000 << 3 | 2) + varint(size) + b"x" * size


def _raw_rpc(w: World, who: str, method: str, data: bytes) -> Answer:
    """A gRPC call with request bytes as they are."""
    api_key = w.keys[who]
    call = w.channel.unary_unary(
        f"/tinsmith.v1.{method}", request_serializer=lambda b: b, response_deserializer=lambda b: b
    )
    try:
        call(data, timeout=120, metadata=[("x-api-key", api_key)] if api_key else [])
    except grpc.RpcError as error:
        return Answer(error.code().name, error.details() or "")
    return Answer("OK")


def test_another_tenant_cannot_take_the_next_seq_id_of_a_run(w: World) -> None:
    """Bob sends requests on alice's run with its next seq_id, on both faces: each 404, and
    those too large to read (which spend the seq_id of a run of the caller's) are refused for
    their size without spending alice's. Alice's own optim_step with that seq_id is then hers:
    an optim_step's result, not the answer to (or the refusal of) a request of bob's."""
    alice = w.alice
    seq = w.b_next
    fb = fb_proto(alice.model, seq, forward_only=False).SerializeToString()
    step = {"model_id": alice.model, "seq_id": seq, "adam_params": {"learning_rate": 1e-4}}
    tries = {
        "http forward_backward": send(w, OTHER, "POST", "/forward_backward", protobuf=fb),
        "http optim_step": send(w, OTHER, "POST", "/optim_step", step),
        "http save_weights": send(
            w, OTHER, "POST", "/save_weights", {"model_id": alice.model, "seq_id": seq, "path": "x"}
        ),
        "grpc ForwardBackward": rpc(
            w, OTHER, "Training/ForwardBackward", fb_proto(alice.model, seq, forward_only=False)
        ),
        "grpc OptimStep": rpc(
            w, OTHER, "Training/OptimStep", svc.OptimStepRequest(model_id=alice.model, seq_id=seq)
        ),
    }
    found = {name: (t.status, t.detail) for name, t in tries.items()}
    assert all(t.status in (404, "NOT_FOUND") for t in tries.values()), found
    too_large = {
        "http forward_backward": send(
            w, OTHER, "POST", "/forward_backward", protobuf=_padded(fb, MAX_BODY_BYTES + 4096)
        ),
        "http optim_step": send(
            w, OTHER, "POST", "/optim_step", {**step, "padding": "x" * (MAX_BODY_BYTES + 4096)}
        ),
        "grpc ForwardBackward": _raw_rpc(
            w, OTHER, "Training/ForwardBackward", _padded(fb, 8 * 1024 * 1024)
        ),
    }
    found = {name: (t.status, t.detail[:200]) for name, t in too_large.items()}
    assert [t.status for t in too_large.values()] == [413, 413, "RESOURCE_EXHAUSTED"], found

    mine = send(w, OWNER, "POST", "/optim_step", step, future=True)
    w.b_next += 1
    assert mine.status == 200, f"alice's own request with seq_id {seq}: {mine.text}"
    assert mine.body["request_id"] == f"{alice.model}:{seq}"
    assert mine.outcome is not None
    assert succeeded(mine.outcome), mine.outcome.text
    assert mine.outcome.headers["content-type"].startswith("application/json"), (
        "alice's optim_step answered with something else (bob's forward_backward?)"
    )
    assert "grad_norm:mean" in mine.outcome.json()["metrics"], mine.outcome.text
    peek = send(w, OTHER, "POST", "/retrieve_future", {"request_id": f"{alice.model}:{seq}"})
    assert peek.status == 404, peek.text


# -- the published exception -------------------------------------------------------------------


def test_bob_samples_loads_and_inspects_alices_published_checkpoint(w: World) -> None:
    shared = w.alice.shared_path
    bob = w.keys[OTHER]
    sampler = send(
        w,
        OTHER,
        "POST",
        "/create_sampling_session",
        {
            "session_id": w.bob_session,
            "sampling_session_seq_id": w.next("bob sampler"),
            "model_path": shared,
        },
    )
    assert sampler.status == 200, sampler.text
    sampled = send(w, OTHER, "POST", "/asample", _sample(sampler.body["sampling_session_id"], 0))
    assert sampled.status == 200, sampled.text
    outcome = settle(w.http, bob, sampled.body["request_id"])
    assert succeeded(outcome), outcome.text[:300]

    loaded = send(
        w,
        OTHER,
        "POST",
        "/load_weights",
        {"session_id": w.bob_session, "model_seq_id": w.next("bob model"), "path": shared},
    )
    assert loaded.status == 200, loaded.text
    assert succeeded(settle(w.http, bob, loaded.body["request_id"]))
    info = send(w, OTHER, "POST", "/get_info", {"model_id": loaded.body["model_id"]})
    assert info.status == 200 and info.body["lora_rank"] == RANK, info.text

    into = {"model_id": w.bob_model, "seq_id": w.bob_seq(), "path": shared}
    loaded_into = send(w, OTHER, "POST", "/load_weights", into)
    assert loaded_into.status == 200, loaded_into.text
    assert succeeded(settle(w.http, bob, loaded_into.body["request_id"]))

    weights = send(w, OTHER, "POST", "/weights_info", {"tinker_path": shared})
    assert weights.status == 200, weights.text
    assert weights.body["base_model"] == BASE and weights.body["lora_rank"] == RANK

    # gRPC: a sampler on it and a sample, and a new run from it.
    created = rpc(
        w,
        OTHER,
        "Sampling/CreateSamplingSession",
        svc.CreateSamplingSessionRequest(
            session_id=w.bob_session,
            sampling_session_seq_id=w.next("bob sampler"),
            model_path=shared,
        ),
    )
    assert created.status == "OK", created.detail
    response = rpc(
        w,
        OTHER,
        "Sampling/Sample",
        svc.SampleRequest(
            sampling_session_id=created.body.sampling_session_id,
            seq_id=0,
            prompt=PROMPT,
            sampling_params=tp.SamplingParams(**SAMPLING),
        ),
    )
    assert response.status == "OK" and response.body.sequences, response.detail
    state = rpc(
        w,
        OTHER,
        "Training/LoadState",
        svc.LoadStateRequest(
            session_id=w.bob_session, model_seq_id=w.next("bob model"), path=shared
        ),
    )
    assert state.status == "OK", state.detail


def test_bob_sees_only_the_published_checkpoints_of_alices_run(w: World) -> None:
    """access_scope=accessible lists alice's run A for bob with its published checkpoints only:
    no private path, no owner, no metadata, and a last_request_time that is the newest published
    checkpoint's, not the run's last request."""
    alice = w.alice
    mine = send(w, OWNER, "GET", f"/training_runs/{alice.run}/checkpoints")
    assert mine.status == 200, mine.text
    public = {c["tinker_path"] for c in mine.body["checkpoints"] if c["public"]}
    assert {alice.shared_path, alice.shared_victim_path} <= public

    listed = send(w, OTHER, "GET", "/training_runs?access_scope=accessible&limit=100")
    assert listed.status == 200, listed.text
    runs = {run["training_run_id"]: run for run in listed.body["training_runs"]}
    assert alice.run in runs, f"alice's run is not accessible to bob: {sorted(runs)}"
    assert alice.model not in runs and alice.pending_run not in runs
    one = send(w, OTHER, "GET", f"/training_runs/{alice.run}?access_scope=accessible")
    checkpoints = send(
        w, OTHER, "GET", f"/training_runs/{alice.run}/checkpoints?access_scope=accessible"
    )
    assert one.status == 200 and checkpoints.status == 200, (one.text, checkpoints.text)
    for answer in (listed, one, checkpoints):
        assert SECRET not in answer.text, f"a private checkpoint shows: {answer.text[:2000]}"
        assert alice.session not in answer.text, "alice's other session shows"
        assert '"alice"' not in answer.text, "alice's tenant name shows"
    for run in (runs[alice.run], one.body):
        assert run["model_owner"] == "" and run["user_metadata"] is None, run
        for latest in (run["last_checkpoint"], run["last_sampler_checkpoint"]):
            assert latest is None or latest["tinker_path"] in public, latest
    shown = {c["tinker_path"] for c in checkpoints.body["checkpoints"]}
    assert shown == public, f"bob sees {sorted(shown)}, the published ones are {sorted(public)}"
    assert all(c["public"] and c["user_metadata"] is None for c in checkpoints.body["checkpoints"])
    newest = max(c["time"] for c in checkpoints.body["checkpoints"])
    assert one.body["last_request_time"] == newest, (
        f"last_request_time {one.body['last_request_time']} is not the newest published "
        f"checkpoint's ({newest}): it tells when alice's run last trained"
    )


# -- signed downloads --------------------------------------------------------------------------


def urls(w: World, who: str, tinker_path: str) -> dict[str, str]:
    reply = send(w, who, "GET", route(tinker_path) + "/external_weights_urls")
    assert reply.status == 200, reply.text
    found = reply.body["urls"]
    assert found, reply.text
    return dict(found)


def download(w: World, url: str, api_key: str | None = None) -> httpx.Response:
    """A signed URL, fetched as it is (no key needed)."""
    return w.http.get(url, headers=key(api_key))


def test_the_owner_downloads_its_signed_url_without_a_key(w: World) -> None:
    for url in urls(w, OWNER, w.alice.external_path).values():
        assert "tenant=alice" in url, url
        reply = download(w, url)
        assert reply.status_code == 200 and reply.content, (url, reply.status_code, reply.text)


def test_a_url_signed_for_alice_does_not_download_as_bob(w: World) -> None:
    for url in urls(w, OWNER, w.alice.external_path).values():
        forged = url.replace("tenant=alice", "tenant=bob")
        assert forged != url
        for api_key in (None, w.keys[OTHER]):
            reply = download(w, forged, api_key)
            assert reply.status_code in (400, 403, 404), (forged, reply.status_code, reply.text)
            assert "application/json" in reply.headers.get("content-type", ""), reply.text[:200]


def test_bob_downloads_alices_published_checkpoint(w: World) -> None:
    hers = urls(w, OWNER, w.alice.shared_path)
    his = urls(w, OTHER, w.alice.shared_path)
    assert hers.keys() == his.keys()
    for name, url in his.items():
        assert "tenant=bob" in url, url
        mine, theirs = download(w, url), download(w, hers[name])
        assert mine.status_code == 200, (url, mine.status_code, mine.text)
        assert mine.content == theirs.content and mine.content


def test_bobs_url_stops_working_once_alice_unpublishes(w: World) -> None:
    path = w.alice.revocable_path
    his = urls(w, OTHER, path)
    hers = urls(w, OWNER, path)
    for url in his.values():
        assert download(w, url).status_code == 200
    unpublished = send(w, OWNER, "DELETE", route(path) + "/publish")
    assert unpublished.status == 200, unpublished.text
    for url in his.values():
        reply = download(w, url)
        assert reply.status_code == 404, f"bob still downloads {url}: {reply.status_code}"
    for url in hers.values():
        assert download(w, url).status_code == 200, "alice's own URL stopped working"
    assert send(w, OTHER, "GET", route(path) + "/external_weights_urls").status == 404


# -- usage -------------------------------------------------------------------------------------


def test_storage_usage_is_the_tenants_own_and_every_tenants_for_an_admin(w: World) -> None:
    alice = send(w, OWNER, "GET", "/billing/usage/checkpoints/current")
    assert alice.status == 200, alice.text
    owners = {row["org_user_urn"] for row in alice.body["data"]}
    assert owners == {"alice"}, alice.text
    admin = send(w, OWNER, "GET", "/billing/usage/checkpoints/current", api_key=w.admin_key)
    assert admin.status == 200, admin.text
    assert {"alice", "bob"} <= {row["org_user_urn"] for row in admin.body["data"]}, admin.text


def test_usage_is_the_tenants_own_row_with_quotas_and_every_row_for_an_admin(w: World) -> None:
    alice = send(w, OWNER, "GET", "/usage")
    assert alice.status == 200, alice.text
    (row,) = alice.body["tenants"]
    assert row["tenant"] == "alice" and row["runs"] >= 2, row
    assert row["quotas"]["max_runs"] == tenants.Quotas().max_runs, row
    admin = send(w, OWNER, "GET", "/usage", api_key=w.admin_key)
    assert admin.status == 200, admin.text
    rows = {row["tenant"]: row for row in admin.body["tenants"]}
    assert {"alice", "bob"} <= rows.keys(), admin.text
    assert all("quotas" not in row for name, row in rows.items() if name != "ops"), admin.text


def test_an_admin_reads_no_other_tenants_things(w: World) -> None:
    """Admin shows in usage only: alice's session and run are hidden from it like from bob."""
    for path in (f"/sessions/{w.alice.session}", f"/training_runs/{w.alice.run}"):
        reply = send(w, OWNER, "GET", path, api_key=w.admin_key)
        assert reply.status == 404, (path, reply.status, reply.text)


# -- keys --------------------------------------------------------------------------------------


def _unissued() -> str:
    return f"tml-{secrets.token_hex(8)}_{secrets.token_urlsafe(32)}"


def test_keys_that_were_never_issued_are_refused(w: World) -> None:
    known_id = tenants.key_id_of(w.keys[OWNER] or "")
    assert known_id
    revoked_id = tenants.key_id_of(w.keys[REVOKED] or "")
    assert revoked_id
    details = {}
    for name, api_key in {
        "unissued": _unissued(),
        "wrong secret": f"tml-{known_id}_{secrets.token_urlsafe(32)}",
        "revoked id, wrong secret": f"tml-{revoked_id}_{secrets.token_urlsafe(32)}",
        "free-form tml-": "tml-tenancy-test-user",
        "not tml-": "sk-tenancy-test",
    }.items():
        for answer in (
            send(w, OWNER, "POST", "/create_session", {}, api_key=api_key),
            send(w, OWNER, "GET", "/training_runs", api_key=api_key),
            rpc(w, OWNER, "Training/CreateSession", svc.CreateSessionRequest(), api_key=api_key),
        ):
            assert answer.status in (401, "UNAUTHENTICATED"), (name, answer.status, answer.text)
            assert answer.detail, name
        details[name] = answer.detail
    # A known key id with a wrong secret, revoked or not, is told what an unknown key is told:
    # only the holder of a key learns that it was revoked.
    assert details["wrong secret"] == details["unissued"], details
    assert details["revoked id, wrong secret"] == details["unissued"], details


def test_health_needs_no_key(w: World) -> None:
    reply = w.http.get(API + "/healthz")
    assert reply.status_code == 200 and reply.json() == {"status": "ok"}, reply.text
    check = health_pb2_grpc.HealthStub(w.channel).Check(health_pb2.HealthCheckRequest(), timeout=30)
    assert check.status == health_pb2.HealthCheckResponse.SERVING


def test_a_keys_own_quota_of_runs(w: World) -> None:
    """A key issued with Quotas(max_runs=1): its tenant's second run is refused with 403,
    naming the quota, on both faces."""
    capped, _ = issue(w.system, "capped", quotas=bus.Quotas(max_runs=1))
    session = send(w, OWNER, "POST", "/create_session", {}, api_key=capped)
    assert session.status == 200, session.text
    session_id = session.body["session_id"]

    def create(model_seq: int) -> Answer:
        body = {"session_id": session_id, "model_seq_id": model_seq, "base_model": BASE}
        return send(
            w, OWNER, "POST", "/create_model", {**body, "lora_config": LORA}, api_key=capped
        )

    first = create(0)
    assert first.status == 200, first.text
    assert succeeded(settle(w.http, capped, first.body["request_id"]))
    second = create(1)
    assert second.status == 403, second.text
    assert "max_runs" in second.detail, second.detail
    over_grpc = rpc(
        w,
        OWNER,
        "Training/CreateModel",
        svc.CreateModelRequest(session_id=session_id, model_seq_id=2, base_model=BASE, lora_rank=4),
        api_key=capped,
    )
    assert over_grpc.status == "RESOURCE_EXHAUSTED" and "max_runs" in over_grpc.detail, (
        over_grpc.status,
        over_grpc.detail,
    )
    usage = send(w, OWNER, "GET", "/usage", api_key=capped)
    assert usage.body["tenants"][0]["quotas"]["max_runs"] == 1, usage.text
