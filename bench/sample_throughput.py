"""How fast the system samples against transformers' ``generate`` in-process, what batching
requests across adapters buys, and what the RL loop's per-step hand-off of new weights costs.

Everything is measured in one run, against ``tinsmith up`` started here as a subprocess on a free
port with its own temporary data and model-cache directories (bench.train_overhead's helpers),
through the official tinker SDK. The base model's sampling client comes from
``create_sampling_client(base_model=...)``; prompts are random token ids from the middle of the
vocabulary, passed as ids (the SDK's tokenizer is never loaded).

1. Throughput, generated tokens per second, two ways:
   (a) system: B concurrent ``SamplingClient.sample`` requests, each one sequence (num_samples=1)
       of a distinct L-token prompt, ``max_tokens=T`` and ``stop=[]`` (so each sequence has
       exactly T tokens), temperature 1.0, distinct seeds; B*T tokens from the first submission
       to the last result.
   (b) in-process: the same model directory loaded with transformers on the sampler's device and
       in its base weights' dtype (services/device.py: float32 on the CPU), the same B
       prompts as one left-padded batch through ``model.generate`` (do_sample, temperature 1.0,
       no top-k or top-p, ``max_new_tokens=min_new_tokens=T``, KV cache), on this process's main
       thread with the sampler's intra-op thread count (``TINSMITH_TORCH_THREADS``, default half
       the cores).
   (c) the sampler's engine in-process: services/sampler/torch_engine.py's ``TorchEngine`` on
       the same model, device, dtype and threads, given the B requests as the sampler gives
       them (``add``), then stepped until all are done: the engine's own speed, without the
       system around it.
   After warm-up the sides alternate, a, b, c, a, b, c ..., so machine noise hits all; it prints
   the median tokens/s of each and the ratios (the target: system / in-process >= 1.0). Both share
   the machine's cores, but never compute at the same time. The system's rounds are then split,
   from the event log, into the time until the sampler's queue holds the first request, the
   sampler's span from the first accepted request to the last completed one, and the rest.
2. Batching: four LoRA training clients (rank 8), each given one ``forward_backward`` and
   ``optim_step`` on its own data so their weights differ, then
   ``save_weights_and_get_sampling_client``. 16 requests (L-token prompts, T tokens each) spread
   over the four adapters, all in flight at once ("batched"), against the same 16 sent one after
   another, each waiting for the one before ("one at a time"); alternating, median wall seconds
   and the speedup.
3. Hand-off: per round, one training step on the first of those runs, then the time of
   ``save_weights_and_get_sampling_client()`` until it returns a client, of the first ``sample``
   on that client (max_tokens=1), and of a second one, on the now warm client of the same
   adapter. The hand-off cost is save + first sample - warm sample: the adapter's write to the
   object store, its fetch and load in the sampler, and the SDK's joining of the new sampling
   session before its first request. It is split from the event log too: the trainer's save
   request, and the sampler's time (``compute_seconds``) of the first sample against the warm one.

4. Adapters held: the sampler holding 1, then 8, then 64 (``--held``) adapters (named sampler
   checkpoints of the first run, each its own adapter in the sampler, loaded by a one-token
   sample each), the median time of a request of one sequence of T tokens through the first
   adapter, and the ratio to the time with 1 held (the target: at most 1.1 at 64). The counts
   only grow, so they cannot alternate: the per-round values are printed to judge the noise by.

Part 1 runs before any adapter exists; the sampler's LoRA layer (services/lora_slots.py) is
installed on the base from its load, and a base-model row never computes an adapter's path.

    .venv/bin/python -m bench.sample_throughput [--model M] [--batch 16] [--prompt 32]
        [--tokens 64] [--rounds 5] [--held 1 8 64]

The model is SmolLM2 by default (converted offline from its GGUF on first use, some seconds);
``--model tinsmith/small`` runs the same in a fraction of the time. On two cores the default run
takes about a quarter of an hour, most of it the one-at-a-time rounds of part 2. On a shared
machine other processes slow both sides unevenly: the per-round values and the load average after
each part are printed to judge that by.
"""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # read when huggingface_hub is imported
os.environ.setdefault("TINKER_TELEMETRY", "0")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import argparse
import asyncio
import logging
import math
import statistics
import sys
import tempfile
import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import tinker
import torch
import transformers
from tinker import types
from transformers import AutoModelForCausalLM

