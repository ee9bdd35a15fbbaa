"""Tenancy in the catalog, against the real catalog folded from its real event log (a real
nats-server; SQLite and PostgreSQL): every operation on a run, checkpoint or session that is not
the caller's answers NotFound with the detail of an id that does not exist; published checkpoints
are readable by every tenant and changeable by their owner alone, and listing them reveals
nothing private; storage usage is the tenant's own, every tenant's for an admin; rows without a
tenant are nobody's; download URLs are signed for the calling tenant."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any
from urllib.parse import parse_qsl, unquote, urlsplit

import pytest

from tests.checkpoint.test_catalog import Service, append, saved, start_service, write_blob
from tinsmith._proto import bus_pb2 as bus
from tinsmith.blobs import BlobStore
from tinsmith.eventlog import EventLog
from tinsmith.failures import InvalidRequest

ALICE, BOB = "alice", "bob"
RUN_A = "SA:train:0"  # alice's, nothing published
RUN_P = "SA:train:1"  # alice's, with published checkpoints and newer private ones
RUN_B = "SB:train:0"  # bob's
RUN_L = "SL:train:0"  # from a log older than tenants: no owner, a published checkpoint
RUN_META = {"secret": "alice's run notes"}
CHECKPOINT_META = {"secret": "alice's checkpoint notes"}
BASE_URL = "http://gateway.test:8000"


def at(run: str, checkpoint: str) -> str:
    return f"tinker://{run}/{checkpoint}"


def key(run: str, checkpoint: str) -> str:
    return f"runs/{run}/{checkpoint}"


async def tell(eventlog: EventLog, blobs: BlobStore, tmp_path: Path) -> None:
    """Alice (session SA: runs A and P), Bob (SB: run B), and a session from before tenants (SL:
    run L). P publishes two checkpoints, then saves newer private ones and takes a request."""
    for session_id, owner, project in (("SA", ALICE, "pa"), ("SB", BOB, "pb"), ("SL", "", "")):
        created = bus.SessionCreated(
            session_id=session_id,
            owner=owner,
            project_id=project,
            display_name=f"{owner}'s session",
            user_metadata={"secret": f"{owner}'s session notes"},
        )
        await append(eventlog, session_created=created)
    for model_id in (RUN_A, RUN_P, RUN_B, RUN_L):
        create = bus.CreateModel(
            session_id=model_id.split(":")[0],
            base_model="tinsmith/tiny",
            lora=bus.LoraConfig(rank=4, train_mlp=True, train_attn=True),
            user_metadata=RUN_META if model_id.startswith("SA") else {},
        )
        accepted = bus.RequestAccepted(
            request_id=f"{model_id}:0", aggregate_id=model_id, seq_id=0, create_model=create
        )
        await append(eventlog, request_accepted=accepted)
        await append(eventlog, run_created=bus.RunCreated(model_id=model_id, tokenizer_id="tok"))
    await append(
        eventlog,
        sampler_created=bus.SamplerCreated(
            sampler_id="SA:sample:0",
            session_id="SA",
            base_model="tinsmith/tiny",
            model_path=at(RUN_A, "sampler_weights/s"),
        ),
    )

    async def save(run: str, checkpoint: str, size: int, *, public: bool = False) -> None:
        segment, name = checkpoint.split("/")
        stored = await write_blob(blobs, key(run, checkpoint), tmp_path, size)
        meta = CHECKPOINT_META if run.startswith("SA") else {}
        await append(
            eventlog,
            weights_saved=saved(
                run, segment, name, key(run, checkpoint), stored, user_metadata=meta
            ),
        )
        if public:
            published = bus.CheckpointPublished(
                model_id=run, tinker_path=at(run, checkpoint), public=True
            )
            await append(eventlog, checkpoint_published=published)

    await save(RUN_A, "weights/private", 100)
    await save(RUN_A, "sampler_weights/s", 50)
    await save(RUN_A, "external_weights/export", 64)
    await save(RUN_P, "weights/shared", 40, public=True)
    await save(RUN_P, "external_weights/shared-export", 24, public=True)
    await save(RUN_P, "weights/later", 41)
    await save(RUN_P, "sampler_weights/later-s", 42)
    await save(RUN_B, "weights/b", 30)
    await save(RUN_L, "weights/old", 7, public=True)
    step = bus.RequestAccepted(
        request_id=f"{RUN_P}:1", aggregate_id=RUN_P, seq_id=1, optim_step=bus.OptimStep()
    )
    await append(eventlog, request_accepted=step)


@dataclass
class Reply:
    kind: str  # "" on success
    detail: str
    body: Any


async def call(service: Service, op: str, **fields: Any) -> Reply:
    handler = service.catalog.operations()[op]
    reply = bus.CatalogReply.FromString(
        await handler(bus.CatalogQuery(**fields).SerializeToString())
    )
    body = json.loads(reply.json) if not reply.error_kind else None
    return Reply(reply.error_kind, reply.error_detail, body)


@pytest.fixture
async def service(
    nats_url: str, eventlog: EventLog, blobs: BlobStore, catalog_url: str, tmp_path: Path
) -> AsyncIterator[Service]:
    await tell(eventlog, blobs, tmp_path)
    started = await start_service(nats_url, catalog_url, blobs)
    yield started
    await started.stop()


# -- every operation on what is not the caller's -------------------------------------------------

SHARED = at(RUN_P, "weights/shared")
# (operation, its fields naming something of alice's, whether alice's own call changes the
# catalog). Each is asked by bob, by no tenant and by an admin of another tenant.
OPERATIONS: list[tuple[str, dict[str, Any], bool]] = [
    ("training_run", {"training_run_id": RUN_A}, False),
    ("training_run", {"training_run_id": RUN_A, "access_scope": "accessible"}, False),
    ("training_run", {"training_run_id": RUN_P}, False),  # published, but scope owned
    ("checkpoints", {"training_run_id": RUN_A}, False),
    ("checkpoints", {"training_run_id": RUN_A, "access_scope": "accessible"}, False),
    ("checkpoints", {"training_run_id": RUN_P}, False),
    ("session", {"session_id": "SA"}, False),
    ("weights_info", {"tinker_path": at(RUN_A, "weights/private")}, False),
    ("weights_info", {"tinker_path": at(RUN_P, "weights/later")}, False),
    (
        "external_weights_urls",
        {"tinker_path": at(RUN_A, "external_weights/export"), "base_url": BASE_URL},
        False,
    ),
    (
        "checkpoint_archive_url",
        {"tinker_path": at(RUN_A, "weights/private"), "base_url": BASE_URL},
        False,
    ),
    ("delete_checkpoint", {"tinker_path": at(RUN_A, "weights/private")}, True),
    ("delete_checkpoint", {"tinker_path": SHARED}, True),
    ("publish_checkpoint", {"tinker_path": at(RUN_A, "weights/private"), "public": True}, True),
    ("publish_checkpoint", {"tinker_path": SHARED, "public": False}, True),
    (
        "set_checkpoint_ttl",
        {"tinker_path": at(RUN_A, "weights/private"), "ttl_seconds": 7200},
        True,
    ),
    ("set_checkpoint_ttl", {"tinker_path": SHARED, "ttl_seconds": 7200}, True),
]
CALLERS: list[dict[str, Any]] = [
    {"owner": BOB},
    {"owner": ""},
    {"owner": BOB, "admin": True},  # an admin key reads usage, not other tenants' things
    {"owner": "", "admin": True},
]


def missing(fields: dict[str, Any]) -> dict[str, Any]:
    """The same question about ids that do not exist: session SX instead of SA."""
    return {k: v.replace("SA", "SX") if isinstance(v, str) else v for k, v in fields.items()}


@pytest.mark.parametrize(
    ("op", "fields", "changes"),
    OPERATIONS,
    ids=[f"{op}-{i}" for i, (op, _, _) in enumerate(OPERATIONS)],
)
async def test_what_is_not_the_callers_is_not_found_exactly_like_what_does_not_exist(
    service: Service, blobs: BlobStore, op: str, fields: dict[str, Any], changes: bool
) -> None:
    before = await service.dump()
    stored = [a.key for a in await blobs.artifacts("runs", 4)]
    nowhere = await call(service, op, owner=ALICE, **missing(fields))
    assert nowhere.kind == "not_found", nowhere
    for caller in CALLERS:
        assert await call(service, op, **caller, **missing(fields)) == nowhere
        denied = await call(service, op, **caller, **fields)
        assert denied.kind == "not_found", (caller, denied)
        # Word for word what a missing id gets, the id aside: nothing tells that it exists.
        assert denied.detail.replace("SA", "SX") == nowhere.detail, caller
        assert denied.detail != nowhere.detail  # it does name what was asked for
    assert await service.dump() == before  # nothing changed: no event, no row
    assert [a.key for a in await blobs.artifacts("runs", 4)] == stored  # and no bytes went

    mine = await call(service, op, owner=ALICE, **fields)
    assert mine.kind == "", mine
    assert (await service.dump() != before) is changes


# -- listings --------------------------------------------------------------------------------------


async def test_listings_hold_the_callers_own_and_no_tenant_sees_nothing(service: Service) -> None:
    async def runs(owner: str, **more: Any) -> list[str]:
        page = (await call(service, "training_runs", owner=owner, **more)).body
        assert page["cursor"]["total_count"] == len(page["training_runs"])
        return [run["training_run_id"] for run in page["training_runs"]]

    async def checkpoints(owner: str) -> list[str]:
        page = (await call(service, "user_checkpoints", owner=owner)).body
        assert page["cursor"]["total_count"] == len(page["checkpoints"])
        return [c["tinker_path"] for c in page["checkpoints"]]

    async def sessions(owner: str) -> list[str]:
        return list((await call(service, "sessions", owner=owner)).body["sessions"])

    assert await runs(ALICE) == [RUN_P, RUN_A]
    assert await runs(BOB) == [RUN_B]
    assert await runs("") == []
    assert await runs("", access_scope="accessible") == []  # not even what is published
    assert await runs(ALICE, access_scope="accessible") == [RUN_P, RUN_A]
    assert await runs(BOB, access_scope="accessible") == [RUN_B, RUN_P]  # never L: no tenant's
    # A project filter is the caller's own: another tenant's projects are private.
    assert await runs(ALICE, project_id="pa") == [RUN_P, RUN_A]
    assert await runs(BOB, project_id="pa", access_scope="accessible") == []
    assert await runs(ALICE, project_id="pb") == []

    assert await checkpoints(ALICE) == [
        at(RUN_P, "sampler_weights/later-s"),
        at(RUN_P, "weights/later"),
        at(RUN_P, "external_weights/shared-export"),
        at(RUN_P, "weights/shared"),
        at(RUN_A, "external_weights/export"),
        at(RUN_A, "sampler_weights/s"),
        at(RUN_A, "weights/private"),
    ]
    assert await checkpoints(BOB) == [at(RUN_B, "weights/b")]
    assert await checkpoints("") == []

    assert await sessions(ALICE) == ["SA"]
    assert await sessions(BOB) == ["SB"]
    assert await sessions("") == []
    session = (await call(service, "session", owner=ALICE, session_id="SA")).body
    assert session["training_run_ids"] == [RUN_A, RUN_P]
    assert session["sampler_ids"] == ["SA:sample:0"]


async def test_rows_without_a_tenant_are_nobodys(service: Service) -> None:
    old = at(RUN_L, "weights/old")
    for owner in (ALICE, BOB, ""):
        for fields in (
            {"training_run_id": RUN_L, "access_scope": "accessible"},
            {"training_run_id": RUN_L},
        ):
            assert (await call(service, "training_run", owner=owner, **fields)).kind == "not_found"
            assert (await call(service, "checkpoints", owner=owner, **fields)).kind == "not_found"
        assert (await call(service, "session", owner=owner, session_id="SL")).kind == "not_found"
        for op in ("weights_info", "delete_checkpoint", "publish_checkpoint"):
            assert (await call(service, op, owner=owner, tinker_path=old)).kind == "not_found"
    # Still folded and stored: only nobody's.
    assert old in {row["tinker_path"] for row in (await service.dump())["checkpoints"]}


# -- the published exception -------------------------------------------------------------------


async def test_a_published_checkpoint_is_readable_by_every_tenant_and_nothing_private_shows(
    service: Service, blobs: BlobStore
) -> None:
    # Read: weights_info answers bob what it answers alice.
    info = await call(service, "weights_info", owner=ALICE, tinker_path=SHARED)
    assert info.kind == ""
    assert await call(service, "weights_info", owner=BOB, tinker_path=SHARED) == info
    assert (await call(service, "weights_info", owner="", tinker_path=SHARED)).kind == "not_found"
    export = at(RUN_P, "external_weights/shared-export")
    urls = await call(
        service, "external_weights_urls", owner=BOB, tinker_path=export, base_url=BASE_URL
    )
    assert urls.kind == "" and set(urls.body["urls"]) == {"adapter_model.safetensors"}
    assert _tenant_of(blobs, urls.body["urls"]["adapter_model.safetensors"]) == BOB
    # No tenant reads nothing, published or not.
    for op, fields in (
        ("weights_info", {"tinker_path": SHARED}),
        ("external_weights_urls", {"tinker_path": export, "base_url": BASE_URL}),
        ("training_run", {"training_run_id": RUN_P, "access_scope": "accessible"}),
        ("checkpoints", {"training_run_id": RUN_P, "access_scope": "accessible"}),
    ):
        for admin in (False, True):
            nobody = await call(service, op, owner="", admin=admin, **fields)
            nowhere = await call(service, op, owner=BOB, **missing(fields))
            assert nobody.kind == nowhere.kind == "not_found"
            assert nobody.detail.replace("SA", "SX") == nowhere.detail

    # Bob lists alice's run P through access_scope=accessible: its published checkpoints only,
    # without their notes.
    listed = await call(
        service, "checkpoints", owner=BOB, training_run_id=RUN_P, access_scope="accessible"
    )
    owners = await call(service, "checkpoints", owner=ALICE, training_run_id=RUN_P)
    by_path = {c["tinker_path"]: c for c in owners.body["checkpoints"]}
    assert [c["tinker_path"] for c in listed.body["checkpoints"]] == [export, SHARED]
    for shown in listed.body["checkpoints"]:
        assert shown == {**by_path[shown["tinker_path"]], "user_metadata": None}
        assert shown["public"] is True
    assert by_path[SHARED]["user_metadata"] == CHECKPOINT_META  # the owner's view has them
    assert listed.body["cursor"]["total_count"] == 2

    theirs = await call(
        service, "training_run", owner=BOB, training_run_id=RUN_P, access_scope="accessible"
    )
    page = await call(service, "training_runs", owner=BOB, access_scope="accessible")
    assert page.body["training_runs"][1] == theirs.body  # the same view in the listing
    assert theirs.body == {
        "training_run_id": RUN_P,
        "base_model": "tinsmith/tiny",
        "model_owner": "",
        "is_lora": True,
        "corrupted": False,
        "lora_rank": 4,
        "last_request_time": by_path[export]["time"],  # the newest published checkpoint's
        "last_checkpoint": {**by_path[SHARED], "user_metadata": None},  # not "later"
        "last_sampler_checkpoint": None,  # "later-s" is private
        "user_metadata": None,
    }
    text = json.dumps(theirs.body) + json.dumps(listed.body)
    for private in (ALICE, "secret", "later"):
        assert private not in text

    # The owner sees everything: the newer private checkpoints, the notes, the last request.
    own = (await call(service, "training_run", owner=ALICE, training_run_id=RUN_P)).body
    assert own["model_owner"] == ALICE and own["user_metadata"] == RUN_META
    assert own["last_checkpoint"]["tinker_path"] == at(RUN_P, "weights/later")
    assert own["last_sampler_checkpoint"]["tinker_path"] == at(RUN_P, "sampler_weights/later-s")
    assert _time(own["last_request_time"]) > _time(theirs.body["last_request_time"])
    assert page.body["training_runs"][0]["model_owner"] == BOB  # bob's own run, in full

    # Unpublished, it is bob's no more: not found, like a checkpoint that never was.
    for path in (SHARED, export):
        done = await call(
            service, "publish_checkpoint", owner=ALICE, tinker_path=path, public=False
        )
        assert done.kind == ""
    gone = await call(service, "weights_info", owner=BOB, tinker_path=SHARED)
    never = await call(
        service, "weights_info", owner=BOB, tinker_path=at("SX:train:1", "weights/shared")
    )
    assert gone.kind == "not_found" and gone.detail.replace("SA", "SX") == never.detail
    refused = await call(
        service, "training_run", owner=BOB, training_run_id=RUN_P, access_scope="accessible"
    )
    assert refused.kind == "not_found"
    page = await call(service, "training_runs", owner=BOB, access_scope="accessible")
    assert [r["training_run_id"] for r in page.body["training_runs"]] == [RUN_B]


def _time(iso: str) -> float:
    return datetime.fromisoformat(iso).timestamp()


# -- storage usage -------------------------------------------------------------------------------


async def test_storage_usage_is_the_tenants_own_and_every_tenants_for_an_admin(
    service: Service,
) -> None:
    async def usage(**fields: Any) -> dict[Any, tuple[int, int]]:
        data = (await call(service, "storage_usage", **fields)).body["data"]
        return {row["org_user_urn"]: (row["checkpoint_count"], row["size_bytes"]) for row in data}

    alice = (7, 100 + 50 + 64 + 40 + 24 + 41 + 42)
    assert await usage(owner=ALICE) == {ALICE: alice}
    assert await usage(owner=BOB) == {BOB: (1, 30)}
    assert await usage(owner="") == {}
    # An admin sees every tenant, one row each, and what no tenant owns.
    assert await usage(owner=BOB, admin=True) == {ALICE: alice, BOB: (1, 30), None: (1, 7)}
    assert await usage(owner=BOB, admin=True, project_id="pa") == {ALICE: alice}
    assert await usage(owner=BOB, project_id="pa") == {}


# -- download URLs -------------------------------------------------------------------------------


def _tenant_of(blobs: BlobStore, url: str) -> str:
    """Verify a gateway download URL as the gateway will, and return the tenant it is for."""
    parts = urlsplit(url)
    params = dict(parse_qsl(parts.query))
    prefix = "/api/v1/blobs/"
    assert parts.path.startswith(prefix)
    verified = blobs.verify(
        unquote(parts.path.removeprefix(prefix)),
        expires=params["expires"],
        signature=params["signature"],
        tenant=params["tenant"],
    )
    return verified.tenant


async def test_download_urls_are_signed_for_the_calling_tenant(
    service: Service, blobs: BlobStore
) -> None:
    export = at(RUN_A, "external_weights/export")
    answer = await call(
        service, "external_weights_urls", owner=ALICE, tinker_path=export, base_url=BASE_URL
    )
    (url,) = answer.body["urls"].values()
    assert url.startswith(f"{BASE_URL}/api/v1/blobs/")
    assert _tenant_of(blobs, url) == ALICE
    parts = urlsplit(url)
    params = dict(parse_qsl(parts.query))
    assert params["tenant"] == ALICE and int(params["expires"]) == int(
        _time(answer.body["expires"])
    )
    # The tenant cannot be changed: bob's name in alice's URL breaks its signature.
    with pytest.raises(InvalidRequest, match="signature"):
        _tenant_of(blobs, url.replace(f"tenant={ALICE}", f"tenant={BOB}"))


async def test_archive_urls_are_signed_for_the_calling_tenant_and_are_no_file_urls(
    service: Service, blobs: BlobStore
) -> None:
    answer = await call(
        service, "checkpoint_archive_url", owner=BOB, tinker_path=SHARED, base_url=BASE_URL
    )
    assert answer.kind == "", answer
    url = answer.body["url"]
    prefix = f"{BASE_URL}/api/v1/archives/"
    assert url.startswith(prefix)
    path, _, query = url.removeprefix(prefix).partition("?")
    params = dict(parse_qsl(query))
    assert unquote(path) == key(RUN_P, "weights/shared")
    assert int(params["expires"]) == int(_time(answer.body["expires"]))
    fields = {"expires": params["expires"], "signature": params["signature"]}
    verified = blobs.verify_archive(unquote(path), tenant=params["tenant"], **fields)
    assert (verified.key, verified.tenant) == (key(RUN_P, "weights/shared"), BOB)
    with pytest.raises(InvalidRequest, match="signature"):
        blobs.verify_archive(unquote(path), tenant=ALICE, **fields)
    with pytest.raises(InvalidRequest, match="signature"):  # not a URL of one of its files
        blobs.verify(unquote(path), tenant=BOB, **fields)
