"""A model directory with a real model's shape and random weights: what the benchmarks time a
model with on a machine its weights cannot reach (the GPU machines here take 64 MiB of files,
and SmolLM2-135M's GGUF alone is 98 MB).

Given ``--like SOURCE`` (a built-in model's name or a model directory), the directory first gets
a copy of SOURCE's files but its weights: ``config.json``, the generation config and the
tokenizer's files. Then, where the directory has no weights yet, it gets weights of the shape its
``config.json`` describes, drawn with transformers' own initializer from a fixed seed and saved
as ``model.safetensors`` in float32. A model's speed depends on its shape alone, so the figures
hold for the real weights; what it generates is noise, which a benchmark that asks for a fixed
number of tokens (``stop=[]``) does not look at.

    .venv/bin/python -m bench.random_weights DIR [--like SOURCE] [--no-weights]

``--no-weights`` copies the skeleton alone, to carry to the machine that draws the weights.

Serve DIR by putting its parent in ``TINSMITH_MODEL_DIRS``; its name is then DIR's absolute path.
"""

from __future__ import annotations

import argparse
import shutil
from pathlib import Path

from tinsmith import models

SEED = 20261127
_WEIGHTS = (".safetensors", ".bin", ".gguf", ".pt", ".pth")
_WEIGHT_INDEXES = ("model.safetensors.index.json", "pytorch_model.bin.index.json")


def copy_skeleton(source: Path, out: Path) -> list[str]:
    """Copy ``source``'s files but its weights into ``out``; the names copied."""
    out.mkdir(parents=True, exist_ok=True)
    copied = []
    for path in sorted(source.iterdir()):
        if path.is_file() and not path.name.endswith(_WEIGHTS) and path.name not in _WEIGHT_INDEXES:
            shutil.copyfile(path, out / path.name)
            copied.append(path.name)
    if "config.json" not in copied:
        raise SystemExit(f"{source} has no config.json")
    return copied


def has_weights(directory: Path) -> bool:
    return any(path.name.endswith(_WEIGHTS) for path in directory.iterdir())


def write_random_weights(directory: Path) -> int:
    """Random float32 weights for ``directory``'s config, saved beside it; their parameter
    count."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(directory)
    torch.manual_seed(SEED)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.save_pretrained(directory)
    return sum(p.numel() for p in model.parameters())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("directory", type=Path)
    parser.add_argument("--like", help="a built-in model's name or a model directory")
    parser.add_argument("--no-weights", action="store_true", help="copy the skeleton only")
    args = parser.parse_args()
    out: Path = args.directory
    if args.like:
        source = Path(args.like)
        if not source.is_dir():
            source = models.materialize(args.like)
        print(f"{out}: {', '.join(copy_skeleton(source, out))} from {args.like}", flush=True)
    if not (out / "config.json").is_file():
        raise SystemExit(f"{out} has no config.json: give --like")
    if args.no_weights:
        return
    if has_weights(out):
        print(f"{out} has weights already", flush=True)
        return
    count = write_random_weights(out)
    print(f"{out}: {count / 1e6:.1f}M random parameters (seed {SEED})", flush=True)


if __name__ == "__main__":
    main()