from bench.train_overhead import nats_url, start_system
from services.device import Placement, placement_from_env, synchronize
from services.sampler.torch_engine import TorchEngine
from tinsmith import events, models, subjects
from tinsmith._proto import bus_pb2 as bus
from tinsmith._proto import tinker_public_pb2 as tp
from tinsmith.bus import Bus
from tinsmith.child import UpProcess, sigterm_as_interrupt

DEFAULT_MODEL = models.SMOLLM2
TARGET_RATIO = 1.0  # issue 17: at least in-process generate
ADAPTERS = 4
BATCHING_REQUESTS = 16
ADAPTER_RANK = 8
ADAM = types.AdamParams(learning_rate=1e-3)


def prompts_for(model: str, count: int, length: int, seed: int) -> np.ndarray:
    """``count`` prompts of ``length`` random ids from the middle half of the vocabulary, clear of
    the special tokens that sit at its ends."""
    vocab = models.get(model).vocab_size
    rng = np.random.default_rng(seed)
    return rng.integers(vocab // 4, 3 * vocab // 4, (count, length), dtype=np.int64)


def _sampler_id(client: tinker.SamplingClient) -> str:
    """The gateway's sampler id of a client: the aggregate its sample requests are logged under."""
    return str(client._sampling_session_id)


# --- 1. throughput ------------------------------------------------------------------------------


class SystemSampler:
    """(a): B concurrent sample requests through the SDK, all submitted before any is awaited."""

    def __init__(self, client: tinker.SamplingClient, prompts: np.ndarray, tokens: int) -> None:
        self.client = client
        self.prompts = [types.ModelInput.from_ints(row.tolist()) for row in prompts]
        self.tokens = tokens
        self.spans: list[tuple[float, float]] = []  # wall-clock start and end of each round
        self._seed = 0

    def round(self) -> float:
        """One round; returns generated tokens per second."""
        params = []
        for _ in self.prompts:
            self._seed += 1
            params.append(
                types.SamplingParams(
                    max_tokens=self.tokens, stop=[], temperature=1.0, seed=self._seed
                )
            )
        wall, start = time.time(), time.perf_counter()
        futures = [
            self.client.sample(prompt, 1, p) for prompt, p in zip(self.prompts, params, strict=True)
        ]
        responses = [future.result() for future in futures]
        elapsed = time.perf_counter() - start
        self.spans.append((wall, wall + elapsed))
        for response in responses:
            lengths = [len(s.tokens) for s in response.sequences]
            if lengths != [self.tokens]:
                raise RuntimeError(f"expected one sequence of {self.tokens} tokens, got {lengths}")
        return len(self.prompts) * self.tokens / elapsed


class InProcessSampler:
    """(b): the same prompts as one left-padded batch through transformers' ``generate``."""

    def __init__(
        self, model_dir: Path, prompts: np.ndarray, tokens: int, placement: Placement
    ) -> None:
        self.device = placement.device
        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=placement.dtype)
        self.model.to(self.device)
        self.model.requires_grad_(False)
        self.model.eval()
        config = self.model.generation_config
        eos = config.eos_token_id
        first_eos = eos[0] if isinstance(eos, list) else eos
        self.pad = config.pad_token_id if config.pad_token_id is not None else (first_eos or 0)
        rows = [row.tolist() for row in prompts]
        width = max(len(row) for row in rows)
        self.input_ids = torch.full((len(rows), width), self.pad, dtype=torch.long)
        self.mask = torch.zeros((len(rows), width), dtype=torch.long)
        for i, row in enumerate(rows):
            self.input_ids[i, width - len(row) :] = torch.tensor(row)
            self.mask[i, width - len(row) :] = 1
        self.input_ids, self.mask = self.input_ids.to(self.device), self.mask.to(self.device)
        self.tokens = tokens
        self._seed = 0

    def round(self) -> float:
        self._seed += 1
        torch.manual_seed(self._seed)
        synchronize(self.device)
        start = time.perf_counter()
        with torch.inference_mode():
            out = self.model.generate(
                input_ids=self.input_ids,
                attention_mask=self.mask,
                do_sample=True,
                temperature=1.0,
                top_k=0,
                top_p=1.0,
                max_new_tokens=self.tokens,
                min_new_tokens=self.tokens,
                use_cache=True,
                pad_token_id=self.pad,
            )
        synchronize(self.device)
        elapsed = time.perf_counter() - start
        generated = out.shape[1] - self.input_ids.shape[1]
        if generated != self.tokens:
            raise RuntimeError(f"generate made {generated} tokens, not {self.tokens}")
        return self.input_ids.shape[0] * self.tokens / elapsed


