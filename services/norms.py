"""The llama family's RMSNorm (llama, mistral, qwen2, qwen3: the same module in each modelling
module) fused, for the trainer's and the sampler's base models.

transformers' module computes ``weight * (x32 * rsqrt(mean(x32 ** 2) + eps)).to(dtype)``, with
x32 the input in float32, in seven operations, and its backward in as many again: on a GPU, where
both engines spend their time launching kernels (docs/performance.md), torch's fused norm
(``F.rms_norm``) is one kernel each way, then the cast back and the weight's product as the
module applies them; a GPU's fused kernel sums the squares in its own order. On the CPU torch
computes ``F.rms_norm`` with the module's own operations, and more dispatch around them than the
operations themselves cost at a decoding step's few rows, so there the fused norm is those
operations, called directly: bit for bit the module's outputs and gradients (tested), without
the module call.

Owns: which norm modules are the family's (by class), and computing them fused. Does not own:
where the norms are called (the models' forwards; services/sampler/decoder.py).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import cast

import torch
import torch.nn.functional as F
from torch import Tensor, nn

# The modules that compute exactly ``weight * (x32 * rsqrt(mean(x32**2) + eps)).to(dtype)``.
NORMS = frozenset({"LlamaRMSNorm", "MistralRMSNorm", "Qwen2RMSNorm", "Qwen3RMSNorm"})

Norm = Callable[[Tensor], Tensor]


class RMSNorm:
    """One of ``NORMS`` fused: ``F.rms_norm`` on an accelerator, the module's operations on the
    CPU. The weight is read from the module at each call, so the module's own parameter is
    always the one used."""

    def __init__(self, module: nn.Module, eps: float) -> None:
        self.module = module
        # Its parameters by name, read at each call without the module's attribute lookup.
        self._parameters = module._parameters
        self.eps = eps

    def __call__(self, x: Tensor) -> Tensor:
        x32 = x.to(torch.float32)
        if x.is_cpu:
            # The module's operations, as F.rms_norm computes them on the CPU, without its
            # dispatch around them: a tinsmith/small decoding step took 1-3.5% less time so.
            normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        else:
            normed = F.rms_norm(x32, (x.shape[-1],), eps=self.eps)
        weight = cast(Tensor, self._parameters["weight"])
        return weight * normed.to(x.dtype)


def fused(module: nn.Module) -> Norm:
    """``module`` as ``RMSNorm`` where it is one of ``NORMS``, else the module itself."""
    eps = getattr(module, "variance_epsilon", None)
    if type(module).__name__ in NORMS and isinstance(eps, float):
        return RMSNorm(module, eps)
    return cast(Norm, module)


def fuse(model: nn.Module) -> int:
    """Make every ``NORMS`` module of ``model`` compute as ``RMSNorm`` when called (its
    ``forward``; nothing else of it changes); how many it made so."""
    count = 0
    for module in model.modules():
        norm = fused(module)
        if isinstance(norm, RMSNorm):
            module.forward = norm
            count += 1
    return count
