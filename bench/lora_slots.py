"""The slot LoRA layer (services/lora_slots.py) against PEFT, side by side in one run: what a
forward costs as the adapters held grow, and what loading one costs.

On SmolLM2-135M-Instruct (float32, on this machine's CPU unless ``--device``), rank-16 adapters on
the attention and MLP projections and ``lm_head``, each with random weights:

1. a forward of one row of ``--tokens`` tokens (a decoding step's shape is one token; a prompt's
   is many) through one adapter, with 1, 8 and ``--most`` adapters held, for PEFT (a
   ``PeftModel`` holding them, the row routed with ``adapter_names``, as the torch sampler ran
   mixed batches) and for the slots (the row routed to its slot); one model of each kind per
   count, so that the six take turns, call by call, ``--repeats`` times: median of each;
2. a mixed batch: ``--rows`` rows, each through another adapter (the rows spread over 8 of them),
   with ``--most`` held;
3. loading one more adapter: PEFT's ``load_adapter`` from a saved directory against reading the
   same file and copying it into a free slot;
4. the torch sampling engine itself (services/sampler/torch_engine.py, which holds its adapters
   in slots): a request of one sequence of ``--sampled`` tokens through one adapter, on an
   engine with 1 adapter loaded and one with ``--most``, taking turns request by request;
   median seconds per decoding step.

Prints each time and the ratios (N adapters / 1, PEFT / slots). Targets (issue 17): a step with
64 adapters held at most 1.1x a step with 1. What is compared is measured interleaved (the order
of the sides turns at every round), so that the machine's drift falls on all of them alike.

    .venv/bin/python -m bench.lora_slots [--most 64] [--tokens 1] [--rows 8] [--repeats 30]
"""

from __future__ import annotations

import argparse
import copy
import statistics
import tempfile
import time
from collections.abc import Callable, Hashable
from pathlib import Path
from typing import TypeVar

import torch
from peft import LoraConfig, PeftModel, get_peft_model
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, PreTrainedModel

from services import lora_slots
from services.sampler.engine import run_all
from services.sampler.torch_engine import TorchEngine
from tinsmith import lora, models
from tinsmith._proto import bus_pb2 as bus
from tinsmith._proto import tinker_public_pb2 as tp

RANK = 16
MODEL = models.SMOLLM2
_K = TypeVar("_K", bound=Hashable)


def _interleaved_ms(sides: dict[_K, Callable[[], object]], repeats: int) -> dict[_K, float]:
    """Each side's median milliseconds a call, the sides taking turns call by call (each round
    starting one side further along), after three warm-up rounds."""
    order = list(sides)
    times: dict[_K, list[float]] = {side: [] for side in order}
    for round_ in range(3 + repeats):
        turn = order[round_ % len(order) :] + order[: round_ % len(order)]
        for side in turn:
            started = time.perf_counter()
            sides[side]()
            if round_ >= 3:
                times[side].append(time.perf_counter() - started)
    return {side: 1000 * statistics.median(found) for side, found in times.items()}