class EngineSampler:
    """(c): the sampler's engine in this process, the same requests given to it directly."""

    def __init__(
        self, model: str, cache_dir: Path, prompts: np.ndarray, tokens: int, placement: Placement
    ) -> None:
        self.engine = TorchEngine(cache_dir, torch.get_num_threads(), placement=placement)
        self.engine.load_base(model)
        self.model = model
        self.prompts = [row.tolist() for row in prompts]
        self.tokens = tokens
        self._ticket = 0

    def round(self) -> float:
        params = tp.SamplingParams(max_tokens=self.tokens, temperature=1.0, top_k=-1, top_p=1.0)
        synchronize(self.engine.placement.device)
        start = time.perf_counter()
        tickets = set()
        for prompt in self.prompts:
            self._ticket += 1
            params.seed = self._ticket
            command = bus.Sample(base_model=self.model, prompt=prompt, params=params, num_samples=1)
            self.engine.add(self._ticket, command)
            tickets.add(self._ticket)
        while tickets:
            for ticket, body in self.engine.step():
                if not isinstance(body, bytes):
                    raise RuntimeError(f"the engine failed request {ticket}: {body}")
                tickets.discard(ticket)
        synchronize(self.engine.placement.device)
        return len(self.prompts) * self.tokens / (time.perf_counter() - start)


# --- 2. batching across adapters ----------------------------------------------------------------


def make_adapters(
    service: tinker.ServiceClient, model: str, count: int, seq: int
) -> list[tinker.TrainingClient]:
    """``count`` LoRA runs, each one optimizer step away from zero on data of its own."""
    runs = [
        service.create_lora_training_client(base_model=model, rank=ADAPTER_RANK, seed=i).result()
        for i in range(count)
    ]
    for i, run in enumerate(runs):
        train_step(run, model, seq, seed=1000 + i)
    return runs


def train_step(run: tinker.TrainingClient, model: str, seq: int, seed: int) -> None:
    row = prompts_for(model, 1, seq + 1, seed)[0]
    datum = types.Datum(
        model_input=types.ModelInput.from_ints(row[:-1].tolist()),
        loss_fn_inputs={
            "target_tokens": types.TensorData.from_numpy(row[1:]),
            "weights": types.TensorData.from_numpy(np.ones(seq, np.float32)),
        },
    )
    fb = run.forward_backward([datum], "cross_entropy")
    optim = run.optim_step(ADAM)
    fb.result()
    optim.result()


class Batching:
    """The same requests over several adapters, all in flight at once or one at a time."""

    def __init__(
        self, clients: list[tinker.SamplingClient], prompts: np.ndarray, tokens: int
    ) -> None:
        self.requests = [
            (clients[i % len(clients)], types.ModelInput.from_ints(row.tolist()))
            for i, row in enumerate(prompts)
        ]
        self.tokens = tokens
        self._seed = 0

    def _params(self) -> types.SamplingParams:
        self._seed += 1
        return types.SamplingParams(max_tokens=self.tokens, stop=[], seed=self._seed)

    def batched(self) -> float:
        start = time.perf_counter()
        futures = [client.sample(prompt, 1, self._params()) for client, prompt in self.requests]
        for future in futures:
            future.result()
        return time.perf_counter() - start

    def one_at_a_time(self) -> float:
        start = time.perf_counter()
        for client, prompt in self.requests:
            client.sample(prompt, 1, self._params()).result()
        return time.perf_counter() - start


