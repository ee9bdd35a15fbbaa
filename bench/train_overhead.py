"""How much slower one training step is through the whole system than plain peft in-process.

One step is one ``forward_backward`` (cross_entropy over B sequences of T random tokens, every
weight 1) plus one ``optim_step`` (AdamW). For each model it is measured two ways, in one run:

(a) system: the official tinker SDK against ``tinsmith up``, started here as a subprocess on a free
    port with its own temporary data and model-cache directories. A step submits both requests,
    then waits for both, as the SDK intends (it pipelines them).
(b) in-process: the same model directory loaded with transformers (float32), the trainer's LoRA
    config (alpha 32, dropout 0, attention + MLP + unembedding), ``torch.optim.AdamW`` with the
    SDK's default Adam parameters, and the trainer's math: one padded forward, log_softmax and
    gather, a summed loss, backward, ``clip_grad_norm_``, step. All on this process's main thread
    with the trainer's intra-op thread count (``TINSMITH_TORCH_THREADS``, default half the cores).

After warm-up the sides alternate, a, b, a, b ..., so machine noise hits both; the medians and
their ratio are printed. Then the system's step is split along its critical path, from the
events the gateway and trainer appended (their ``time`` stamps, and ``compute_seconds`` of each
``RequestCompleted``), to show where the overhead goes. Both processes share the machine's cores,
but never compute at the same time: while one side runs, the other is idle.

    .venv/bin/python -m bench.train_overhead [--models M ...] [--batch 8] [--seq 128] [--rounds 20]
"""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # read when huggingface_hub is imported
os.environ.setdefault("TINKER_TELEMETRY", "0")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import argparse
import asyncio
import math
import re
import statistics
import sys
import tempfile
import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import tinker
import torch
import transformers
from peft import LoraConfig, get_peft_model
from tinker import types
from transformers import AutoModelForCausalLM

from tinsmith import events, models, subjects
from tinsmith._proto import bus_pb2 as bus
from tinsmith.bus import Bus
from tinsmith.child import UpProcess

DEFAULT_MODELS = (models.TINY, models.SMALL)
TARGET_RATIO = 1.10
LORA_ALPHA = 32  # services/trainer/engine.py
TARGET_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
ADAM = types.AdamParams(learning_rate=1e-4)  # the SDK's defaults for everything else


# --- the system ---------------------------------------------------------------------------------


def nats_url(system: UpProcess) -> str:
    """The address of the system's own nats-server, from the config ``tinsmith up`` wrote."""
    config = (system.data_dir / "nats-server.conf").read_text()
    found = re.search(r"listen:\s*(\S+)", config)
    if found is None:
        raise RuntimeError(f"no listen address in {system.data_dir / 'nats-server.conf'}")
    return f"nats://{found.group(1)}"


def start_system(
    data_dir: Path,
    cache_dir: Path,
    timeout_s: float = 300.0,
    env: dict[str, str] | None = None,
) -> UpProcess:
    """``tinsmith up`` on a free port (``env`` added to its environment); returns once it prints
    that it is ready and its standby interpreter has done its imports
    (``UpProcess.wait_standby``)."""
    system = UpProcess(data_dir, env={"TINSMITH_CACHE_DIR": str(cache_dir), **(env or {})})
    try:
        system.wait_ready(timeout_s)
        system.wait_standby(timeout_s)
    except RuntimeError:
        system.stop()
        raise
    return system


# --- the two sides ------------------------------------------------------------------------------


class SystemSide:
    """(a): a LoRA training client of the SDK; a step pipelines forward_backward and optim_step."""

    def __init__(self, service: tinker.ServiceClient, model: str, rank: int, tokens: np.ndarray):
        self.training = service.create_lora_training_client(
            base_model=model, rank=rank, seed=0
        ).result()
        self.data = [
            types.Datum(
                model_input=types.ModelInput.from_ints(row[:-1].tolist()),
                loss_fn_inputs={
                    "target_tokens": types.TensorData.from_numpy(row[1:]),
                    "weights": types.TensorData.from_numpy(np.ones(len(row) - 1, np.float32)),
                },
            )
            for row in tokens
        ]
        self.spans: list[tuple[float, float]] = []  # wall-clock start and end of every step

    @property
    def model_id(self) -> str:
        return str(self.training.model_id)

    def step(self) -> float:
        wall, start = time.time(), time.perf_counter()
        fb = self.training.forward_backward(self.data, "cross_entropy")
        optim = self.training.optim_step(ADAM)
        fb.result()
        optim.result()
        elapsed = time.perf_counter() - start
        self.spans.append((wall, wall + elapsed))
        return elapsed


