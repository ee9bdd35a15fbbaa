"""The rest of the SDK's RestClient and AdminClient, through the official SDK against the running
system: copy_weights (and ServiceClient.copy_weights), assign_session_project and listing by
project, search_sessions, the audit log, billing usage events, and whoami's local refusal; each
with another tenant's key refused."""

from __future__ import annotations

import math
import time
import uuid
from collections.abc import Iterator
from datetime import UTC, date, datetime, timedelta
from typing import Any

import httpx
import pytest
import tinker
from tinker import types

from tests.conftest import RunningSystem
from tests.e2e.test_rest import User
from tests.e2e.test_tenancy import issue

pytestmark = pytest.mark.e2e

PROMPT = types.ModelInput.from_ints([5, 6, 7, 8])
GREEDY = types.SamplingParams(max_tokens=6, temperature=0.0, seed=1, stop=[])


@pytest.fixture(scope="module")
def user(system: RunningSystem) -> Iterator[User]:
    me = User(system)
    yield me
    me.service.close("success").result(timeout=30)


@pytest.fixture(scope="module")
def stranger(system: RunningSystem) -> Iterator[User]:
    other = User(system)
    yield other
    other.service.close("success").result(timeout=30)


def _trained(user: User) -> tinker.TrainingClient:
    """A run one step away from its initialisation, so that its weights are its own."""
    training = user.new_run(note="source")
    datum = types.Datum(
        model_input=types.ModelInput.from_ints([1, 2, 3, 4]),
        loss_fn_inputs={"target_tokens": [2, 3, 4, 5], "weights": [1.0] * 4},
    )
    training.forward_backward([datum], "cross_entropy").result(timeout=120)
    training.optim_step(types.AdamParams(learning_rate=1e-2)).result(timeout=120)
    return training


def _run_of(path: str) -> str:
    return tinker.ParsedCheckpointTinkerPath.from_tinker_path(path).training_run_id


def _tokens(service: tinker.ServiceClient, path: str) -> list[int]:
    sampler = service.create_sampling_client(model_path=path).result()
    return list(sampler.sample(PROMPT, 1, GREEDY).result(timeout=120).sequences[0].tokens)


def _http(system: RunningSystem, key: str) -> httpx.Client:
    return httpx.Client(base_url=system.url + "/api/v1", headers={"X-API-Key": key}, timeout=60)


def test_copy_weights_copies_into_a_run_of_the_callers_own(
    user: User, stranger: User, system: RunningSystem
) -> None:
    training = _trained(user)
    state = training.save_state("kept", user_metadata={"step": "1"}).result().path
    for_sampling = training.save_weights_for_sampler("served").result().path

    copy = user.rest.copy_weights(state, "archive").result(timeout=60)
    run = _run_of(copy)
    assert copy == f"tinker://{run}/weights/kept" and run != training.model_id
    (listed,) = user.rest.list_checkpoints(run).result().checkpoints
    assert (listed.checkpoint_type, listed.user_metadata, listed.expires_at) == (
        "training",
        {"step": "1"},
        None,
    )
    copied_run = user.rest.get_training_run(run).result()
    assert (copied_run.base_model, copied_run.lora_rank) == ("tinsmith/tiny", 4)
    archived = user.rest.list_training_runs(project_id="archive").result().training_runs
    assert [r.training_run_id for r in archived] == [run]
    session = user.rest.get_session(run.rpartition(":train:")[0]).result()
    assert session.training_run_ids == [run]
    # The copy's bytes are its own, equal to the source's.
    names = {p.name for p in user.stored(state).iterdir()}
    assert names == {p.name for p in user.stored(copy).iterdir()}
    for name in names - {".complete"}:
        assert (user.stored(copy) / name).read_bytes() == (user.stored(state) / name).read_bytes()
    assert user.service.create_training_client_from_state(copy).result().model_id

    # ServiceClient.copy_weights copies into the client's project; the copy samples the same.
    archive = tinker.ServiceClient(project_id="served", base_url=system.url, api_key=user.key)
    served = archive.copy_weights(for_sampling, ttl_seconds=7200).result(timeout=60)
    assert served.endswith("/sampler_weights/served")
    assert _tokens(archive, served) == _tokens(user.service, for_sampling)
    (listed,) = user.rest.list_checkpoints(_run_of(served)).result().checkpoints
    assert listed.expires_at is not None and listed.checkpoint_type == "sampler"
    archive.close("success").result(timeout=30)

    # Deleting the source leaves the copy whole, and deleting the copy leaves nothing behind.
    user.rest.delete_checkpoint_from_tinker_path(state).result()
    assert not user.stored(state).exists() and user.stored(copy).exists()
    assert user.service.create_training_client_from_state(copy).result().model_id
    user.rest.delete_checkpoint_from_tinker_path(copy).result()
    assert not user.stored(copy).exists()

    # The copy's run holds weights and is never trained on.
    with _http(system, user.key) as http:
        refused = http.post(
            "/optim_step",
            json={"model_id": run, "seq_id": 1, "adam_params": {"learning_rate": 1e-3}},
        )
    assert refused.status_code == 400 and "never trained on" in refused.json()["detail"]

    # Another tenant: the private checkpoint is not found, the copy's run is not theirs.
    with pytest.raises(tinker.NotFoundError):
        stranger.rest.copy_weights(for_sampling, "mine").result(timeout=60)
    with pytest.raises(tinker.NotFoundError):
        stranger.rest.get_training_run(_run_of(served)).result()
    with pytest.raises(tinker.BadRequestError, match="3600"):
        user.rest.copy_weights(for_sampling, "archive", ttl_seconds=60).result(timeout=60)


