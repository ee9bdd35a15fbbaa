"""How the trainer and the torch sampler load a base model (``load``): in the placement's dtype,
frozen, on its device, its norms fused (services/norms.py), and every tensor left on the host in
memory of its own, laid out for the products the engine computes.

Both host steps are for the CPU; on a GPU the weights are copied to the device and these are
no-ops.

- **Memory of its own.** transformers' ``from_pretrained`` leaves each tensor of a safetensors
  checkpoint whose dtype is the file's as a view of the file mapped into memory, where the file
  puts it: after a header of any length, so only 8-byte aligned, in the 4 KiB pages of the
  file's mapping. On the CPU they stayed there, and every matrix product of the engines streamed
  its weights from there. Measured on tinsmith/small (a decoding step of 8 rows through the
  sampler's forward, one thread, alternating in one process): 5.7 to 6.1 ms with the mapped
  weights, 5.0 to 5.3 ms with the same weights copied into memory from the CPU allocator
  (64-byte aligned). The copy is made one tensor at a time, so a load needs at most one tensor's
  memory more than the model; the file's pages are the page cache's to drop afterwards.
- **Transposed linear weights where few rows are multiplied** (``few_rows``, the sampler). A
  decoding step multiplies a few rows by every weight, and the CPU's BLAS computes ``x W^T``
  for a handful of rows markedly faster with ``W`` [out, in] stored column by column (the same
  tensor, transposed in memory) than row by row: at 8 rows on one thread, 41 against 56 us for
  tinsmith/small's 1024 x 256 gate, 196 against 404 us for SmolLM2's 1536 x 576, 18 against
  25 ms for its 49152 x 576 head; the same at 256 rows and more (a prefill), measured with
  torch 2.13's MKL on a Xeon. A decoding forward of tinsmith/small went from 5.4 to 4.6 ms, one of
  SmolLM2 from 126 to 112 ms. A head tied to the input embedding is transposed with it: the
  embedding's lookup of rows then gathers strided columns (39 against 3 us for 8 tokens of
  SmolLM2, 1.2 ms against 27 us for 256), far less than the head gains. The trainer keeps
  its weights row by row: its products have hundreds of rows, and its backward multiplies by
  ``W`` as well as by ``W^T``.

Owns: the steps from a model directory to a base model the engines compute with, and what its
weights take (``weights_bytes``). Does not own: whether it fits (each engine plans its own
memory), the LoRA layer (services/lora_slots.py).
"""

from __future__ import annotations

import math
from pathlib import Path

import torch
from safetensors import safe_open
from transformers import AutoModelForCausalLM, PreTrainedModel

from services import norms
from services.device import Placement


def load(directory: Path, placement: Placement, *, few_rows: bool = False) -> PreTrainedModel:
    """The model in ``directory`` on ``placement``'s device, in its dtype, frozen and in eval
    mode, its norms fused and its host tensors its own (``own_host_tensors``). ``few_rows``: the
    model mostly multiplies a few rows at a time (the sampler's decoding steps), so its linear
    layers' weights on the host are stored transposed."""
    model: PreTrainedModel = AutoModelForCausalLM.from_pretrained(directory, dtype=placement.dtype)
    model.requires_grad_(False)
    model.eval()  # type: ignore[no-untyped-call]
    torch.nn.Module.to(model, placement.device)
    own_host_tensors(model, transpose_linear=few_rows)
    norms.fuse(model)
    return model


def own_host_tensors(model: torch.nn.Module, *, transpose_linear: bool = False) -> None:
    """Copy every parameter and buffer of ``model`` that is on the CPU into storage of its own,
    in place (the parameter stays the same object, so tied weights stay tied).
    ``transpose_linear``: the weight of each ``nn.Linear`` is stored transposed (the same
    [out, in] tensor, its columns contiguous), which is what a product of a few rows by it is
    fastest with on the CPU (see the module's docstring)."""
    linear = (
        {id(m.weight) for m in model.modules() if isinstance(m, torch.nn.Linear)}
        if transpose_linear
        else set()
    )
    with torch.no_grad():
        for tensor in (*model.parameters(), *model.buffers()):
            if tensor.device.type != "cpu":
                continue
            if id(tensor) in linear and tensor.dim() == 2:
                tensor.data = tensor.data.t().contiguous().t()
            else:
                tensor.data = tensor.data.clone(memory_format=torch.contiguous_format)


def weights_bytes(directory: Path, dtype: torch.dtype) -> int:
    """What a model directory's weights take in ``dtype``, from its safetensors headers."""
    cells = 0
    for path in sorted(directory.glob("*.safetensors")):
        with safe_open(str(path), "pt") as file:
            for key in file.keys():  # noqa: SIM118 (a safetensors file is not a dict)
                cells += math.prod(file.get_slice(key).get_shape())
    return cells * dtype.itemsize
