"""`tinsmith up` starts everything, and a signal stops everything: nothing is left behind. A
child that dies is started again, the same way, and the system answers again; one that keeps
dying waits ever longer; and Ctrl-C stops the services while their NATS still runs."""

from __future__ import annotations

import asyncio
import os
import signal
import time
import urllib.request
from pathlib import Path

import numpy as np
import pytest
import tinker
from safetensors.numpy import load_file
from tinker import types

from tests.conftest import RunningSystem, start_system, stop_system
from tests.e2e.supervised import (
    CHILDREN,
    child_pid,
    child_pids,
    environment,
    kill_child,
    restart_lines,
)
from tinsmith import events, subjects
from tinsmith.bus import Bus
from tinsmith.embedded import free_port, recorded_nats_url

KEY = "tml-supervised"
ADAM = types.AdamParams(learning_rate=1e-2)


def _children(pid: int) -> set[int]:
    found = set()
    for status in Path("/proc").glob("[0-9]*/status"):
        try:
            text = status.read_text()
        except OSError:
            continue
        if f"\nPPid:\t{pid}\n" in text:
            found.add(int(status.parent.name))
    return found


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/status").read_text().split("State:\t", 1)[1][0]
    except (OSError, IndexError):
        return False
    return state != "Z"


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
def test_a_signal_stops_every_process(tmp_path: Path, signum: signal.Signals) -> None:
    system = start_system(tmp_path)
    children = _children(system.process.pid)
    # The nats-server, the four services and the standby interpreter.
    assert set(child_pids(system.process.pid)) == {*CHILDREN, "standby"}, system.logs()
    assert len(children) == 6, system.logs()
    system.process.send_signal(signum)
    assert system.process.wait(60) == 0
    assert not [pid for pid in children if _alive(pid)]


def test_the_standby_imports_at_the_lowest_priority_and_serves_at_its_own(tmp_path: Path) -> None:
    """The standby interpreter imports torch, transformers and peft while the services take
    their first work (it starts as the launcher is ready): on a thread of the lowest CPU
    priority, which ends with the imports. Once ready, no thread of it is left at that priority:
    not its main thread, which becomes a service, nor one a library started while imported
    (numpy's BLAS workers)."""
    system = start_system(tmp_path)
    try:
        system.up.wait_standby(120)
        pid = child_pids(system.process.pid)["standby"]
        own = os.getpriority(os.PRIO_PROCESS, 0)
        nice = {  # field 19 of /proc/PID/task/TID/stat; the name (field 2) has no spaces here
            int(task.name): int((task / "stat").read_text().split()[18])
            for task in Path(f"/proc/{pid}/task").iterdir()
        }
        assert nice and all(value == own for value in nice.values()), nice
        assert "of imports" in (system.data_dir / "logs" / "standby.log").read_text()
    finally:
        system.up.stop(60)


def test_killing_the_launcher_still_stops_its_children(tmp_path: Path) -> None:
    system = start_system(tmp_path)
    kill_child(system.up, "sampler")  # a child started again is one like the others
    children = _children(system.process.pid)
    assert set(child_pids(system.process.pid)) >= set(CHILDREN), system.logs()
    os.kill(system.process.pid, signal.SIGKILL)
    system.process.wait(10)
    for pid in children:  # they get SIGTERM from the kernel (PR_SET_PDEATHSIG) and exit
        for _ in range(200):
            if not _alive(pid):
                break
            time.sleep(0.1)
    assert not [pid for pid in children if _alive(pid)]


def test_what_the_system_writes_is_its_owners_alone(tmp_path: Path) -> None:
    """The catalog, the logs, the event log and the object store (with the key that signs
    download URLs) were readable by every user of the machine."""
    system = start_system(tmp_path / "data")
    try:
        assert (system.data_dir.stat().st_mode & 0o777) == 0o700
        written = [p for p in system.data_dir.rglob("*") if p.is_file()]
        assert any(p.name == "catalog.db" for p in written)
        assert any(p.suffix == ".log" for p in written)
        loose = [p for p in written if p.stat().st_mode & 0o077]
        assert not loose, loose
    finally:
        system.up.stop(60)


def _steps(training: tinker.TrainingClient, seeds: range) -> None:
    for seed in seeds:
        ids = np.random.default_rng(seed).integers(3, 512, size=10).tolist()
        datum = types.Datum(
            model_input=types.ModelInput.from_ints(ids[:-1]),
            loss_fn_inputs={"target_tokens": ids[1:], "weights": [1.0] * 9},
        )
        fb = training.forward_backward([datum], "cross_entropy")
        training.optim_step(ADAM).result(timeout=120)
        fb.result(timeout=120)


def _adapter(data_dir: Path, tinker_path: str) -> dict[str, np.ndarray]:
    run, segment, name = tinker_path.removeprefix("tinker://").split("/")
    return load_file(
        str(data_dir / "blobs/runs" / run / segment / name / "adapter_model.safetensors")
    )


def _every_service_answers(system: RunningSystem, service: tinker.ServiceClient) -> None:
    """A new run trains a step (gateway, trainer), its weights sample (sampler), and the catalog
    lists it (checkpoint): every service, through NATS."""
    training = service.create_lora_training_client("tinsmith/tiny", rank=2, seed=1).result()
    _steps(training, range(1))
    sampler = training.save_weights_and_get_sampling_client().result(timeout=120)
    params = types.SamplingParams(max_tokens=4, seed=0, temperature=1.0, stop=[])
    sample = sampler.sample(types.ModelInput.from_ints([5, 17, 29]), 1, params)
    assert len(sample.result(timeout=120).sequences[0].tokens) == 4
    rest = tinker.RestClient(base_url=system.url, api_key=KEY)
    runs = rest.list_training_runs(limit=100).result(timeout=120).training_runs
    deadline = time.monotonic() + 60  # the catalog follows the log
    while training.model_id not in {r.training_run_id for r in runs}:
        assert time.monotonic() < deadline, "the catalog does not list the new run"
        time.sleep(0.2)
        runs = rest.list_training_runs(limit=100).result(timeout=120).training_runs