def test_a_published_checkpoint_is_copied_by_another_tenant_without_its_notes(
    user: User, stranger: User
) -> None:
    training = user.new_run()
    path = training.save_weights_for_sampler("shared", user_metadata={"secret": "x"}).result().path
    user.rest.publish_checkpoint_from_tinker_path(path).result()
    theirs = stranger.rest.copy_weights(path, "borrowed").result(timeout=60)
    (listed,) = stranger.rest.list_checkpoints(_run_of(theirs)).result().checkpoints
    assert listed.user_metadata is None and not listed.public
    assert _tokens(stranger.service, theirs) == _tokens(user.service, path)
    # Unpublishing the source takes nothing from the copy, and the copy is not the publisher's.
    user.rest.unpublish_checkpoint_from_tinker_path(path).result()
    assert _tokens(stranger.service, theirs)
    with pytest.raises(tinker.NotFoundError):
        user.rest.get_training_run(_run_of(theirs)).result()


def test_a_retried_copy_answers_the_first_and_a_session_slot_can_be_named(
    user: User, stranger: User, system: RunningSystem
) -> None:
    training = user.new_run()
    path = training.save_state("retried").result().path
    key = str(uuid.uuid4())
    body = {"source_path": path, "destination_project_id": "retries"}
    with _http(system, user.key) as http:
        first, again = (
            http.post("/copy_weights", json=body, headers={"X-Idempotency-Key": key})
            for _ in range(2)
        )
        assert first.status_code == again.status_code == 200, first.text
        assert first.json() == again.json()
        runs = user.rest.list_training_runs(project_id="retries").result().training_runs
        assert [r.training_run_id for r in runs] == [_run_of(first.json()["tinker_path"])]
        never = f"tinker://{training.model_id}/weights/never-saved"
        assert http.post("/copy_weights", json={**body, "source_path": never}).status_code == 404
        missing = http.post("/copy_weights", json={"source_path": path})
        assert missing.status_code == 400 and "destination_project_id" in missing.json()["detail"]

        # Into a run slot of a session of one's own: the slot makes a retry idempotent.
        session_id = training.model_id.rpartition(":train:")[0]
        slot = {"source_path": path, "session_id": session_id, "model_seq_id": 99}
        placed = http.post("/copy_weights", json=slot)
        assert placed.json() == {"tinker_path": f"tinker://{session_id}:train:99/weights/retried"}
        assert http.post("/copy_weights", json=slot).json() == placed.json()
        taken = http.post("/copy_weights", json={**slot, "model_seq_id": 0})
        assert taken.status_code == 400 and "taken" in taken.json()["detail"]
    assert f"{session_id}:train:99" in user.rest.get_session(session_id).result().training_run_ids
    with _http(system, stranger.key) as http:
        assert http.post("/copy_weights", json=slot).status_code == 404


