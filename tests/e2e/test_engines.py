"""The operators' engines view, through the running system: every service reports its duty
cycle and gauges every two seconds, the gateway keeps the last minutes of them, and only an
admin key reads them (``GET /api/v1/engines``, ``tinsmith top``)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
import uuid

import httpx
import tinker
from tinker import types

from tests.conftest import RunningSystem
from tests.e2e.test_tenancy import issue


def _engines(system: RunningSystem, key: str) -> httpx.Response:
    return httpx.get(f"{system.url}/api/v1/engines", headers={"X-API-Key": key}, timeout=30)


def test_an_admin_sees_each_engine_s_duty_cycle_and_each_tenant_s_usage(
    system: RunningSystem,
) -> None:
    admin, _ = issue(system, f"ops-{uuid.uuid4().hex[:6]}", admin=True)
    tenant_key = f"tml-engines-{uuid.uuid4().hex[:8]}"
    service = tinker.ServiceClient(base_url=system.url, api_key=tenant_key)
    training = service.create_lora_training_client(base_model="tinsmith/tiny", rank=4).result()
    datum = types.Datum(
        model_input=types.ModelInput.from_ints([1, 2, 3]),
        loss_fn_inputs={"target_tokens": [2, 3, 4], "weights": [1.0, 1.0, 1.0]},
    )
    for _ in range(3):
        training.forward_backward([datum], "cross_entropy").result(timeout=120)
        training.optim_step(types.AdamParams(learning_rate=1e-3)).result(timeout=120)
    time.sleep(4.5)  # two more reports from each service

    answer = _engines(system, admin)
    assert answer.status_code == 200, answer.text
    body = answer.json()
    services = {engine["service"] for engine in body["engines"]}
    assert {"trainer", "sampler", "checkpoint", "gateway"} <= services
    (trainer,) = [e for e in body["engines"] if e["service"] == "trainer"]
    assert len(trainer["busy"]) >= 2
    assert trainer["busy_since"] < trainer["busy"][0][0]  # the first interval's start
    assert all(0.0 <= share <= 1.0 for _, share in trainer["busy"])
    assert max(share for _, share in trainer["busy"]) > 0  # it trained in the last minutes
    assert trainer["gauges"]["tinsmith.base_models.loaded"] >= 1
    assert trainer["gauges"]["process.memory.usage"] > 50 * 2**20
    tenants = body["tenants"]
    mine = [usage for usage in tenants.values() if usage["runs"] >= 1 and usage["sessions"] >= 1]
    assert mine, tenants

    refused = _engines(system, tenant_key)
    assert refused.status_code == 403
    assert "admin key" in refused.json()["detail"]

    env = {**os.environ, "TINKER_BASE_URL": system.url, "TINKER_API_KEY": admin}
    top = subprocess.run(
        [sys.executable, "-m", "tinsmith.cli", "top"],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
    )
    assert top.returncode == 0, top.stderr
    lines = top.stdout.splitlines()
    assert lines[0].split()[:4] == ["SERVICE", "REPLICA", "BUSY", "BUSY"]
    assert any(line.startswith("trainer ") for line in lines)
    assert any(line.startswith("TENANT ") for line in lines)
    service.close("success").result(timeout=30)