class InProcessSide:
    """(b): the trainer's computation with plain transformers + peft, on the calling thread."""

    def __init__(self, model_dir: Path, rank: int, tokens: np.ndarray) -> None:
        torch.manual_seed(0)
        base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        base.requires_grad_(False)
        base.eval()  # type: ignore[no-untyped-call]
        config = LoraConfig(
            r=rank,
            lora_alpha=LORA_ALPHA,
            lora_dropout=0.0,
            target_modules=[*TARGET_MODULES, "lm_head"],
            bias="none",
        )
        self.model = get_peft_model(base, config, adapter_name="bench")
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(
            self.params,
            lr=ADAM.learning_rate,
            betas=(ADAM.beta1, ADAM.beta2),
            eps=ADAM.eps,
            weight_decay=ADAM.weight_decay,
        )
        self.tokens = tokens
        self.forward_backward_s: list[float] = []
        self.optim_s: list[float] = []

    def step(self) -> float:
        start = time.perf_counter()
        tokens = torch.from_numpy(self.tokens)
        batch, width = tokens.shape[0], tokens.shape[1] - 1
        ids = torch.zeros((batch, width), dtype=torch.long)
        mask = torch.zeros((batch, width), dtype=torch.long)
        targets = torch.zeros((batch, width), dtype=torch.long)
        weights = torch.zeros((batch, width), dtype=torch.float32)
        ids[:] = tokens[:, :-1]
        mask[:] = 1
        targets[:] = tokens[:, 1:]
        weights[:] = 1.0
        self.model.train(False)
        logits = self.model(input_ids=ids, attention_mask=mask).logits.float()
        logprobs = torch.log_softmax(logits, dim=-1).gather(-1, targets[..., None])[..., 0]
        loss = (-weights * logprobs).sum()
        loss.backward()  # type: ignore[no-untyped-call]
        middle = time.perf_counter()
        max_norm = ADAM.grad_clip_norm if ADAM.grad_clip_norm > 0 else math.inf
        torch.nn.utils.clip_grad_norm_(self.params, max_norm)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        end = time.perf_counter()
        self.forward_backward_s.append(middle - start)
        self.optim_s.append(end - middle)
        return end - start


# --- where the system's time goes ---------------------------------------------------------------


@dataclass
class _Request:
    accepted: float = math.nan
    completed: float = math.nan
    compute_s: float = math.nan


async def _run_requests(nats_url: str, model_id: str) -> dict[str, list[_Request]]:
    """The run's forward_backward and optim_step requests, in seq_id order, from the event log."""
    bus_ = await Bus.connect(nats_url, name="bench-train-overhead")
    try:
        by_id: dict[str, _Request] = {}
        kinds: dict[str, tuple[str, int]] = {}
        for seq in range(1, await bus_.last_seq(subjects.EVENTS_STREAM) + 1):
            event = events.decode(await bus_.get(subjects.EVENTS_STREAM, seq))
            kind = events.kind_of(event)
            if kind not in ("request_accepted", "request_completed"):
                continue
            body = getattr(event, kind)
            if body.aggregate_id != model_id:
                continue
            request = by_id.setdefault(body.request_id, _Request())
            if isinstance(body, bus.RequestAccepted):
                request.accepted = event.time
                kinds[body.request_id] = (events.command_of(body), body.seq_id)
            else:
                request.completed = event.time
                request.compute_s = body.compute_seconds
    finally:
        await bus_.close()
    ordered = sorted(kinds.items(), key=lambda item: item[1][1])
    out: dict[str, list[_Request]] = {"forward_backward": [], "optim_step": []}
    for request_id, (command, _) in ordered:
        if command in out:
            out[command].append(by_id[request_id])
    return out


def breakdown(
    system: UpProcess, side: SystemSide, measured: int, reference: InProcessSide
) -> list[tuple[str, float]]:
    """Median seconds of each segment of the measured system steps' critical path."""
    requests = asyncio.run(_run_requests(nats_url(system), side.model_id))
    if not len(side.spans) == len(requests["forward_backward"]) == len(requests["optim_step"]):
        return []  # the SDK split a forward_backward into chunks: no one request per step
    steps = zip(side.spans, requests["forward_backward"], requests["optim_step"], strict=True)
    rows: list[dict[str, float]] = []
    for (start, end), fb, optim in list(steps)[-measured:]:
        compute = fb.compute_s + optim.compute_s
        rows.append(
            {
                "SDK + HTTP + gateway, until forward_backward accepted": fb.accepted - start,
                "  accepted -> trainer compute starts, + result stored": (
                    fb.completed - fb.accepted - fb.compute_s
                ),
                "  trainer forward_backward compute (compute_seconds)": fb.compute_s,
                "forward_backward completed -> optim compute starts, + stored": (
                    optim.completed - fb.completed - optim.compute_s
                ),
                "  trainer optim_step compute (compute_seconds)": optim.compute_s,
                "optim_step completed -> both results back in the SDK": end - optim.completed,
                "= the step outside the trainer's compute": end - start - compute,
            }
        )
    segments = [(name, statistics.median(row[name] for row in rows)) for name in rows[0]]
    segments.append(
        ("(in-process forward_backward)", statistics.median(reference.forward_backward_s))
    )
    segments.append(("(in-process optim_step)", statistics.median(reference.optim_s)))
    return segments