# --- 3. hand-off --------------------------------------------------------------------------------


@dataclass
class HandOff:
    save_s: float  # save_weights_and_get_sampling_client until the client is back
    first_s: float  # the first sample on the new client
    warm_s: float  # the next sample on the same client
    sampler_id: str

    @property
    def cost_s(self) -> float:
        return self.save_s + self.first_s - self.warm_s


def hand_off(run: tinker.TrainingClient, model: str, prompt: np.ndarray, step: int) -> HandOff:
    train_step(run, model, len(prompt), seed=2000 + step)  # new weights for every save
    one = types.ModelInput.from_ints(prompt.tolist())
    start = time.perf_counter()
    client = run.save_weights_and_get_sampling_client().result()
    saved = time.perf_counter()
    client.sample(one, 1, types.SamplingParams(max_tokens=1, seed=step)).result()
    first = time.perf_counter()
    client.sample(one, 1, types.SamplingParams(max_tokens=1, seed=step)).result()
    warm = time.perf_counter()
    return HandOff(saved - start, first - saved, warm - first, _sampler_id(client))


# --- 4. adapters held ---------------------------------------------------------------------------


def adapters_held(
    service: tinker.ServiceClient,
    run: tinker.TrainingClient,
    prompt: np.ndarray,
    tokens: int,
    counts: Sequence[int],
    rounds: int,
) -> dict[int, list[float]]:
    """Per count of adapters held, the seconds of ``rounds`` requests (one sequence of
    ``tokens`` tokens) through the first of them."""
    paths = [run.save_weights_for_sampler(f"held-{i}").result().path for i in range(max(counts))]
    clients = [service.create_sampling_client(model_path=path) for path in paths]
    one = types.ModelInput.from_ints(prompt.tolist())
    times: dict[int, list[float]] = {}
    for count in sorted(counts):
        for client in clients[:count]:  # each loaded in the sampler
            client.sample(one, 1, types.SamplingParams(max_tokens=1, seed=0)).result()
        into = times[count] = []
        for seed in range(rounds + 1):
            start = time.perf_counter()
            params = types.SamplingParams(max_tokens=tokens, stop=[], seed=seed)
            clients[0].sample(one, 1, params).result()
            if seed:  # the first warms up
                into.append(time.perf_counter() - start)
    return times


# --- where the system's time goes, from the event log -------------------------------------------


@dataclass
class _Request:
    aggregate_id: str = ""
    seq_id: int = 0
    command: str = ""
    sampler_id: str = ""  # of a save_weights that creates a sampler
    accepted: float = math.nan
    completed: float = math.nan
    compute_s: float = math.nan


async def _read_requests(nats_url: str) -> list[_Request]:
    bus_ = await Bus.connect(nats_url, name="bench-sample-throughput")
    try:
        by_id: dict[str, _Request] = {}
        for seq in range(1, await bus_.last_seq(subjects.EVENTS_STREAM) + 1):
            event = events.decode(await bus_.get(subjects.EVENTS_STREAM, seq))
            kind = events.kind_of(event)
            if kind not in ("request_accepted", "request_completed"):
                continue
            body = getattr(event, kind)
            request = by_id.setdefault(body.request_id, _Request())
            if isinstance(body, bus.RequestAccepted):
                request.aggregate_id, request.seq_id = body.aggregate_id, body.seq_id
                request.command = events.command_of(body)
                request.accepted = event.time
                if request.command == "save_weights":
                    request.sampler_id = body.save_weights.sampler_id
            else:
                request.completed = event.time
                request.compute_s = body.compute_seconds
    finally:
        await bus_.close()
    return sorted(by_id.values(), key=lambda r: (r.aggregate_id, r.seq_id))