def test_assign_session_project_moves_runs_checkpoints_and_usage(
    user: User, stranger: User, system: RunningSystem
) -> None:
    service = tinker.ServiceClient(project_id="first", base_url=system.url, api_key=user.key)
    training = service.create_lora_training_client(base_model="tinsmith/tiny", rank=4).result()
    path = training.save_state("moved").result().path
    session_id = training.model_id.rpartition(":train:")[0]
    first = user.rest.list_training_runs(project_id="first").result().training_runs
    assert [r.training_run_id for r in first] == [training.model_id]

    user.rest.assign_session_project(session_id, "second").result()
    assert user.rest.list_training_runs(project_id="first").result().cursor.total_count == 0
    second = user.rest.list_training_runs(project_id="second").result().training_runs
    assert [r.training_run_id for r in second] == [training.model_id]
    admin = tinker.AdminClient(base_url=system.url, api_key=user.key)
    (usage,) = admin.get_current_checkpoint_storage_usage(project_id="second").result().data
    assert usage.checkpoint_count == 1 and usage.size_bytes == sum(
        c.size_bytes or 0
        for c in user.rest.list_checkpoints(training.model_id).result().checkpoints
    )
    # What the session saves from now on is in its new project too.
    later = training.save_state("later").result().path
    (usage,) = admin.get_current_checkpoint_storage_usage(project_id="second").result().data
    assert usage.checkpoint_count == 2 and {path, later} <= {
        c.tinker_path for c in user.rest.list_user_checkpoints().result().checkpoints
    }

    with pytest.raises(tinker.NotFoundError):
        stranger.rest.assign_session_project(session_id, "theirs").result()
    with pytest.raises(tinker.BadRequestError, match="project"):
        user.rest.assign_session_project(session_id, "").result()
    service.close("success").result(timeout=30)


def test_search_sessions_filters_pages_and_keeps_to_the_tenant(
    user: User, stranger: User, system: RunningSystem
) -> None:
    tag = uuid.uuid4().hex[:6]
    made, services = [], []
    for i in range(3):
        service = tinker.ServiceClient(
            user_metadata={"batch": tag, "i": str(i)},
            display_name=f"Nightly eval {tag} #{i}",
            project_id=f"search-{tag}",
            base_url=system.url,
            api_key=user.key,
        )
        service.create_sampling_client(base_model="tinsmith/tiny").result()  # its session
        made.append(user.rest.list_sessions(limit=1).result().sessions[0])
        services.append(service)
    services[0].close("errored").result(timeout=30)

    def search(**fields: Any) -> types.SessionSearchResponse:
        request = types.SessionSearchRequest(**fields)
        with pytest.warns(tinker.ExperimentalWarning):
            return user.rest.search_sessions(request).result()

    found = search(display_name=f"nightly {tag.upper()}")
    assert [s.session_id for s in found.sessions] == made[::-1] and found.next_cursor is None
    newest = found.sessions[0]
    assert (newest.owner, newest.project_id, newest.user_metadata) == (
        user.owner,
        f"search-{tag}",
        {"batch": tag, "i": "2"},
    )
    assert isinstance(newest.status, types.SessionActive)
    page = search(user_metadata={"batch": tag}, limit=2)
    assert [s.session_id for s in page.sessions] == made[:0:-1] and page.next_cursor
    rest = search(user_metadata={"batch": tag}, limit=2, cursor=page.next_cursor)
    assert [s.session_id for s in rest.sessions] == made[:1] and rest.next_cursor is None
    errored = search(
        project_ids=[f"search-{tag}"],
        statuses=[types.ClientFinishedSessionStatusQuery(reasons=["errored"])],
    )
    assert [s.session_id for s in errored.sessions] == made[:1]
    assert search(session_id=made[1]).sessions[0].display_name == f"Nightly eval {tag} #1"

    # Another tenant finds none of them, whatever it asks for.
    request = types.SessionSearchRequest(
        display_name=tag, owner=types.AccessibleSearchOwner(), limit=200
    )
    with pytest.warns(tinker.ExperimentalWarning):
        assert stranger.rest.search_sessions(request).result().sessions == []
    with _http(system, user.key) as http:
        refused = http.post("/sessions/search", json={"limit": 500})
        assert refused.status_code == 400 and "limit" in refused.json()["detail"]
    for service in services[1:]:
        service.close("success").result(timeout=30)


