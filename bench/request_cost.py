"""What one request costs the control plane: each process's CPU time per sample request, on two
systems side by side, one of them with a setting changed.

Two ``tinsmith up`` run at once (each on a free port, with its own temporary data directory and
the shared model cache), one as configured and one with ``--against`` (default
``TINSMITH_CATALOG_GATHER_MS=0``: the catalog folds every event as it arrives, as it did before
it gathered them). The work is what dominates an RL job's requests: rounds of ``--batch``
concurrent ``SamplingClient.sample`` requests through the official SDK, each a distinct
``--prompt``-token prompt and ``max_tokens=1`` on tinsmith/tiny, so that the engine's share is
small and what is measured is the service around it. The systems take turns, a block of
``--rounds`` rounds each, ``--blocks`` times; each process's user and system CPU time
(``/proc/PID/stat``) is read before and after every block. The SDK's share is this process's
(only one system's client is busy at a time).

Prints, for each process (gateway, sampler, trainer, checkpoint, nats-server, the SDK): the
median over blocks of its CPU milliseconds per request on each system, and their ratio; and each
system's requests per second. Linux only (``/proc``).

    .venv/bin/python -m bench.request_cost [--against TINSMITH_CATALOG_GATHER_MS=0]
        [--batch 16] [--prompt 16] [--rounds 10] [--blocks 6]
"""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TINKER_TELEMETRY", "0")

import argparse
import statistics
import sys
import tempfile
import time
import warnings
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import tinker
from tinker import types

from bench.sample_throughput import prompts_for
from bench.train_overhead import start_system
from tinsmith import models
from tinsmith.child import UpProcess, sigterm_as_interrupt

MODEL = models.TINY
SERVICES = ("gateway", "sampler", "trainer", "checkpoint")
SDK = "SDK (this process)"


def cpu_seconds(pid: int) -> float:
    """User plus system CPU time of a process so far."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def processes(root: int) -> dict[str, int]:
    """The processes of a ``tinsmith up`` by what they are: its services and its nats-server."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry.name))
    found: dict[str, int] = {}
    todo = list(children.get(root, []))
    while todo:
        pid = todo.pop()
        todo.extend(children.get(pid, []))
        try:
            argv = (Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0"))[:-1]
        except OSError:
            continue
        words = [word.decode() for word in argv]
        if words[-2:-1] == ["serve"] and words[-1] in SERVICES:
            found[words[-1]] = pid
        elif words and words[0].endswith("nats-server"):
            found["nats-server"] = pid
    missing = {*SERVICES, "nats-server"} - set(found)
    if missing:
        raise RuntimeError(f"tinsmith up (pid {root}) has no {sorted(missing)} process")
    return found


@dataclass
class System:
    name: str
    up: UpProcess
    client: tinker.SamplingClient
    prompts: list[types.ModelInput]
    pids: dict[str, int]
    per_request: dict[str, list[float]] = field(default_factory=dict)  # ms of CPU, per block
    rates: list[float] = field(default_factory=list)  # requests per second, per block

    def round(self) -> None:
        params = types.SamplingParams(max_tokens=1, stop=[], temperature=1.0)
        futures = [self.client.sample(prompt, 1, params) for prompt in self.prompts]
        for future in futures:
            future.result()

    def block(self, rounds: int) -> None:
        pids = {**self.pids, SDK: os.getpid()}
        before = {name: cpu_seconds(pid) for name, pid in pids.items()}
        start = time.perf_counter()
        for _ in range(rounds):
            self.round()
        elapsed = time.perf_counter() - start
        requests = rounds * len(self.prompts)
        for name, pid in pids.items():
            spent = cpu_seconds(pid) - before[name]
            self.per_request.setdefault(name, []).append(spent / requests * 1e3)
        self.rates.append(requests / elapsed)


def start(
    name: str, env: dict[str, str], work: Path, cache: Path, batch: int, prompt: int
) -> System:
    up = start_system(work / name, cache, env=env)
    try:
        service = tinker.ServiceClient(base_url=up.url, api_key=f"tml-{name}")
        client = service.create_sampling_client(base_model=MODEL).result()
        prompts = [
            types.ModelInput.from_ints(row.tolist()) for row in prompts_for(MODEL, batch, prompt, 0)
        ]
        system = System(name, up, client, prompts, processes(up.process.pid))
        for _ in range(3):  # warm-up: the model loaded, the paths taken once
            system.round()
        return system
    except BaseException:
        up.stop()
        raise


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--against", default="TINSMITH_CATALOG_GATHER_MS=0", help="VAR=VALUE")
    parser.add_argument("--batch", type=int, default=16, help="concurrent requests a round")
    parser.add_argument("--prompt", type=int, default=16, help="prompt tokens")
    parser.add_argument("--rounds", type=int, default=10, help="rounds a block")
    parser.add_argument("--blocks", type=int, default=6, help="blocks each system")
    args = parser.parse_args(argv)
    variable, sep, value = args.against.partition("=")
    if not sep or not variable:
        parser.error("--against takes VAR=VALUE")
    warnings.filterwarnings("ignore", category=FutureWarning)
    sigterm_as_interrupt()
    print(
        f"{MODEL}: {args.blocks} blocks of {args.rounds} rounds of {args.batch} concurrent sample "
        f"requests ({args.prompt} prompt tokens, max_tokens=1) on each system, taking turns; "
        f"{os.cpu_count()} CPUs",
        flush=True,
    )
    systems: list[System] = []
    with tempfile.TemporaryDirectory(prefix="tinsmith-request-cost-") as tmp:
        work = Path(tmp)
        cache = Path(os.environ.get("TINSMITH_CACHE_DIR", str(models.default_cache_dir())))
        try:
            systems.append(start("configured", {}, work, cache, args.batch, args.prompt))
            systems.append(
                start(args.against, {variable: value}, work, cache, args.batch, args.prompt)
            )
            for _ in range(args.blocks):
                for system in systems:
                    system.block(args.rounds)
        finally:
            for system in systems:
                system.up.stop()
    configured, against = systems
    print(
        f"\nCPU milliseconds per request, median over blocks ({configured.name} / {against.name})"
    )
    print(f"  {'':22s}{configured.name:>14s}{against.name:>32s}{'ratio':>8s}")
    for name in configured.per_request:
        mine = statistics.median(configured.per_request[name])
        theirs = statistics.median(against.per_request[name])
        shown = f"{mine / theirs:.2f}" if theirs > 0 else "-"
        print(f"  {name:22s}{mine:14.2f}{theirs:32.2f}{shown:>8s}")
    total = [sum(statistics.median(s.per_request[n]) for n in s.per_request) for s in systems]
    print(f"  {'all':22s}{total[0]:14.2f}{total[1]:32.2f}{total[0] / total[1]:8.2f}")
    rates = [statistics.median(s.rates) for s in systems]
    faster = rates[0] / rates[1]
    print(f"\nrequests/s, median over blocks: {rates[0]:.1f} and {rates[1]:.1f} ({faster:.2f}x)")
    for system in systems:
        print(f"  {system.name}: {' '.join(f'{r:.1f}' for r in system.rates)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
