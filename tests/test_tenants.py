"""Keys and tenants, decided in one pure module: issuing a key, checking it against the keys
folded from the log, the two modes, quotas and tenant names."""

from __future__ import annotations

import hashlib

import pytest

from tinsmith import events, jobs, tenants
from tinsmith._proto import bus_pb2 as bus
from tinsmith.failures import InvalidRequest, Unauthenticated

DEFAULTS = tenants.Quotas()


def _fold(*log: bus.Event) -> jobs.Projection:
    """The projection a gateway would build from these events, appended in this order."""
    projection = jobs.Projection()
    for seq, event in enumerate(log, start=1):
        projection.apply(seq, event)
    return projection


def _issued(
    tenant: str = "alice", *, admin: bool = False, quotas: bus.Quotas | None = None
) -> tuple[str, bus.KeyIssued, jobs.Projection]:
    key, issued = tenants.issue(tenant, admin=admin, quotas=quotas, label="test")
    return key, issued, _fold(events.make(key_issued=issued))


def _revoked(key_id: str) -> bus.Event:
    return events.make(key_revoked=bus.KeyRevoked(key_id=key_id, reason="test"))


def _authenticate(key: str | None, projection: jobs.Projection, mode: str) -> tenants.Tenant:
    return tenants.authenticate(key, projection.keys, mode=mode, defaults=DEFAULTS)


def test_an_issued_key_is_its_tenant_in_both_modes() -> None:
    key, issued, projection = _issued("alice")
    for mode in tenants.MODES:
        tenant = _authenticate(key, projection, mode)
        assert tenant == tenants.Tenant(
            name="alice", quotas=DEFAULTS, admin=False, key_id=issued.key_id
        )


def test_an_admin_key_says_so() -> None:
    key, _, projection = _issued("ops", admin=True)
    assert _authenticate(key, projection, tenants.KEYS).admin


def test_a_key_has_the_sdk_format_and_its_event_holds_only_a_salted_digest() -> None:
    key, issued = tenants.issue("alice")
    assert key.startswith("tml-")
    assert tenants.key_id_of(key) == issued.key_id
    secret = key.split("_", 1)[1]
    assert len(secret) == 43  # 256 random bits, URL-safe base64
    stored = issued.SerializeToString()
    assert secret.encode() not in stored
    assert key.encode() not in stored
    assert issued.digest == hashlib.sha256(issued.salt + secret.encode()).digest()
    assert len(issued.salt) == 16


def test_every_issue_draws_a_new_id_secret_and_salt() -> None:
    drawn = [tenants.issue("alice") for _ in range(20)]
    assert len({key for key, _ in drawn}) == 20
    assert len({issued.key_id for _, issued in drawn}) == 20
    assert len({issued.salt for _, issued in drawn}) == 20


def test_the_right_key_id_with_the_wrong_secret_is_not_the_key() -> None:
    key, issued, projection = _issued("alice")
    forged = f"tml-{issued.key_id}_{'A' * 43}"
    assert forged != key
    with pytest.raises(Unauthenticated, match="not one this deployment issued") as refused:
        _authenticate(forged, projection, tenants.KEYS)
    assert "A" * 43 not in refused.value.detail
    # In open mode it is a key of its own, never the issued key's tenant.
    tenant = _authenticate(forged, projection, tenants.OPEN)
    assert tenant.name == tenants.open_tenant(forged)
    assert (tenant.admin, tenant.key_id) == (False, "")


@pytest.mark.parametrize("mode", tenants.MODES)
def test_a_revoked_key_is_refused_naming_the_revocation(mode: str) -> None:
    key, issued = tenants.issue("alice")
    projection = _fold(events.make(key_issued=issued), _revoked(issued.key_id))
    with pytest.raises(Unauthenticated, match=f"API key {issued.key_id} was revoked"):
        _authenticate(key, projection, mode)


def test_a_revocation_before_the_issue_revokes_nothing() -> None:
    """The fold keeps only revocations of keys it knows, so a KeyRevoked that races ahead of its
    KeyIssued (or names a key never issued) is harmless."""
    key, issued = tenants.issue("alice")
    projection = _fold(_revoked(issued.key_id), events.make(key_issued=issued))
    assert _authenticate(key, projection, tenants.KEYS).name == "alice"


def test_keys_mode_refuses_a_key_it_did_not_issue() -> None:
    other, _ = tenants.issue("mallory")  # well formed, but never appended to this log
    _, _, projection = _issued("alice")
    for key in (other, "tml-local", "tml-anything-at-all"):
        with pytest.raises(Unauthenticated, match="tinsmith keys create") as refused:
            _authenticate(key, projection, tenants.KEYS)
        assert key not in refused.value.detail


def test_open_mode_makes_each_unissued_key_a_tenant_of_its_own() -> None:
    projection = jobs.Projection()
    first = _authenticate("tml-local", projection, tenants.OPEN)
    again = _authenticate("tml-local", projection, tenants.OPEN)
    other = _authenticate("tml-other", projection, tenants.OPEN)
    assert first == again
    assert first.name != other.name
    assert first.name.startswith("key-")
    assert "local" not in first.name  # named by a digest, never by the key
    assert (first.quotas, first.admin, first.key_id) == (DEFAULTS, False, "")


@pytest.mark.parametrize("mode", tenants.MODES)
@pytest.mark.parametrize("key", [None, ""])
def test_a_call_without_a_key_is_refused(mode: str, key: str | None) -> None:
    with pytest.raises(Unauthenticated, match="carries no API key"):
        _authenticate(key, jobs.Projection(), mode)