def throughput_segments(
    requests: list[_Request], sampler_id: str, spans: list[tuple[float, float]]
) -> list[tuple[str, float]]:
    """Median seconds of each part of the measured system rounds."""
    rows: list[dict[str, float]] = []
    for start, end in spans:
        mine = [
            r
            for r in requests
            if r.aggregate_id == sampler_id and start <= r.accepted <= end and r.command == "sample"
        ]
        if not mine:
            continue
        first = min(r.accepted for r in mine)
        last_accepted = max(r.accepted for r in mine)
        last = max(r.completed for r in mine)
        rows.append(
            {
                "SDK + HTTP + gateway, until the first request is accepted": first - start,
                "  first -> last request accepted": last_accepted - first,
                "first accepted -> last completed (the sampler's span)": last - first,
                "last completed -> all results back in the SDK": end - last,
            }
        )
    if not rows:
        return []
    return [(name, statistics.median(row[name] for row in rows)) for name in rows[0]]


def hand_off_segments(requests: list[_Request], rounds: list[HandOff]) -> list[tuple[str, float]]:
    rows: list[dict[str, float]] = []
    for h in rounds:
        saves = [
            r for r in requests if r.command == "save_weights" and r.sampler_id == h.sampler_id
        ]
        samples = [r for r in requests if r.aggregate_id == h.sampler_id and r.command == "sample"]
        if len(saves) != 1 or len(samples) != 2:
            continue
        save, (first, warm) = saves[0], samples
        rows.append(
            {
                "save request: accepted -> completed": save.completed - save.accepted,
                "  trainer compute (compute_seconds: write the adapter)": save.compute_s,
                "first sample: sampler compute_seconds (fetch + load + sample)": first.compute_s,
                "warm sample: sampler compute_seconds": warm.compute_s,
                "= adapter fetch + load in the sampler (first - warm)": (
                    first.compute_s - warm.compute_s
                ),
            }
        )
    if not rows:
        return []
    return [(name, statistics.median(row[name] for row in rows)) for name in rows[0]]


# --- the run ------------------------------------------------------------------------------------


