"""Sampler replicas share one queue: two split the load, killing one mid-load loses nothing and
the SDK sees no error, and a full queue makes the gateway answer 429, which the SDK rides out.

The system is ``tinsmith up`` plus a second sampler process (``tinsmith serve sampler``) on the
same NATS server and object store. Each replica holds at most 4 requests (TINSMITH_SAMPLER_BATCH),
so both must take work; a killed replica's requests go to the other after its ack deadline
(TINSMITH_SAMPLER_ACK_WAIT_S, 6 s here); the gateway takes at most 12 unanswered sample
requests (TINSMITH_SAMPLER_QUEUE_LIMIT).
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
import pytest
import tinker
from tinker import types

from tests.conftest import RunningSystem, start_system, stop_system
from tinsmith import events, subjects
from tinsmith.bus import Bus

pytestmark = pytest.mark.e2e

LIMITS = {
    "TINSMITH_SAMPLER_BATCH": "4",
    "TINSMITH_SAMPLER_ACK_WAIT_S": "6",
    "TINSMITH_SAMPLER_QUEUE_LIMIT": "12",
    "TINSMITH_TORCH_THREADS": "1",
}


class Replicas:
    def __init__(self, system: RunningSystem) -> None:
        self.system = system
        config = (system.data_dir / "nats-server.conf").read_text()
        self.nats_url = "nats://" + re.search(r"listen: (\S+)", config).group(1)  # type: ignore[union-attr]
        self.extra: subprocess.Popen[bytes] | None = None
        self.extra_log = system.data_dir / "logs" / "sampler-2.log"

    def start_extra(self) -> None:
        env = {
            **os.environ,
            **LIMITS,
            "TINSMITH_NATS_URL": self.nats_url,
            "TINSMITH_BLOB_URL": f"file://{self.system.data_dir / 'blobs'}",
        }
        with self.extra_log.open("ab") as log:
            self.extra = subprocess.Popen(
                [sys.executable, "-m", "tinsmith.cli", "serve", "sampler"],
                stdout=log,
                stderr=subprocess.STDOUT,
                env=env,
            )
        deadline = time.monotonic() + 120
        while "sampler ready" not in self.extra_log.read_text():
            assert self.extra.poll() is None, self.extra_log.read_text()
            assert time.monotonic() < deadline, "the second sampler did not start"
            time.sleep(0.2)

    def completions(self) -> dict[str, str]:
        """sample request id -> the replica that completed it, from the event log."""
        return asyncio.run(_completions(self.nats_url))


async def _completions(url: str) -> dict[str, str]:
    bus = await Bus.connect(url, name="test-reader")
    try:
        last = await bus.last_seq(subjects.EVENTS_STREAM)
        found: dict[str, str] = {}
        done = asyncio.Event()

        async def on_event(seq: int, data: bytes) -> None:
            event = events.decode(data)
            completed = event.request_completed
            if events.kind_of(event) == "request_completed" and ":sample:" in completed.request_id:
                found.setdefault(completed.request_id, completed.replica)
            if seq >= last:
                done.set()

        await bus.follow(subjects.EVENTS_STREAM, subjects.EVENTS_ALL, on_event)
        await asyncio.wait_for(done.wait(), 30)
        return found
    finally:
        await bus.close()


@pytest.fixture(scope="module")
def replicas(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Replicas]:
    system = start_system(tmp_path_factory.mktemp("replicas"), env=LIMITS)
    replicas = Replicas(system)
    try:
        replicas.start_extra()
        yield replicas
    finally:
        if replicas.extra is not None and replicas.extra.poll() is None:
            replicas.extra.kill()
        stop_system(system)


@pytest.fixture(scope="module")
def sampler(replicas: Replicas) -> Iterator[tinker.SamplingClient]:
    service = tinker.ServiceClient(base_url=replicas.system.url, api_key="tml-e2e")
    training = service.create_lora_training_client(base_model="tinsmith/tiny", rank=4, seed=3)
    yield training.result().save_weights_and_get_sampling_client().result()
    service.close("success").result(timeout=30)


def _sample_many(sampler: tinker.SamplingClient, count: int) -> list[Any]:
    """``count`` requests of two sequences each, all in flight at once; their futures."""
    params = types.SamplingParams(max_tokens=48, temperature=1.0, stop=[])
    return [
        sampler.sample(types.ModelInput.from_ints([5 + i, 17, 29, 41]), 2, params)
        for i in range(count)
    ]


def test_two_replicas_split_the_load_and_a_killed_one_loses_nothing(
    replicas: Replicas, sampler: tinker.SamplingClient
) -> None:
    before = set(replicas.completions())
    started = time.monotonic()
    futures = _sample_many(sampler, 40)
    # Let both replicas take work, then kill the second one while it holds requests.
    deadline = time.monotonic() + 120
    while True:
        done = {rid: who for rid, who in replicas.completions().items() if rid not in before}
        if len(set(done.values())) == 2:
            break
        assert time.monotonic() < deadline, f"only one replica served: {done}"
        time.sleep(0.3)
    assert replicas.extra is not None
    replicas.extra.send_signal(signal.SIGKILL)
    replicas.extra.wait()
    killed_at = len(done)
    print(f"killed after {killed_at} completions, {time.monotonic() - started:.1f} s")
    assert killed_at < 40, "the load was over before the kill"

    results = [future.result(timeout=180) for future in futures]  # no error reaches the SDK
    print(f"all done after {time.monotonic() - started:.1f} s")
    for result in results:
        assert len(result.sequences) == 2
        for sequence in result.sequences:
            assert len(sequence.tokens) == 48 and len(sequence.logprobs) == 48
    served = {rid: who for rid, who in replicas.completions().items() if rid not in before}
    assert len(served) == 40
    by_replica = {who: sum(1 for w in served.values() if w == who) for who in set(served.values())}
    assert len(by_replica) == 2 and min(by_replica.values()) >= 1, by_replica


def test_a_full_queue_answers_429_and_the_sdk_backs_off(
    replicas: Replicas, sampler: tinker.SamplingClient
) -> None:
    futures = _sample_many(sampler, 30)
    seen: list[tuple[int, str]] = []
    body = {
        "sampling_session_id": sampler._sampling_session_id,  # type: ignore[attr-defined]
        "seq_id": 10**9,
        "num_samples": 1,
        "prompt": {"chunks": [{"type": "encoded_text", "tokens": [1, 2, 3]}]},
        "sampling_params": {"max_tokens": 4, "temperature": 1.0, "top_k": -1, "top_p": 1.0},
        "type": "sample",
    }
    deadline = time.monotonic() + 60
    while not any(status == 429 for status, _ in seen) and time.monotonic() < deadline:
        body["seq_id"] += 1
        request = urllib.request.Request(
            f"{replicas.system.url}/api/v1/asample",
            data=json.dumps(body).encode(),
            headers={"Content-Type": "application/json", "X-API-Key": "tml-e2e"},
        )
        try:
            with urllib.request.urlopen(request, timeout=30) as reply:
                seen.append((reply.status, ""))
        except urllib.error.HTTPError as error:
            seen.append((error.code, json.loads(error.read())["detail"]))
    detail = next(d for s, d in seen if s == 429)
    assert "sampling queue is full" in detail and "bound is 12" in detail
    # The SDK's own requests met the same bound; it waited and sent them again, without error.
    with ThreadPoolExecutor(8) as pool:
        results = list(pool.map(lambda f: f.result(timeout=180), futures))
    assert all(len(r.sequences) == 2 for r in results)
    assert np.isfinite([lp for r in results for s in r.sequences for lp in s.logprobs]).all()