def test_the_audit_log_is_the_operators_and_shows_what_changed(
    user: User, system: RunningSystem
) -> None:
    admin_key, key_id = issue(system, f"audit-{uuid.uuid4().hex[:6]}", admin=True)
    training = user.new_run()
    path = training.save_state("audited").result().path
    user.rest.publish_checkpoint_from_tinker_path(path).result()
    copy = user.rest.copy_weights(path, "audited").result(timeout=60)
    user.rest.delete_checkpoint_from_tinker_path(path).result()

    admin = tinker.AdminClient(base_url=system.url, api_key=admin_key)
    entries = admin.get_audit_log("checkpoints").result().entries
    mine = [(e.event, e.tinker_path) for e in entries if e.tinker_path in (path, copy)]
    assert mine == [
        ("checkpoint_created", path),
        ("checkpoint_published", path),
        ("checkpoint_copied", copy),
        ("checkpoint_deleted", path),
    ]
    copied = next(e for e in entries if e.tinker_path == copy)
    assert copied.event_details["source_path"] == path
    assert copied.event_details["tenant"] == user.owner
    keys = admin.get_audit_log("organizations").result().entries
    assert ("api_key_issued", key_id) in {(e.event, e.event_details["key_id"]) for e in keys}
    yesterday = date.today() - timedelta(days=2)
    assert path not in {e.tinker_path for e in admin.get_audit_log(day=yesterday).result().entries}

    with pytest.raises(tinker.PermissionDeniedError, match="admin key"):
        tinker.AdminClient(base_url=system.url, api_key=user.key).get_audit_log().result()
    with _http(system, admin_key) as http:
        refused = http.get("/audit", params={"event_type": "everything"})
        assert refused.status_code == 400 and "event_type" in refused.json()["detail"]


def test_billing_usage_counts_tokens_checkpoints_and_storage_per_tenant(
    system: RunningSystem, stranger: User
) -> None:
    user = User(system)  # a tenant of its own: its usage is exactly what it does here
    training = _trained(user)
    training.save_state("billed").result()
    sampler = training.save_weights_and_get_sampling_client().result()
    sampler.sample(PROMPT, 2, GREEDY).result(timeout=120)

    hour = math.floor(time.time() / 3600) * 3600
    start = datetime.fromtimestamp(hour - 3600, UTC)
    end = datetime.fromtimestamp(hour + 3600, UTC)
    admin = tinker.AdminClient(base_url=system.url, api_key=user.key)
    usage = admin.get_billing_usage(start, end).result()
    totals: dict[str, float] = {}
    for event in usage.data:
        assert event.user_id == user.owner and event.base_model == "tinsmith/tiny"
        info = event.event_info
        amount = getattr(info, "token_count", None) or getattr(info, "count", None)
        totals[info.type] = totals.get(info.type, 0) + (amount or info.gigabyte_hours)
    assert totals["training"] == 4  # the forward_backward's four tokens
    assert totals["sampling_prefill"] == 4 and totals["sampling_sample"] == 12
    assert totals["checkpoint"] == 1 and totals["storage"] > 0
    session_id = training.model_id.rpartition(":train:")[0]
    assert usage.sessions[session_id].user_metadata is None

    theirs = tinker.AdminClient(base_url=system.url, api_key=stranger.key)
    assert session_id not in {
        e.session_id for e in theirs.get_billing_usage(start, end).result().data
    }
    with pytest.raises(tinker.BadRequestError, match="hour"):
        admin.get_billing_usage(start + timedelta(minutes=5), end).result()
    with pytest.raises(tinker.BadRequestError, match="14 days"):
        admin.get_billing_usage(start, start + timedelta(days=15)).result()
    user.service.close("success").result(timeout=30)


def test_whoami_needs_a_jwt_which_tinsmith_does_not_issue(user: User) -> None:
    with pytest.raises(RuntimeError, match="JWT"):
        user.rest.whoami().result(timeout=30)