@pytest.mark.parametrize("mode", tenants.MODES)
def test_a_key_that_is_not_a_tinsmith_key_is_refused_without_echoing_it(mode: str) -> None:
    with pytest.raises(Unauthenticated, match="start with 'tml-'") as refused:
        _authenticate("sk-live-123456", jobs.Projection(), mode)
    assert "sk-live-123456" not in refused.value.detail


def test_a_keys_quota_overrides_replace_only_the_defaults_they_name() -> None:
    overrides = bus.Quotas(max_runs=2, max_checkpoint_bytes=5 << 20, max_queued_samples=0)
    key, _, projection = _issued("bob", quotas=overrides)
    quotas = _authenticate(key, projection, tenants.KEYS).quotas
    assert (quotas.max_runs, quotas.max_checkpoint_bytes) == (2, 5 << 20)
    assert quotas.max_queued_samples == 0  # an override of 0 is an override, not "unset"
    assert quotas.max_sessions == DEFAULTS.max_sessions
    assert quotas.max_inflight == DEFAULTS.max_inflight


def test_a_key_without_overrides_has_the_deployments_defaults() -> None:
    defaults = tenants.Quotas(max_runs=1, max_sessions=2)
    key, issued, projection = _issued("bob")
    tenant = tenants.authenticate(key, projection.keys, mode=tenants.KEYS, defaults=defaults)
    assert tenant.quotas == defaults
    assert not issued.quotas.ListFields()


def test_quota_defaults_come_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TINSMITH_TENANT_MAX_RUNS", "3")
    monkeypatch.setenv("TINSMITH_TENANT_MAX_CHECKPOINT_MB", "10")
    monkeypatch.setenv("TINSMITH_TENANT_MAX_INFLIGHT", " ")  # blank: the default
    quotas = tenants.Quotas.from_env()
    assert (quotas.max_runs, quotas.max_checkpoint_bytes) == (3, 10 << 20)
    assert quotas.max_inflight == DEFAULTS.max_inflight
    monkeypatch.setenv("TINSMITH_TENANT_MAX_SESSIONS", "-1")
    with pytest.raises(SystemExit, match="TINSMITH_TENANT_MAX_SESSIONS must be a non-negative"):
        tenants.Quotas.from_env()


@pytest.mark.parametrize(
    ("host", "mode"),
    [
        ("127.0.0.1", tenants.OPEN),
        ("127.0.0.2", tenants.OPEN),
        ("localhost", tenants.OPEN),
        ("::1", tenants.OPEN),
        ("0.0.0.0", tenants.KEYS),
        ("::", tenants.KEYS),
        ("10.1.2.3", tenants.KEYS),
        ("tinsmith.example.org", tenants.KEYS),
    ],
)
def test_the_default_mode_is_open_only_on_loopback(
    monkeypatch: pytest.MonkeyPatch, host: str, mode: str
) -> None:
    monkeypatch.delenv("TINSMITH_AUTH", raising=False)
    assert tenants.mode_from_env(host) == mode


def test_tinsmith_auth_overrides_the_default_either_way(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TINSMITH_AUTH", " Keys ")
    assert tenants.mode_from_env("127.0.0.1") == tenants.KEYS
    monkeypatch.setenv("TINSMITH_AUTH", "open")
    assert tenants.mode_from_env("0.0.0.0") == tenants.OPEN
    monkeypatch.setenv("TINSMITH_AUTH", "")
    assert tenants.mode_from_env("0.0.0.0") == tenants.KEYS


def test_an_unknown_mode_stops_the_process_naming_the_choices(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("TINSMITH_AUTH", "none")
    with pytest.raises(SystemExit, match="TINSMITH_AUTH must be one of keys, open, got 'none'"):
        tenants.mode_from_env("127.0.0.1")


@pytest.mark.parametrize("name", ["alice", "a", "9", "Team.ML_ops-2", "x" * 64, "keys", "key"])
def test_tenant_names_that_are_accepted(name: str) -> None:
    assert tenants.check_tenant(name) == name


@pytest.mark.parametrize(
    "name",
    ["", "x" * 65, "-alice", ".alice", "_alice", "al ice", "al/ice", "alice\n", "é", "key-abc"],
)
def test_tenant_names_that_are_refused(name: str) -> None:
    with pytest.raises(InvalidRequest, match="is not accepted"):
        tenants.check_tenant(name)
    with pytest.raises(InvalidRequest):  # and no key is issued for one
        tenants.issue(name)


def test_a_refused_tenant_name_is_cut_short_in_the_message() -> None:
    with pytest.raises(InvalidRequest) as refused:
        tenants.check_tenant("!" * 10_000)
    assert len(refused.value.detail) < 400


@pytest.mark.parametrize(
    "key",
    [
        "tml-local",
        "tml-0123456789abcdef",
        "tml-0123456789ABCDEF_" + "a" * 43,  # the id is lower-case hex
        "tml-0123456789abcdef_" + "a" * 42,
        "tml-0123456789abcdef_" + "a" * 43 + "\n",
        "xtml-0123456789abcdef_" + "a" * 43,
    ],
)
def test_only_the_issued_format_has_a_key_id(key: str) -> None:
    assert tenants.key_id_of(key) is None


def test_the_issued_format_has_its_key_id() -> None:
    assert tenants.key_id_of("tml-0123456789abcdef_" + "a-_" * 14 + "Z") == "0123456789abcdef"
