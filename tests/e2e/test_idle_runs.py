"""A run whose session stops heart-beating is snapshotted and unloaded; its next call restores
it without the client noticing. A stopping trainer snapshots the runs it holds, so they come
back after the whole system restarts."""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np
import tinker
from safetensors.numpy import load_file
from tinker import types

from tests.conftest import start_system, stop_system
from tinsmith.embedded import free_port

ADAM = types.AdamParams(learning_rate=1e-2)
IDLE = {"TINSMITH_IDLE_UNLOAD_S": "1"}


def _steps(training: tinker.TrainingClient, seeds: range) -> None:
    for seed in seeds:
        ids = np.random.default_rng(seed).integers(3, 512, size=10).tolist()
        datum = types.Datum(
            model_input=types.ModelInput.from_ints(ids[:-1]),
            loss_fn_inputs={"target_tokens": ids[1:], "weights": [1.0] * 9},
        )
        fb = training.forward_backward([datum], "cross_entropy")
        training.optim_step(ADAM).result()
        fb.result()


def _adapter(data_dir: Path, tinker_path: str) -> dict[str, np.ndarray]:
    run, segment, name = tinker_path.removeprefix("tinker://").split("/")
    return load_file(
        str(data_dir / "blobs/runs" / run / segment / name / "adapter_model.safetensors")
    )


def _wait_for_snapshot(data_dir: Path, model_id: str, timeout: float = 30.0) -> None:
    snapshots = data_dir / "blobs/runs" / model_id / "snapshots"
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if snapshots.exists() and any((s / ".complete").exists() for s in snapshots.iterdir()):
            return
        time.sleep(0.2)
    raise AssertionError(f"no snapshot of {model_id} within {timeout} s")


def test_idle_runs_come_back_exactly_also_after_a_restart(tmp_path: Path) -> None:
    port = free_port()
    system = start_system(tmp_path, port=port, env=IDLE)
    try:
        service = tinker.ServiceClient(base_url=system.url, api_key="tml-e2e")
        reference = service.create_lora_training_client("tinsmith/tiny", rank=4, seed=3).result()
        _steps(reference, range(6))
        expected = _adapter(tmp_path, reference.save_state("six").result().path)

        training = service.create_lora_training_client("tinsmith/tiny", rank=4, seed=3).result()
        _steps(training, range(2))
        _wait_for_snapshot(tmp_path, training.model_id)  # heartbeats come every 10 s: idle
        _steps(training, range(2, 4))  # restored on this call

    finally:
        stop_system(system)

    # The run was in memory when the system stopped: the trainer snapshotted it on the way out,
    # and a new trainer process restores it from the log.
    system = start_system(tmp_path, port=port, env=IDLE)
    try:
        _steps(training, range(4, 6))  # the same client object: nothing to notice
        got = _adapter(tmp_path, training.save_state("six").result().path)
        assert max(float(np.max(np.abs(got[k] - expected[k]))) for k in expected) <= 1e-6
        service.close("success").result(timeout=30)
    finally:
        stop_system(system)