def alternate(
    sides: Sequence[Callable[[], float]], warmup: int, rounds: int
) -> tuple[list[float], ...]:
    for _ in range(warmup):
        for side in sides:
            side()
    times: tuple[list[float], ...] = tuple([] for _ in sides)
    for _ in range(rounds):
        for side, into in zip(sides, times, strict=True):
            into.append(side())
    return times


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default=DEFAULT_MODEL, help=f"default {DEFAULT_MODEL}")
    parser.add_argument("--batch", type=int, default=16, help="concurrent requests (default 16)")
    parser.add_argument("--prompt", type=int, default=32, help="prompt tokens (default 32)")
    parser.add_argument("--tokens", type=int, default=64, help="tokens generated (default 64)")
    parser.add_argument("--rounds", type=int, default=5, help="measured rounds (default 5)")
    parser.add_argument("--warmup", type=int, default=1, help="unmeasured rounds (default 1)")
    parser.add_argument(
        "--held",
        type=int,
        nargs="+",
        default=[1, 8, 64],
        help="adapters the sampler holds in part 4, in turn (default 1 8 64)",
    )
    parser.add_argument(
        "--threads",
        type=int,
        default=max(1, (os.cpu_count() or 2) // 2),
        help="torch intra-op threads on both sides (default: half the cores, as the sampler)",
    )
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    transformers.logging.set_verbosity_error()
    transformers.logging.disable_progress_bar()  # type: ignore[no-untyped-call]
    warnings.filterwarnings("ignore", category=FutureWarning)
    # Both sides: the system's sampler reads TINSMITH_TORCH_THREADS (services/sampler/config.py).
    os.environ["TINSMITH_TORCH_THREADS"] = str(args.threads)
    torch.set_num_threads(args.threads)
    shape = f"{args.batch} x ({args.prompt} prompt + {args.tokens} sampled) tokens"
    print(
        f"{args.model}: {shape}, {args.warmup} warm-up + {args.rounds} measured rounds, torch "
        f"threads {torch.get_num_threads()}, {os.cpu_count()} CPUs, load average "
        f"{os.getloadavg()[0]:.1f}; both sides on {placement_from_env().describe()}",
        flush=True,
    )
    out: dict[str, Any] = {}
    # Clean up on SIGTERM as on Ctrl-C.
    with sigterm_as_interrupt(), tempfile.TemporaryDirectory(prefix="tinsmith-bench-") as tmp:
        cache_dir = Path(tmp, "cache")
        models.materialize(args.model, cache_dir)  # before the sampler wants it
        system: UpProcess | None = None
        service: tinker.ServiceClient | None = None
        try:
            system = start_system(Path(tmp, "data"), cache_dir)
            service = tinker.ServiceClient(base_url=system.url, api_key="tml-bench")
            measure(system, service, cache_dir, args, out)
            service.close("success").result(timeout=30)
        except KeyboardInterrupt:
            # Requests still in flight fail once the system stops: not worth a log line each.
            logging.getLogger("tinker").setLevel(logging.CRITICAL)
            print("\ninterrupted", file=sys.stderr)
            return 130
        finally:
            if system is not None:
                system.stop()
    report(args, out)
    return 0


def measure(
    system: UpProcess,
    service: tinker.ServiceClient,
    cache_dir: Path,
    args: argparse.Namespace,
    out: dict[str, Any],
) -> None:
    model = args.model
    model_dir = models.materialize(model, cache_dir)
    # 1. throughput
    prompts = prompts_for(model, args.batch, args.prompt, seed=0)
    base = service.create_sampling_client(base_model=model).result()
    a = SystemSampler(base, prompts, args.tokens)
    b = InProcessSampler(model_dir, prompts, args.tokens, placement_from_env())
    c = EngineSampler(model, cache_dir, prompts, args.tokens, placement_from_env())
    system_tps, in_process_tps, engine_tps = alternate(
        (a.round, b.round, c.round), args.warmup, args.rounds
    )
    del b, c
    out["system_tps"], out["in_process_tps"] = system_tps, in_process_tps
    out["engine_tps"] = engine_tps
    out["load"] = [os.getloadavg()[0]]
    print(
        f"throughput: system {statistics.median(system_tps):.1f} tokens/s, in-process "
        f"{statistics.median(in_process_tps):.1f} tokens/s",
        flush=True,
    )
    # 2. batching
    runs = make_adapters(service, model, ADAPTERS, args.prompt)
    clients = [run.save_weights_and_get_sampling_client().result() for run in runs]
    batching = Batching(
        clients, prompts_for(model, BATCHING_REQUESTS, args.prompt, seed=1), args.tokens
    )
    batched, serial = alternate(
        (batching.batched, batching.one_at_a_time), args.warmup, args.rounds
    )
    out["batched"], out["serial"] = batched, serial
    out["load"].append(os.getloadavg()[0])
    print(
        f"batching: batched {statistics.median(batched):.2f} s, one at a time "
        f"{statistics.median(serial):.2f} s",
        flush=True,
    )
    # 3. hand-off
    prompt = prompts_for(model, 1, args.prompt, seed=2)[0]
    for step in range(args.warmup):
        hand_off(runs[0], model, prompt, step)
    out["hand_offs"] = [
        hand_off(runs[0], model, prompt, args.warmup + step) for step in range(args.rounds)
    ]
    requests = asyncio.run(_read_requests(nats_url(system)))
    measured = a.spans[args.warmup :]
    out["throughput_segments"] = throughput_segments(requests, _sampler_id(base), measured)
    out["hand_off_segments"] = hand_off_segments(requests, out["hand_offs"])
    out["load"].append(os.getloadavg()[0])
    # 4. adapters held
    out["held"] = adapters_held(service, runs[0], prompt, args.tokens, args.held, args.rounds)
    out["load"].append(os.getloadavg()[0])


def _rounded(values: list[float], digits: int) -> str:
    return " ".join(f"{v:.{digits}f}" for v in values)


def report(args: argparse.Namespace, out: dict[str, Any]) -> None:
    if not out.get("hand_offs"):
        return
    system_tps = statistics.median(out["system_tps"])
    in_process_tps = statistics.median(out["in_process_tps"])
    ratio = system_tps / in_process_tps
    print()
    print(
        f"1. throughput, {args.model}: {args.batch} requests x ({args.prompt} prompt + "
        f"{args.tokens} sampled tokens), median generated tokens/s"
    )
    print(f"  {'system (SDK -> tinsmith up)':<44} {system_tps:>10.1f}")
    print(f"  {'in-process transformers generate':<44} {in_process_tps:>10.1f}")
    print(f"  {'ratio system / in-process':<44} {ratio:>10.3f}   (target >= {TARGET_RATIO:.2f})")
    best = max(out["system_tps"]) / max(out["in_process_tps"])
    print(f"  {'ratio of the fastest rounds':<44} {best:>10.3f}")
    engine_tps = statistics.median(out["engine_tps"])
    print(f"  {'the sampler engine in-process (no system)':<44} {engine_tps:>10.1f}")
    print(f"  {'ratio engine / in-process generate':<44} {engine_tps / in_process_tps:>10.3f}")
    print(f"  {'ratio system / engine':<44} {system_tps / engine_tps:>10.3f}")
    print(f"  rounds, system:     {_rounded(out['system_tps'], 1)}")
    print(f"  rounds, in-process: {_rounded(out['in_process_tps'], 1)}")
    print(f"  rounds, engine:     {_rounded(out['engine_tps'], 1)}")
    print(f"  load average after this part: {out['load'][0]:.1f}")
    seconds = args.batch * args.tokens / system_tps
    print(f"  the system's round, median seconds per part (round: {seconds:.3f} s)")
    for name, value in out["throughput_segments"]:
        print(f"    {name:<62} {value:8.3f}")

    batched, serial = statistics.median(out["batched"]), statistics.median(out["serial"])
    print()
    print(
        f"2. batching: {BATCHING_REQUESTS} requests over {ADAPTERS} LoRA adapters (rank "
        f"{ADAPTER_RANK}), {args.prompt} prompt + {args.tokens} sampled tokens each, median s"
    )
    print(f"  {'batched (all in flight at once)':<44} {batched:>10.3f}")
    print(f"  {'one at a time':<44} {serial:>10.3f}")
    print(f"  {'speedup':<44} {serial / batched:>10.2f}x")
    print(f"  rounds, batched:       {_rounded(out['batched'], 3)}")
    print(f"  rounds, one at a time: {_rounded(out['serial'], 3)}")
    print(f"  load average after this part: {out['load'][1]:.1f}")

    rounds: list[HandOff] = out["hand_offs"]
    print()
    print(
        f"3. hand-off of new weights (rank {ADAPTER_RANK}), median seconds over {len(rounds)} "
        f"rounds, each after a training step"
    )
    rows = [
        ("save_weights_and_get_sampling_client -> client", [h.save_s for h in rounds]),
        ("first sample on the new client (max_tokens=1)", [h.first_s for h in rounds]),
        ("warm sample, same adapter (max_tokens=1)", [h.warm_s for h in rounds]),
        ("hand-off cost: save + first - warm", [h.cost_s for h in rounds]),
    ]
    for name, values in rows:
        print(f"  {name:<62} {statistics.median(values):8.3f}")
    print(f"  rounds, hand-off cost: {_rounded([h.cost_s for h in rounds], 3)}")
    print(f"  load average after this part: {out['load'][2]:.1f}")
    print("  from the event log:")
    for name, value in out["hand_off_segments"]:
        print(f"    {name:<60} {value:8.3f}")

    held: dict[int, list[float]] = out["held"]
    fewest = min(held)
    print()
    print(
        f"4. adapters held in the sampler: a request of one sequence of {args.tokens} tokens "
        f"through one of them, median seconds over {args.rounds} rounds"
    )
    for count, values in sorted(held.items()):
        ratio = statistics.median(values) / statistics.median(held[fewest])
        print(
            f"  {count:>3} held {statistics.median(values):8.3f} s   x{ratio:.2f} of {fewest} held"
            f"   rounds: {_rounded(values, 3)}"
        )
    print(
        f"  (target: at most 1.1x with 64 held) load average after this part: {out['load'][3]:.1f}"
    )
    print(f"\nload average at the end {os.getloadavg()[0]:.1f} (other processes slow both sides)")


if __name__ == "__main__":
    sys.exit(main())