def _randomize(model: torch.nn.Module, seed: int) -> None:
    torch.manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_" in name:
                param.copy_(torch.randn_like(param) * 0.02)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--most", type=int, default=64)
    parser.add_argument("--tokens", type=int, default=1)
    parser.add_argument("--rows", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--sampled", type=int, default=32)
    args = parser.parse_args()
    device = torch.device(args.device)
    torch.set_grad_enabled(False)
    base: PreTrainedModel = AutoModelForCausalLM.from_pretrained(
        models.materialize(MODEL), dtype=torch.float32
    )
    base.eval()  # type: ignore[no-untyped-call]
    base.to(device)  # type: ignore[arg-type]
    targets = lora.target_modules("llama", attn=True, mlp=True, unembed=True)
    config = LoraConfig(r=RANK, lora_alpha=lora.ALPHA, target_modules=targets, lora_dropout=0.0)
    work = Path(tempfile.mkdtemp(prefix="bench-lora-slots-"))
    # One adapter saved per seed: PEFT loads them from disk as the sampler does.
    saved = []
    adapter = get_peft_model(copy.deepcopy(base), config)
    for n in range(args.most + 1):
        _randomize(adapter, n)
        adapter.save_pretrained(str(work / f"a{n}"), save_embedding_layers=False)
        saved.append(work / f"a{n}")
    del adapter
    print(f"{MODEL} on {device}, rank {RANK} adapters on {len(targets)} module kinds", flush=True)

    counts = sorted({1, 8, args.most})
    pefts: dict[int, PeftModel] = {}
    slotted: dict[int, tuple[PreTrainedModel, lora_slots.Slots, list[int]]] = {}
    for count in counts:
        peft = PeftModel.from_pretrained(copy.deepcopy(base), saved[0], adapter_name="a0")
        for n in range(1, count):
            peft.load_adapter(str(saved[n]), adapter_name=f"a{n}")
        pefts[count] = peft
        model = copy.deepcopy(base)
        slots = lora_slots.install(model, set(targets), max_rank=RANK)
        slotted[count] = (model, slots, [_load_slot(slots, saved[n], device) for n in range(count)])
    one = torch.randint(3, 1000, (1, args.tokens), device=device)
    mixed = torch.randint(3, 1000, (args.rows, args.tokens), device=device)

    def peft_one(count: int) -> Callable[[], object]:
        return lambda: pefts[count](one, adapter_names=["a0"])

    def slots_one(count: int) -> Callable[[], object]:
        model, slots, ids = slotted[count]

        def run() -> object:
            with slots.routed([ids[0]]):
                return model(one)

        return run

    sides: dict[tuple[str, int], Callable[[], object]] = {}
    for count in counts:
        sides[("PEFT", count)] = peft_one(count)
        sides[("slots", count)] = slots_one(count)
    ms = _interleaved_ms(sides, args.repeats)
    for count in counts:
        peft_ms, slot_ms = ms[("PEFT", count)], ms[("slots", count)]
        print(
            f"one row of {args.tokens} token(s), {count:3d} adapters held: PEFT {peft_ms:7.2f} ms"
            f" ({peft_ms / ms[('PEFT', 1)]:.2f}x of 1), slots {slot_ms:7.2f} ms"
            f" ({slot_ms / ms[('slots', 1)]:.2f}x of 1); PEFT / slots {peft_ms / slot_ms:.2f}x",
            flush=True,
        )
    held = args.most
    peft = pefts[held]
    model, slots, ids = slotted[held]
    names = [f"a{n % 8}" for n in range(args.rows)]
    routes = [ids[n % 8] for n in range(args.rows)]

    def peft_mixed() -> object:
        return peft(mixed, adapter_names=names)

    def slots_mixed() -> object:
        with slots.routed(routes):
            return model(mixed)

    ms_mixed = _interleaved_ms({"PEFT": peft_mixed, "slots": slots_mixed}, args.repeats)
    peft_ms, slot_ms = ms_mixed["PEFT"], ms_mixed["slots"]
    print(
        f"{args.rows} rows over 8 adapters, {held} held: PEFT {peft_ms:.2f} ms, slots "
        f"{slot_ms:.2f} ms; PEFT / slots {peft_ms / slot_ms:.2f}x",
        flush=True,
    )

    started = time.perf_counter()
    peft.load_adapter(str(saved[held]), adapter_name=f"a{held}")
    peft_s = time.perf_counter() - started
    slots.reserve(RANK, held + 1)
    started = time.perf_counter()
    _load_slot(slots, saved[held], device)
    slot_s = time.perf_counter() - started
    print(
        f"loading adapter {held + 1}: PEFT load_adapter {peft_s * 1000:.0f} ms, slots "
        f"{slot_s * 1000:.0f} ms; PEFT / slots {peft_s / slot_s:.1f}x"
    )
    engine_steps(saved, args.most, args.sampled, args.repeats)


def _load_slot(slots: lora_slots.Slots, saved: Path, device: torch.device) -> int:
    """Read a saved adapter's file and copy it into a free slot, as the sampler loads one."""
    state = load_file(str(saved / "adapter_model.safetensors"), device=str(device))
    return slots.load(lora_slots.peft_weights(state), rank=RANK, scale=lora.ALPHA / RANK)


def engine_steps(saved: list[Path], most: int, sampled: int, repeats: int) -> None:
    """Part 4: the sampling engine's decoding step with 1 and ``most`` adapters loaded, on two
    engines taking turns."""
    command = bus.Sample(
        base_model=MODEL,
        adapter_key="a0",
        prompt=list(range(100, 108)),
        params=tp.SamplingParams(max_tokens=sampled, temperature=1.0, top_k=-1, top_p=1.0, seed=1),
        num_samples=1,
    )
    engines: dict[int, TorchEngine] = {}
    for count in sorted({1, most}):
        engine = TorchEngine(
            models.default_cache_dir(), threads=torch.get_num_threads(), adapter_cache_bytes=2**40
        )
        for n in range(count):
            engine.load_adapter(MODEL, f"a{n}", saved[n])
        engines[count] = engine

    def request(engine: TorchEngine) -> Callable[[], object]:
        return lambda: run_all(engine, [command])

    ms = _interleaved_ms(
        {count: request(engine) for count, engine in engines.items()}, max(3, repeats // 3)
    )
    for count in engines:
        step = ms[count] / sampled
        print(
            f"engine: one sequence of {sampled} tokens, {count:3d} adapters loaded: "
            f"{step:.2f} ms per step ({ms[count] / ms[1]:.2f}x of 1)",
            flush=True,
        )


if __name__ == "__main__":
    main()