# --- the run ------------------------------------------------------------------------------------


@dataclass
class Result:
    model: str
    system_s: float
    in_process_s: float
    segments: list[tuple[str, float]]
    best_ratio: float  # of the fastest step of each side: less sensitive to other load

    @property
    def ratio(self) -> float:
        return self.system_s / self.in_process_s


def measure(
    system: UpProcess,
    service: tinker.ServiceClient,
    cache_dir: Path,
    model: str,
    args: argparse.Namespace,
) -> Result:
    tokens = np.random.default_rng(0).integers(
        0, models.get(model).vocab_size, (args.batch, args.seq + 1), dtype=np.int64
    )
    a = SystemSide(service, model, args.rank, tokens)
    b = InProcessSide(models.materialize(model, cache_dir), args.rank, tokens)
    sides: tuple[Callable[[], float], Callable[[], float]] = (a.step, b.step)
    for _ in range(args.warmup):
        for step in sides:
            step()
    b.forward_backward_s.clear()
    b.optim_s.clear()
    times: tuple[list[float], list[float]] = ([], [])
    for _ in range(args.rounds):
        for step, into in zip(sides, times, strict=True):
            into.append(step())
    segments = breakdown(system, a, args.rounds, b)
    return Result(
        model,
        statistics.median(times[0]),
        statistics.median(times[1]),
        segments,
        min(times[0]) / min(times[1]),
    )


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", nargs="+", default=list(DEFAULT_MODELS))
    parser.add_argument("--batch", type=int, default=8, help="sequences per step (default 8)")
    parser.add_argument("--seq", type=int, default=128, help="tokens per sequence (default 128)")
    parser.add_argument("--rounds", type=int, default=20, help="measured a, b pairs (default 20)")
    parser.add_argument("--warmup", type=int, default=3, help="unmeasured a, b pairs (default 3)")
    parser.add_argument("--rank", type=int, default=32, help="LoRA rank (default 32, the SDK's)")
    parser.add_argument(
        "--threads",
        type=int,
        default=max(1, (os.cpu_count() or 2) // 2),
        help="torch intra-op threads on both sides (default: half the cores, as the trainer)",
    )
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    transformers.logging.disable_progress_bar()  # type: ignore[no-untyped-call]
    warnings.filterwarnings("ignore", category=FutureWarning)
    # Both sides: the system's trainer reads TINSMITH_TORCH_THREADS (services/trainer/config.py).
    os.environ["TINSMITH_TORCH_THREADS"] = str(args.threads)
    torch.set_num_threads(args.threads)
    print(
        f"batch {args.batch}x{args.seq}, LoRA rank {args.rank}, {args.warmup} warm-up + "
        f"{args.rounds} measured rounds, torch threads {torch.get_num_threads()}, "
        f"{os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f}",
        flush=True,
    )
    results: list[Result] = []
    with tempfile.TemporaryDirectory(prefix="tinsmith-bench-") as tmp:
        cache_dir = Path(tmp, "cache")
        system = start_system(Path(tmp, "data"), cache_dir)
        service = tinker.ServiceClient(base_url=system.url, api_key="tml-bench")
        try:
            for model in args.models:
                result = measure(system, service, cache_dir, model, args)
                results.append(result)
                print(
                    f"{model}: system {result.system_s:.4f} s/step, in-process "
                    f"{result.in_process_s:.4f} s/step, ratio {result.ratio:.3f}",
                    flush=True,
                )
        finally:
            service.close("success").result(timeout=30)
            system.stop()
    print()
    print("median seconds per step, their ratio, and the ratio of the fastest steps")
    print(
        f"{'model':<24} {'batch':>8} {'system s':>10} {'in-proc s':>10} {'ratio':>7} "
        f"{'min ratio':>10}"
    )
    for r in results:
        shape = f"{args.batch}x{args.seq}"
        print(
            f"{r.model:<24} {shape:>8} {r.system_s:>10.4f} {r.in_process_s:>10.4f} "
            f"{r.ratio:>7.3f} {r.best_ratio:>10.3f}"
        )
    print(f"(target: system / in-process <= {TARGET_RATIO:.2f} for tinsmith/small at 8x128)")
    print(f"load average at the end {os.getloadavg()[0]:.1f} (other processes slow both sides)")
    for r in results:
        print(f"\n{r.model}: the system's step, median seconds per segment")
        if not r.segments:
            print("  (not available: the SDK sent each forward_backward in several chunks)")
        for name, seconds in r.segments:
            print(f"  {name:<66} {seconds:8.4f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