@pytest.mark.e2e
def test_each_child_killed_is_started_again_the_same_way(tmp_path: Path) -> None:
    # Fresh processes, whose environment /proc shows (a standby's shows the one it started with;
    # tests/test_supervision.py checks what it becomes).
    system = start_system(tmp_path, standby=False)
    try:
        service = tinker.ServiceClient(base_url=system.url, api_key=KEY)
        first = child_pids(system.process.pid)
        for name in CHILDREN:
            before = environment(first[name]) if name != "nats-server" else {}
            kill = kill_child(system.up, name)
            print(
                f"{name}: a new process {kill.restarted_at - kill.killed_at:.2f} s after the kill"
            )
            _every_service_answers(system, service)
            line = [m for m in restart_lines(system.up) if m["name"] == name][-1]
            assert (line["pid"], line["how"]) == (str(kill.old_pid), "was killed by SIGKILL")
            assert (line["delay"], line["restart"]) == ("0.5", "1")
            if name != "nats-server":
                assert environment(kill.new_pid) == before  # its ports, its replica name
                assert before["TINSMITH_REPLICA"] == f"{name}-0"
                with urllib.request.urlopen(system.metrics[name], timeout=30) as answer:
                    assert answer.status == 200
        assert len(restart_lines(system.up)) == len(CHILDREN)
        service.close("success").result(timeout=60)
    finally:
        assert stop_system(system) == 0, system.logs()


@pytest.mark.e2e
def test_a_child_that_keeps_dying_waits_ever_longer(tmp_path: Path) -> None:
    system = start_system(tmp_path)
    try:
        kills = [kill_child(system.up, "sampler") for _ in range(4)]
        delays = [float(m["delay"]) for m in restart_lines(system.up)]
        assert delays == [0.5, 1.0, 2.0, 4.0], delays
        for kill, delay in zip(kills, delays, strict=True):
            assert kill.restarted_at - kill.killed_at >= delay
        service = tinker.ServiceClient(base_url=system.url, api_key=KEY)
        _every_service_answers(system, service)  # the last one stayed up, and serves
        service.close("success").result(timeout=60)
    finally:
        assert stop_system(system) == 0, system.logs()


async def _unloaded(nats_url: str, model_id: str) -> list[str]:
    """The snapshot keys of the RunUnloaded events of ``model_id`` in the event log."""
    bus = await Bus.connect(nats_url, name="test-reader")
    try:
        last = await bus.last_seq(subjects.EVENTS_STREAM)
        found: list[str] = []
        done = asyncio.Event()

        async def on_event(seq: int, data: bytes) -> None:
            event = events.decode(data)
            if events.kind_of(event) == "run_unloaded" and event.run_unloaded.model_id == model_id:
                found.append(event.run_unloaded.snapshot_key)
            if seq >= last:
                done.set()

        await bus.follow(subjects.EVENTS_STREAM, subjects.EVENTS_ALL, on_event)
        await asyncio.wait_for(done.wait(), 60)
        return found
    finally:
        await bus.close()


@pytest.mark.e2e
def test_ctrl_c_stops_the_services_while_their_nats_server_still_runs(tmp_path: Path) -> None:
    """A terminal's Ctrl-C goes to its whole foreground process group: before, that was every
    child too, and the nats-server could stop before a trainer had recorded its runs."""
    port = free_port()
    system = start_system(tmp_path, port=port)
    try:
        service = tinker.ServiceClient(base_url=system.url, api_key=KEY)
        reference = service.create_lora_training_client("tinsmith/tiny", rank=4, seed=3).result()
        _steps(reference, range(4))
        expected = _adapter(tmp_path, reference.save_state("four").result(timeout=120).path)
        training = service.create_lora_training_client("tinsmith/tiny", rank=4, seed=3).result()
        _steps(training, range(2))  # the run is in the trainer's memory, not snapshotted
        nats_pid = child_pid(system.process.pid, "nats-server")
        os.killpg(system.process.pid, signal.SIGINT)  # the launcher's group: a terminal's Ctrl-C
        assert system.process.wait(120) == 0
    finally:
        if system.process.poll() is None:
            stop_system(system)
    assert not _alive(nats_pid)
    nats_log = (tmp_path / "logs" / "nats-server.log").read_text()
    assert 'Trapped "terminated" signal' in nats_log  # from the launcher, last
    assert 'Trapped "interrupt" signal' not in nats_log  # the Ctrl-C did not reach it

    system = start_system(tmp_path, port=port)
    try:
        url = recorded_nats_url(tmp_path)
        assert url is not None
        # Written by the stopping trainer, so NATS was up then; and the run comes back from it.
        assert asyncio.run(_unloaded(url, training.model_id))
        _steps(training, range(2, 4))  # the same client object
        got = _adapter(tmp_path, training.save_state("four").result(timeout=120).path)
        assert all(np.array_equal(got[k], expected[k]) for k in expected)
        assert got.keys() == expected.keys()
        service.close("success").result(timeout=60)
    finally:
        assert stop_system(system) == 0, system.logs()
