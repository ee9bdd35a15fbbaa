"""Keys against real gateway replicas on a real event log: a key issued on the log is accepted by
every replica, and its revocation reaches every replica within moments."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

import pytest

from services.gateway.config import GatewayConfig
from services.gateway.handlers import Gateway
from tinsmith import events, tenants
from tinsmith._proto import bus_pb2 as bus
from tinsmith.bus import Bus
from tinsmith.eventlog import EventLog
from tinsmith.failures import Unauthenticated


@pytest.fixture
async def replicas(eventlog: EventLog, nats_url: str) -> AsyncIterator[list[Gateway]]:
    """Two gateway replicas in keys mode, each with its own connection and projection."""
    connections = [await Bus.connect(nats_url, name=f"gateway-{i}") for i in range(2)]
    gateways = [Gateway(GatewayConfig(auth=tenants.KEYS), EventLog(c)) for c in connections]
    for gateway in gateways:
        await gateway.start()
    yield gateways
    for connection in connections:
        await connection.close()


async def test_a_revoked_key_is_refused_by_every_replica_within_a_second(
    eventlog: EventLog, replicas: list[Gateway]
) -> None:
    key, issued = tenants.issue("alice", quotas=bus.Quotas(max_runs=3))
    await eventlog.append(events.make(key_issued=issued))
    for gateway in replicas:  # issued a moment ago: each replica catches up to find it
        tenant = await gateway.authenticate(key)
        assert (tenant.name, tenant.quotas.max_runs, tenant.key_id) == ("alice", 3, issued.key_id)

    await eventlog.append(events.make(key_revoked=bus.KeyRevoked(key_id=issued.key_id)))
    started = time.monotonic()
    for gateway in replicas:
        while True:
            try:
                await gateway.authenticate(key)
            except Unauthenticated as refused:
                assert "revoked" in refused.detail
                break
            assert time.monotonic() - started < 1.0, "the revocation did not arrive in time"
            await asyncio.sleep(0.01)


async def test_keys_mode_refuses_what_was_not_issued(replicas: list[Gateway]) -> None:
    gateway = replicas[0]
    forged = "tml-0123456789abcdef_" + "x" * 43
    for key in (None, "", "sk-not-tinker", "tml-anything", forged):
        with pytest.raises(Unauthenticated):
            await gateway.authenticate(key)


async def test_open_mode_makes_each_key_its_own_tenant_and_still_honours_issued_keys(
    eventlog: EventLog, nats_url: str
) -> None:
    connection = await Bus.connect(nats_url, name="gateway-open")
    try:
        gateway = Gateway(GatewayConfig(auth=tenants.OPEN), EventLog(connection))
        await gateway.start()
        first = await gateway.authenticate("tml-one")
        second = await gateway.authenticate("tml-two")
        assert first.name != second.name and first.name.startswith("key-")
        assert "tml-one" not in first.name
        key, issued = tenants.issue("bob", admin=True)
        await eventlog.append(events.make(key_issued=issued))
        tenant = await gateway.authenticate(key)
        assert (tenant.name, tenant.admin) == ("bob", True)
        await eventlog.append(events.make(key_revoked=bus.KeyRevoked(key_id=issued.key_id)))
        await gateway.projection.catch_up()
        with pytest.raises(Unauthenticated):
            await gateway.authenticate(key)
        with pytest.raises(Unauthenticated):
            await gateway.authenticate(None)
    finally:
        await connection.close()
