"""The slot LoRA layer (services/lora_slots.py) against PEFT, side by side in one run: what a
forward costs as the adapters held grow, and what loading one costs.

On SmolLM2-135M-Instruct (float32, on this machine's CPU unless ``--device``), rank-16 adapters on
the attention and MLP projections and ``lm_head``, each with random weights:

1. a forward of one row of ``--tokens`` tokens (a decoding step's shape is one token; a prompt's
   is many) through one adapter, with 1, 8 and ``--most`` adapters held, for PEFT (one
   ``PeftModel`` holding them all, the row routed with ``adapter_names``, as the torch sampler
   runs mixed batches) and for the slots (the row routed to its slot); median of ``--repeats``;
2. a mixed batch: ``--rows`` rows, each through another adapter (the rows spread over 8 of them),
   with ``--most`` held;
3. loading one more adapter: PEFT's ``load_adapter`` from a saved directory against reading the
   same file and copying it into a free slot;
4. the torch sampling engine itself (services/sampler/torch_engine.py, which holds its adapters
   in slots): a request of one sequence of ``--sampled`` tokens through one adapter, with 1 and
   ``--most`` adapters loaded; median seconds per decoding step.

Prints each time and the ratios (N adapters / 1, PEFT / slots). Targets (issue 17): a step with
64 adapters held at most 1.1x a step with 1.

    .venv/bin/python -m bench.lora_slots [--most 64] [--tokens 1] [--rows 8] [--repeats 30]
"""

from __future__ import annotations

import argparse
import copy
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

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


def _median_ms(run: Callable[[], object], repeats: int) -> float:
    for _ in range(3):
        run()
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        run()
        times.append(time.perf_counter() - started)
    return 1000 * statistics.median(times)


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

    peft = PeftModel.from_pretrained(copy.deepcopy(base), saved[0], adapter_name="a0")
    slotted = copy.deepcopy(base)
    slots = lora_slots.install(slotted, set(targets), max_rank=RANK)

    def load_slot(n: int) -> int:
        state = load_file(str(saved[n] / "adapter_model.safetensors"), device=str(device))
        return slots.load(lora_slots.peft_weights(state), rank=RANK, scale=lora.ALPHA / RANK)

    first = load_slot(0)
    one = torch.randint(3, 1000, (1, args.tokens), device=device)
    mixed = torch.randint(3, 1000, (args.rows, args.tokens), device=device)

    def peft_one() -> object:
        return peft(one, adapter_names=["a0"])

    def slots_one() -> object:
        with slots.routed([first]):
            return slotted(one)

    rows: dict[int, tuple[float, float]] = {}
    held = 1
    for count in sorted({1, 8, args.most}):
        while held < count:
            peft.load_adapter(str(saved[held]), adapter_name=f"a{held}")
            load_slot(held)
            held += 1
        rows[count] = (_median_ms(peft_one, args.repeats), _median_ms(slots_one, args.repeats))
        peft_ms, slot_ms = rows[count]
        print(
            f"one row of {args.tokens} token(s), {count:3d} adapters held: PEFT {peft_ms:7.2f} ms"
            f" ({peft_ms / rows[1][0]:.2f}x of 1), slots {slot_ms:7.2f} ms"
            f" ({slot_ms / rows[1][1]:.2f}x of 1); PEFT / slots {peft_ms / slot_ms:.2f}x",
            flush=True,
        )

    names = [f"a{n % 8}" for n in range(args.rows)]
    routes = [n % 8 for n in range(args.rows)]  # the slots were filled in order

    def peft_mixed() -> object:
        return peft(mixed, adapter_names=names)

    def slots_mixed() -> object:
        with slots.routed(routes):
            return slotted(mixed)

    peft_ms, slot_ms = _median_ms(peft_mixed, args.repeats), _median_ms(slots_mixed, args.repeats)
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
    load_slot(held)
    slot_s = time.perf_counter() - started
    print(
        f"loading adapter {held + 1}: PEFT load_adapter {peft_s * 1000:.0f} ms, slots "
        f"{slot_s * 1000:.0f} ms; PEFT / slots {peft_s / slot_s:.1f}x"
    )
    engine_steps(saved, args.most, args.sampled, args.repeats)


def engine_steps(saved: list[Path], most: int, sampled: int, repeats: int) -> None:
    """Part 4: the sampling engine's decoding step with 1 and ``most`` adapters loaded."""
    engine = TorchEngine(
        models.default_cache_dir(), threads=torch.get_num_threads(), adapter_cache_bytes=2**40
    )
    command = bus.Sample(
        base_model=MODEL,
        adapter_key="a0",
        prompt=list(range(100, 108)),
        params=tp.SamplingParams(max_tokens=sampled, temperature=1.0, top_k=-1, top_p=1.0, seed=1),
        num_samples=1,
    )
    step_ms: dict[int, float] = {}
    loaded = 0
    for count in sorted({1, most}):
        while loaded < count:
            engine.load_adapter(MODEL, f"a{loaded}", saved[loaded])
            loaded += 1
        step_ms[count] = _median_ms(lambda: run_all(engine, [command]), max(3, repeats // 5))
        step_ms[count] /= sampled
        print(
            f"engine: one sequence of {sampled} tokens, {count:3d} adapters loaded: "
            f"{step_ms[count]:.2f} ms per step ({step_ms[count] / step_ms[1]:.2f}x of 1)",
            flush=True,
        )


if __name__ == "__main__":
    main()
