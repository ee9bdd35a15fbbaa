"""``tinsmith keys create | list | revoke`` against a real nats-server: the key printed once is one
the gateways accept, a listing shows no secret material, a revocation is refused from then on,
and a deployment that cannot be reached is a prompt, clear failure. Also how a running
``tinsmith up`` is found (its data directory records its NATS) and what ``up`` announces."""

from __future__ import annotations

import asyncio
import base64
import os
import re
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.conftest import RunningSystem
from tinsmith import events, keyadmin, subjects, tenants
from tinsmith._proto import bus_pb2 as bus
from tinsmith.cli import main
from tinsmith.embedded import (
    NATS_URL_FILE,
    forget_nats_url,
    free_port,
    record_nats_url,
    recorded_nats_url,
)
from tinsmith.eventlog import EventLog, FollowedProjection
from tinsmith.failures import InvalidRequest, Unauthenticated, Unavailable

DEFAULTS = tenants.Quotas()
_KEY_LINE = re.compile(r"^key +(tml-\S+)$", re.MULTILINE)


async def _tinsmith(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    """Run the real command in this process (in a thread: it runs its own event loop)."""
    capsys.readouterr()
    code = await asyncio.to_thread(main, list(argv))
    out, err = capsys.readouterr()
    return code, out, err


async def _replayed(eventlog: EventLog) -> FollowedProjection:
    """A projection of the whole log, as a gateway builds one."""
    projection = FollowedProjection(eventlog)
    await projection.start()
    return projection


async def _key_events(eventlog: EventLog) -> list[bus.Event]:
    last = await eventlog.bus.last_seq(subjects.EVENTS_STREAM)
    found = []
    for seq in range(1, last + 1):
        event = events.decode(await eventlog.bus.get(subjects.EVENTS_STREAM, seq))
        if event.WhichOneof("kind") in ("key_issued", "key_revoked"):
            found.append(event)
    return found


async def _create(capsys: pytest.CaptureFixture[str], nats_url: str, *flags: str) -> str:
    code, out, err = await _tinsmith(capsys, "keys", "create", "--nats-url", nats_url, *flags)
    assert code == 0, err
    found = _KEY_LINE.search(out)
    assert found is not None, out
    return found.group(1)


# -- against a real nats-server --------------------------------------------------------------------


async def test_create_prints_a_key_the_gateways_accept(
    eventlog: EventLog, nats_url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    code, out, err = await _tinsmith(
        capsys,
        "keys",
        "create",
        "--nats-url",
        nats_url,
        "--tenant",
        "alice",
        "--label",
        "ci runner",
        "--max-runs",
        "2",
        "--max-checkpoint-mb",
        "1024",
    )
    assert (code, err) == (0, "")
    key = _KEY_LINE.search(out)
    assert key is not None, out
    key_id = tenants.key_id_of(key.group(1))
    assert key_id is not None
    assert re.search(rf"^key id +{key_id}$", out, re.MULTILINE)
    assert re.search(r"^tenant +alice$", out, re.MULTILINE)
    assert re.search(r"^admin +no$", out, re.MULTILINE)
    assert re.search(r"^label +ci runner$", out, re.MULTILINE)
    assert "max_runs=2, max_checkpoint_mb=1024" in out
    assert "only time the key is shown" in out

    projection = await _replayed(eventlog)
    tenant = tenants.authenticate(
        key.group(1), projection.state.keys, mode=tenants.KEYS, defaults=DEFAULTS
    )
    assert (tenant.name, tenant.admin, tenant.key_id) == ("alice", False, key_id)
    assert (tenant.quotas.max_runs, tenant.quotas.max_checkpoint_bytes) == (2, 1 << 30)
    assert tenant.quotas.max_sessions == DEFAULTS.max_sessions


async def test_the_key_itself_is_nowhere_in_the_log(
    eventlog: EventLog, nats_url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    key = await _create(capsys, nats_url, "--tenant", "alice", "--admin")
    secret = key.split("_", 1)[1]
    last = await eventlog.bus.last_seq(subjects.EVENTS_STREAM)
    assert last == 1
    stored = await eventlog.bus.get(subjects.EVENTS_STREAM, 1)
    assert secret.encode() not in stored
    (issued,) = await _key_events(eventlog)
    assert (issued.key_issued.tenant, issued.key_issued.admin) == ("alice", True)


async def test_list_shows_every_key_without_secret_material(
    eventlog: EventLog, nats_url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    alice = await _create(
        capsys, nats_url, "--tenant", "alice", "--label", "laptop", "--max-sessions", "3"
    )
    ops = await _create(capsys, nats_url, "--tenant", "ops", "--admin")
    code, out, err = await _tinsmith(capsys, "keys", "list", "--nats-url", nats_url)
    assert (code, err) == (0, "")
    lines = out.splitlines()
    assert lines[0].split()[:3] == ["KEY", "ID", "TENANT"]
    assert len(lines) == 3
    assert lines[1].split()[:3] == [tenants.key_id_of(alice), "alice", "no"]
    assert lines[2].split()[:3] == [tenants.key_id_of(ops), "ops", "yes"]
    assert "max_sessions=3" in lines[1] and "laptop" in lines[1]
    assert "defaults" in lines[2]
    for key in (alice, ops):
        assert key.split("_", 1)[1] not in out
    for event in await _key_events(eventlog):
        issued = event.key_issued
        for secret_material in (issued.digest, issued.salt):
            assert secret_material.hex() not in out
            assert base64.b64encode(secret_material).decode() not in out
            assert base64.urlsafe_b64encode(secret_material).decode().rstrip("=") not in out


async def test_list_of_a_log_without_keys_says_so(
    eventlog: EventLog, nats_url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    await eventlog.append(events.make(session_created=bus.SessionCreated(session_id="s")))
    code, out, _ = await _tinsmith(capsys, "keys", "list", "--nats-url", nats_url)
    assert code == 0
    assert out.startswith("no keys were issued yet")


async def test_list_skips_what_is_not_a_key_event(
    eventlog: EventLog, nats_url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """Bytes on a key subject that are not an event, or an event with no kind, are skipped (the
    gateways' projection skips them too) instead of stalling or failing the listing."""
    junk = subjects.event_subject("key", "junk")
    await eventlog.bus.publish(junk, b"\xff\xff\xff")
    await eventlog.bus.publish(junk, b"")
    key = await _create(capsys, nats_url, "--tenant", "alice")
    await eventlog.bus.publish(junk, b"\xff")
    code, out, err = await _tinsmith(capsys, "keys", "list", "--nats-url", nats_url)
    assert (code, err) == (0, "")
    (_, row) = out.splitlines()
    assert row.split()[:2] == [tenants.key_id_of(key), "alice"]


async def test_a_revoked_key_is_refused_and_revoking_twice_is_harmless(
    eventlog: EventLog, nats_url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    key = await _create(capsys, nats_url, "--tenant", "alice")
    kept = await _create(capsys, nats_url, "--tenant", "alice")
    key_id = tenants.key_id_of(key)
    assert key_id is not None
    revoke = ("keys", "revoke", key_id, "--nats-url", nats_url, "--reason", "left the team")
    code, out, err = await _tinsmith(capsys, *revoke)
    assert (code, err) == (0, "")
    assert f"key {key_id} of tenant alice revoked" in out

    projection = await _replayed(eventlog)
    for mode in tenants.MODES:
        with pytest.raises(Unauthenticated, match=f"API key {key_id} was revoked"):
            tenants.authenticate(key, projection.state.keys, mode=mode, defaults=DEFAULTS)
    still = tenants.authenticate(kept, projection.state.keys, mode=tenants.KEYS, defaults=DEFAULTS)
    assert still.name == "alice"

    code, out, err = await _tinsmith(capsys, *revoke)
    assert (code, err) == (0, "")
    assert "revoked already" in out
    kinds = [event.WhichOneof("kind") for event in await _key_events(eventlog)]
    assert kinds == ["key_issued", "key_issued", "key_revoked"]

    code, out, _ = await _tinsmith(capsys, "keys", "list", "--nats-url", nats_url)
    (row,) = [line for line in out.splitlines() if line.startswith(key_id)]
    assert row.endswith("left the team")
    assert row.split()[4] != "no"  # the revocation's time
    (other,) = [line for line in out.splitlines() if line.startswith(str(tenants.key_id_of(kept)))]
    assert other.split()[4] == "no"


async def test_a_key_can_be_revoked_by_the_whole_key(
    eventlog: EventLog, nats_url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    key = await _create(capsys, nats_url, "--tenant", "alice")
    code, out, _ = await _tinsmith(capsys, "keys", "revoke", key, "--nats-url", nats_url)
    assert code == 0
    assert key not in out  # the operator's terminal gets the id, not the key again
    (_, revoked) = await _key_events(eventlog)
    assert revoked.key_revoked.key_id == tenants.key_id_of(key)


@pytest.mark.parametrize("key_id", ["0123456789abcdef", "no-such-key", "tml-not-a-key"])
async def test_revoking_an_unknown_key_fails_and_appends_nothing(
    eventlog: EventLog, nats_url: str, capsys: pytest.CaptureFixture[str], key_id: str
) -> None:
    await _create(capsys, nats_url, "--tenant", "alice")
    before = await eventlog.bus.last_seq(subjects.EVENTS_STREAM)
    code, out, err = await _tinsmith(capsys, "keys", "revoke", key_id, "--nats-url", nats_url)
    assert code == 1
    assert out == ""
    assert err.startswith("tinsmith keys revoke: ")
    assert "`tinsmith keys list` shows the key ids" in err
    assert len(err.strip().splitlines()) == 1  # a message, not a traceback
    assert await eventlog.bus.last_seq(subjects.EVENTS_STREAM) == before


async def test_a_nats_without_the_event_log_is_a_clear_error(
    eventlog: EventLog, nats_url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    await eventlog.bus.js.delete_stream(subjects.EVENTS_STREAM)
    try:
        code, out, err = await _tinsmith(
            capsys, "keys", "create", "--tenant", "alice", "--nats-url", nats_url
        )
    finally:
        await eventlog.bus.ensure_streams(results_max_age_s=60)
    assert (code, out) == (1, "")
    assert f"holds no tinsmith event log (stream {subjects.EVENTS_STREAM})" in err
    assert "tml-" not in err


async def test_keys_finds_the_nats_a_data_directory_records(
    eventlog: EventLog,
    nats_url: str,
    capsys: pytest.CaptureFixture[str],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("TINSMITH_NATS_URL", raising=False)
    key = await _create(capsys, nats_url, "--tenant", "alice")
    code, _, err = await _tinsmith(capsys, "keys", "list", "--data-dir", str(tmp_path))
    assert code == 1
    assert f"{tmp_path} holds no {NATS_URL_FILE}" in err
    record_nats_url(tmp_path, nats_url)
    code, out, err = await _tinsmith(capsys, "keys", "list", "--data-dir", str(tmp_path))
    assert (code, err) == (0, "")
    assert str(tenants.key_id_of(key)) in out
    # TINSMITH_NATS_URL comes before the data directory, and --nats-url before both.
    monkeypatch.setenv("TINSMITH_NATS_URL", f"nats://127.0.0.1:{free_port()}")
    code, _, err = await _tinsmith(capsys, "keys", "list", "--data-dir", str(tmp_path))
    assert code == 1
    assert "(from TINSMITH_NATS_URL)" in err
    argv = ("keys", "list", "--data-dir", str(tmp_path), "--nats-url", nats_url)
    assert (await _tinsmith(capsys, *argv))[0] == 0


# -- failures before anything is appended ----------------------------------------------------------


def test_an_unreachable_nats_fails_fast_with_a_message() -> None:
    """The real executable, so the exit status and the streams are what an operator sees."""
    url = f"nats://operator:hunter2@127.0.0.1:{free_port()}"
    started = time.monotonic()
    done = subprocess.run(
        [str(Path(sys.executable).parent / "tinsmith"), "keys", "list", "--nats-url", url],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "TINSMITH_NATS_URL": ""},
    )
    assert time.monotonic() - started < 15
    assert (done.returncode, done.stdout) == (1, "")
    assert done.stderr.startswith("tinsmith keys list: cannot reach NATS at nats://***@127.0.0.1:")
    assert "hunter2" not in done.stderr
    assert "Traceback" not in done.stderr


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--tenant", "key-abc"], "tenant name 'key-abc' is not accepted"),
        (["--tenant", "a b"], "is not accepted"),
        (["--tenant", "alice", "--label", "two\nlines"], "the label must be one line"),
        (["--tenant", "alice", "--max-runs", "many"], "invalid int value"),
    ],
)
def test_bad_create_arguments_are_usage_errors(
    capsys: pytest.CaptureFixture[str], flags: list[str], message: str
) -> None:
    with pytest.raises(SystemExit) as exited:
        main(["keys", "create", "--nats-url", "nats://127.0.0.1:1", *flags])
    assert exited.value.code == 2
    assert message in capsys.readouterr().err


def test_a_quota_out_of_range_fails_before_connecting(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["keys", "create", "--tenant", "a", "--max-inflight", "-1", "--nats-url", "nats://h:1"]
    assert main(argv) == 1
    assert capsys.readouterr().err == (
        "tinsmith keys create: --max-inflight must be between 0 and 2147483647, got -1\n"
    )


# -- the pure parts --------------------------------------------------------------------------------


def test_quota_flags_become_overrides() -> None:
    overrides = keyadmin.quotas(
        max_runs=2, max_sessions=None, max_checkpoint_mb=3, max_inflight=0, max_queued_samples=None
    )
    assert overrides == bus.Quotas(max_runs=2, max_checkpoint_bytes=3 << 20, max_inflight=0)
    assert overrides.HasField("max_inflight")
    assert not overrides.HasField("max_sessions")
    assert keyadmin.quota_text(overrides) == "max_runs=2,max_checkpoint_mb=3,max_inflight=0"
    assert keyadmin.quota_text(bus.Quotas()) == "defaults"
    assert keyadmin.quota_text(bus.Quotas(max_checkpoint_bytes=1000)) == (
        "max_checkpoint_bytes=1000"
    )
    with pytest.raises(InvalidRequest, match="--max-runs must be between 0 and 2147483647"):
        keyadmin.quotas(max_runs=2**31)
    with pytest.raises(ValueError, match="unknown quota"):
        keyadmin.quotas(max_things=1)


def _event(at: float, **kind: object) -> bus.Event:
    event = events.make(**kind)
    event.time = at
    return event


def test_rows_fold_the_key_events_as_the_gateway_does() -> None:
    _, first = tenants.issue("alice", label="laptop")
    _, second = tenants.issue("ops", admin=True, quotas=bus.Quotas(max_runs=1))
    log = [
        _event(5.0, key_revoked=bus.KeyRevoked(key_id=second.key_id, reason="too early")),
        _event(10.0, key_issued=second),
        _event(1.0, key_issued=first),  # the log's order, not the clock's, decides the fold
        _event(20.0, key_revoked=bus.KeyRevoked(key_id=second.key_id, reason="rotated")),
        _event(30.0, key_revoked=bus.KeyRevoked(key_id=second.key_id, reason="again")),
    ]
    alice, ops = keyadmin.rows(enumerate(log, start=1))
    assert (alice.key_id, alice.tenant, alice.label, alice.revoked_at) == (
        first.key_id,
        "alice",
        "laptop",
        None,
    )
    assert (ops.admin, ops.quotas.max_runs, ops.issued_at) == (True, 1, 10.0)
    assert (ops.revoked_at, ops.reason) == (20.0, "rotated")


def test_the_table_aligns_its_columns_and_escapes_what_is_unprintable() -> None:
    row = keyadmin.KeyRow(
        key_id="0123456789abcdef",
        tenant="alice",
        admin=False,
        label="a\x1b[2Jb",
        quotas=bus.Quotas(max_runs=4),
        issued_at=0.0,
    )
    text = keyadmin.table(
        [row, keyadmin.KeyRow("fedcba9876543210", "b", True, "", bus.Quotas(), 60)]
    )
    header, first, second = text.splitlines()
    assert header.index("TENANT") == first.index("alice") == second.index("b ")
    assert first.split() == [
        "0123456789abcdef",
        "alice",
        "no",
        "1970-01-01T00:00:00Z",
        "no",
        "max_runs=4",
        "a\\x1b[2Jb",
        "-",
    ]
    assert "\x1b" not in text
    assert second.split()[2:5] == ["yes", "1970-01-01T00:01:00Z", "no"]


def test_labels_and_reasons_are_one_short_printable_line() -> None:
    assert keyadmin.check_text("ci runner #3", "label") == "ci runner #3"
    for bad in ("a\nb", "tab\there", "x" * 201):
        with pytest.raises(InvalidRequest, match="the reason must be one line"):
            keyadmin.check_text(bad, "reason")


def test_locate_prefers_the_flag_then_the_variable_then_the_data_directory(
    tmp_path: Path,
) -> None:
    record_nats_url(tmp_path, "nats://127.0.0.1:4999")
    env = {"TINSMITH_NATS_URL": "nats://bus:4222"}
    assert keyadmin.locate("nats://flag:1", tmp_path, env).url == "nats://flag:1"
    assert keyadmin.locate(None, tmp_path, env) == keyadmin.Source(
        "nats://bus:4222", "TINSMITH_NATS_URL"
    )
    assert keyadmin.locate(None, tmp_path, {}) == keyadmin.Source(
        "nats://127.0.0.1:4999", str(tmp_path / NATS_URL_FILE)
    )
    with pytest.raises(Unavailable, match="start `tinsmith up`"):
        keyadmin.locate(None, tmp_path / "elsewhere", {})


def test_a_shown_url_leaves_out_its_credentials() -> None:
    for url, shown in [
        ("nats://user:pw@host:4222", "nats://***@host:4222"),
        ("nats://token@host:4222", "nats://***@host:4222"),
        ("tls://u:p@a@host:4222/x", "tls://***@host:4222/x"),
        ("nats://host:4222", "nats://host:4222"),
    ]:
        assert keyadmin.Source(url, "--nats-url").shown == f"{shown} (from --nats-url)"


# -- tinsmith up's record of its NATS --------------------------------------------------------------


def test_the_recorded_nats_url_is_its_owners_alone_and_forgotten_only_by_its_writer(
    tmp_path: Path,
) -> None:
    assert recorded_nats_url(tmp_path) is None
    record = tmp_path / NATS_URL_FILE
    record.write_text("nats://old:1\n")
    record.chmod(0o644)  # left by something else, readable by all
    record_nats_url(tmp_path, "nats://user:pw@127.0.0.1:4222")
    assert stat.S_IMODE(record.stat().st_mode) == 0o600
    assert recorded_nats_url(tmp_path) == "nats://user:pw@127.0.0.1:4222"
    forget_nats_url(tmp_path, "nats://127.0.0.1:9999")  # another launcher's: kept
    assert recorded_nats_url(tmp_path) == "nats://user:pw@127.0.0.1:4222"
    forget_nats_url(tmp_path, "nats://user:pw@127.0.0.1:4222")
    assert not record.exists()
    forget_nats_url(tmp_path, "nats://user:pw@127.0.0.1:4222")  # gone already: nothing to do


def test_up_refuses_an_unknown_auth_mode_before_starting_anything(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TINSMITH_AUTH", "nobody")
    with pytest.raises(SystemExit, match="TINSMITH_AUTH must be one of keys, open"):
        main(["up", "--port", str(free_port()), "--data-dir", str(tmp_path / "data")])
    assert not (tmp_path / "data").exists()


def _gateway_environment(launcher: int) -> dict[str, str]:
    for status in Path("/proc").glob("[0-9]*/status"):
        try:
            if f"\nPPid:\t{launcher}\n" not in status.read_text():
                continue
            argv = (status.parent / "cmdline").read_bytes().split(b"\0")
            environ = (status.parent / "environ").read_bytes()
        except OSError:
            continue
        if argv[-3:-1] == [b"serve", b"gateway"]:
            pairs = (entry.partition("=") for entry in environ.decode().split("\0") if entry)
            return {name: value for name, _, value in pairs}
    raise AssertionError(f"no gateway among the children of {launcher}")


async def test_up_announces_its_auth_mode_first_and_records_its_nats(
    system: RunningSystem, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """On loopback with TINSMITH_AUTH unset: open mode, said before anything else, and given to
    the gateway; ``keys`` finds this system through its data directory alone."""
    said = [line.rstrip("\n") for line in system.up.output]
    auth = said.index(
        "tinsmith auth: open (any tml- key is its own tenant; set TINSMITH_AUTH=keys to require "
        "issued keys)"
    )
    grpc = said.index(f"tinsmith gRPC at {system.grpc_target}")
    assert auth < grpc < said.index(f"tinsmith ready at {system.url}")
    assert _gateway_environment(system.process.pid)["TINSMITH_AUTH"] == "open"

    record = system.data_dir / NATS_URL_FILE
    assert stat.S_IMODE(record.stat().st_mode) == 0o600
    assert (
        recorded_nats_url(system.data_dir)
        == _gateway_environment(system.process.pid)["TINSMITH_NATS_URL"]
    )
    monkeypatch.delenv("TINSMITH_NATS_URL", raising=False)
    code, out, err = await _tinsmith(capsys, "keys", "list", "--data-dir", str(system.data_dir))
    assert (code, err) == (0, ""), err
    assert out.startswith(("KEY ID", "no keys were issued yet"))
