"""``examples.autoresearch`` against the running system: a sweep of four runs on the tiny model,
one step in the first rung and two in the second, then what the server and the output say about
it: every run in the sweep with its own configuration, its held-out scores reported at the steps
it was scored at, the better half of each rung kept, the table, the plot and the busy share."""

from __future__ import annotations

import asyncio
import time
import uuid
from pathlib import Path
from typing import Any

import httpx
import pytest

from examples.autoresearch.__main__ import issue_admin_key, main
from examples.rest import NoBusyShare, Rest
from tests.conftest import RunningSystem

pytestmark = pytest.mark.e2e

BEFORE, RUNG_0, RUNG_1 = 0, 1, 3  # the steps scored: before training, after 1 step, after 1 + 2


def _get(system: RunningSystem, key: str, path: str, **params: Any) -> Any:
    response = httpx.get(
        f"{system.url}/api/v1{path}", params=params, headers={"X-API-Key": key}, timeout=60
    )
    assert response.status_code == 200, response.text
    return response.json()


def test_a_sweep_keeps_the_better_half_of_each_rung_and_reports_every_score(
    system: RunningSystem,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    key = f"tml-autoresearch-{uuid.uuid4().hex[:8]}"
    sweep = f"test-sweep-{uuid.uuid4().hex[:6]}"
    plot = tmp_path / "sweep.png"
    monkeypatch.setenv("TINKER_API_KEY", key)
    argv = ["--url", system.url, "--base-model", "tinsmith/tiny", "--sweep", sweep]
    argv += ["--runs", "4", "--rung-steps", "1", "--batch", "2", "--plot", str(plot)]
    argv += ["--admin-key", issue_admin_key(system.data_dir)]
    assert main(argv) == 0
    out = capsys.readouterr().out

    compared = _get(system, key, f"/sweeps/{sweep}", metric="heldout/nll", goal="min")
    runs = {run["training_run_id"]: run for run in compared["runs"]}
    assert len(runs) == 4
    settings = {
        (r["config"]["learning_rate"], r["config"]["lora_rank"], r["config"]["loss"])
        for r in runs.values()
    }
    assert len(settings) == 4  # four different configurations: the half of the 2x2x2 grid
    assert {"learning_rate", "lora_rank", "loss_fn", "loss"} <= set(compared["differs"])

    # Every run was scored before training and at the end of each rung it trained in, and both
    # scores were reported at the same steps.
    nll = {run_id: dict(run["series"]) for run_id, run in runs.items()}
    kept = sorted(run_id for run_id, series in nll.items() if sorted(series) == [0, 1, 3])
    dropped = sorted(run_id for run_id, series in nll.items() if sorted(series) == [0, 1])
    assert len(kept) == 2 and len(dropped) == 2, nll
    for run_id in runs:
        metrics = _get(system, key, f"/training_runs/{run_id}/metrics")["metrics"]
        accuracy = dict(metrics["heldout/accuracy"])
        assert sorted(accuracy) == sorted(nll[run_id])
        assert all(0.0 <= value <= 1.0 for value in accuracy.values())
        assert runs[run_id]["steps"] == (RUNG_1 if run_id in kept else RUNG_0)

    # The halving: the kept runs are the better two at the end of the first rung, the winner the
    # better one at the end of the second; and it learned.
    assert max(nll[run_id][RUNG_0] for run_id in kept) < min(nll[r][RUNG_0] for r in dropped)
    winner = min(kept, key=lambda run_id: nll[run_id][RUNG_1])
    assert nll[winner][RUNG_1] < nll[winner][BEFORE]

    # The table has every run, each with where it stopped; the plot and the busy share are there.
    rows = {line.split()[-1]: line for line in out.splitlines() if line.strip().startswith("#")}
    assert set(rows) == set(runs)
    assert "winner" in rows[winner]
    assert all("out at rung 0" in rows[run_id] for run_id in dropped)
    (loser,) = set(kept) - {winner}
    assert "out at rung 1" in rows[loser]
    assert plot.stat().st_size > 10_000
    (busy,) = [line for line in out.splitlines() if line.startswith("engines' busy share")]
    assert "trainer" in busy and "not measured" not in busy
    assert f"{system.url}/console/#/sweeps/{sweep}" in out
    # The winner's weights are kept under a name, as one of its run's sampler checkpoints.
    saved = _get(system, key, f"/training_runs/{winner}/checkpoints")["checkpoints"]
    (path,) = [c["tinker_path"] for c in saved if c["checkpoint_id"].endswith(f"{sweep}-winner")]
    assert f"the winner's weights: {path}" in out


def test_without_an_admin_key_the_busy_share_says_how_to_get_one(system: RunningSystem) -> None:
    async def read() -> None:
        async with Rest(system.url, "tml-autoresearch-tenant") as rest:
            await rest.busy_shares("tml-autoresearch-tenant", time.time() - 60, time.time())

    with pytest.raises(NoBusyShare, match=r"needs an admin key.*tinsmith keys create"):
        asyncio.run(read())
