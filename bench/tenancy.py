"""What tenancy costs the gateway per call: authenticating a key and deciding an operation
(ownership and quotas included), on a small deployment's projection and on a crowded one.

    .venv/bin/python -m bench.tenancy                 # 1000 tenants, 100,000 requests in the log
    .venv/bin/python -m bench.tenancy --tenants 5000 --requests 500000

Both sides run the same calls in one process, alternating round by round: an issued key
authenticated, then an ``optim_step`` and a ``sample`` decided for its tenant (the decision the
gateway makes before it appends anything). The baseline is a log with one tenant and one run;
the crowded log holds ``--tenants`` tenants, each with a session, a run and a sampler, and
``--requests`` settled requests. Prints microseconds per call on each side and their ratio: the
quotas are counters kept by the fold, so no decision scans the log, and the ratio stays near 1.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

from services.gateway import operations as ops
from tinsmith import events, jobs, tenants
from tinsmith._proto import bus_pb2 as bus
from tinsmith._proto import tinker_public_pb2 as tp
from tinsmith.limits import Limits

BASE = "tinsmith/tiny"


def crowded(tenant_count: int, request_count: int) -> tuple[jobs.Projection, str]:
    """A projection of ``tenant_count`` tenants (a key, a session, a run and a sampler each)
    and ``request_count`` completed requests spread over the runs; the key of tenant 0."""
    state, seq = jobs.Projection(), 0

    def apply(**kind: object) -> None:
        nonlocal seq
        seq += 1
        state.apply(seq, events.make(**kind))

    first_key = ""
    for t in range(tenant_count):
        key, issued = tenants.issue(f"tenant{t}")
        first_key = first_key or key
        apply(key_issued=issued)
        apply(session_created=bus.SessionCreated(session_id=f"S{t}", owner=f"tenant{t}"))
        create = bus.CreateModel(
            session_id=f"S{t}", base_model=BASE, lora=bus.LoraConfig(rank=8, train_mlp=True)
        )
        apply(
            request_accepted=bus.RequestAccepted(
                request_id=f"S{t}:train:0:0", aggregate_id=f"S{t}:train:0", create_model=create
            )
        )
        apply(
            sampler_created=bus.SamplerCreated(
                sampler_id=f"S{t}:sample:0", session_id=f"S{t}", base_model=BASE
            )
        )
    for r in range(request_count):
        run = f"S{r % tenant_count}:train:0"
        seq_id = r // tenant_count + 1
        request_id = events.request_id(run, seq_id)
        apply(
            request_accepted=bus.RequestAccepted(
                request_id=request_id,
                aggregate_id=run,
                seq_id=seq_id,
                optim_step=bus.OptimStep(),
            )
        )
        apply(request_completed=bus.RequestCompleted(request_id=request_id, aggregate_id=run))
    return state, first_key


def one_call(state: jobs.Projection, key: str) -> Callable[[], None]:
    """Authenticate ``key`` and decide an optim_step and a sample for its tenant (tenant 0)."""
    run = state.runs["S0:train:0"]
    adam = bus.AdamParams(learning_rate=1e-4, eps=1e-12)
    command = bus.Sample(prompt=[1, 2, 3], params=tp.SamplingParams(max_tokens=8), num_samples=1)
    quotas = tenants.Quotas(max_inflight=10**9, max_runs=10**9)

    def call() -> None:
        tenant = tenants.authenticate(key, state.keys, mode=tenants.KEYS, defaults=quotas)
        context = ops.Call(tenant, state, Limits(), sampler_queue_limit=10**9, now=time.time())
        step = ops.optim_step(context, ops.OptimStep(run.model_id, run.next_seq_id, adam))
        sample = ops.sample(context, ops.Sample("S0:sample:0", 1, command))
        assert isinstance(step, ops.Append) and isinstance(sample, ops.Append)

    return call


def timed(call: Callable[[], None], repeat: int) -> float:
    started = time.perf_counter()
    for _ in range(repeat):
        call()
    return (time.perf_counter() - started) / repeat * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tenants", type=int, default=1000)
    parser.add_argument("--requests", type=int, default=100_000)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--calls", type=int, default=2000)
    args = parser.parse_args()
    small = one_call(*crowded(1, 1))
    built = time.perf_counter()
    large = one_call(*crowded(args.tenants, args.requests))
    print(
        f"folded {args.tenants} tenants and {args.requests} requests in "
        f"{time.perf_counter() - built:.1f} s"
    )
    small_us, large_us = [], []
    for _ in range(args.rounds):
        small_us.append(timed(small, args.calls))
        large_us.append(timed(large, args.calls))
    a, b = statistics.median(small_us), statistics.median(large_us)
    print(f"one tenant, one run:            {a:7.1f} us per call (authenticate + 2 decisions)")
    print(f"{args.tenants} tenants, {args.requests} requests: {b:7.1f} us per call")
    print(f"ratio crowded / small: {b / a:.2f}")


if __name__ == "__main__":
    main()
