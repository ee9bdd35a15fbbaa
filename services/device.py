"""Where the engines compute, in what precision, and with how much memory: ``TINSMITH_DEVICE``,
``TINSMITH_DTYPE`` and ``TINSMITH_DEVICE_MEMORY_MB``, for the trainer and the torch sampler alike.

Owns: resolving the device (``auto``: CUDA if present, else Apple's MPS, else the CPU; or
``cuda``, ``cuda:N``, ``mps``, ``cpu``), refusing at start a device that is not there (nothing
falls back to the CPU silently), the precision policy, the device's memory as the engines plan
against it, and telling an out-of-memory error from any other. Does not own: what the engines put
on the device (services/trainer/engine.py, services/sampler/torch_engine.py).

The precision policy:

- the frozen base weights are ``TINSMITH_DTYPE``: ``bfloat16`` by default on a GPU (CUDA, MPS),
  ``float32`` on the CPU (which has no fast half-precision matmul); ``float16`` on request;
- LoRA parameters, their gradients and the AdamW state are always float32;
- log-softmax, the losses and every logprob returned are computed in float32, from logits cast
  up first.

One code path serves every device: the engines take a ``Placement`` and put tensors on
``placement.device``; the tests run it on the CPU.
"""

from __future__ import annotations

import math
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass

import torch

DEVICE_VARIABLE = "TINSMITH_DEVICE"
DTYPE_VARIABLE = "TINSMITH_DTYPE"
MEMORY_VARIABLE = "TINSMITH_DEVICE_MEMORY_MB"
SHARE_VARIABLE = "TINSMITH_DEVICE_MEMORY_SHARE"

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
_DEVICE = re.compile(r"auto|cpu|mps|cuda(?::[0-9]{1,3})?")
# Of a GPU's memory, what an engine plans to use by default: the rest is for the CUDA context,
# the caching allocator's fragmentation and other processes' kernels. Where two engines share
# one GPU (``tinsmith up``: the trainer and the sampler), each gets half of it
# (TINSMITH_DEVICE_MEMORY_SHARE).
_GPU_SHARE = 0.9


class DeviceError(RuntimeError):
    """The configured device or precision cannot be used here; the message says why and what
    to set instead."""


@dataclass(frozen=True)
class Placement:
    """Where an engine computes: its device, the dtype of its frozen base weights, and the
    memory it may plan to hold there (bytes)."""

    device: torch.device
    dtype: torch.dtype
    memory_bytes: int

    @property
    def kind(self) -> str:
        return self.device.type

    def describe(self) -> str:
        """One line for logs and /readyz, e.g. ``cuda:0 (NVIDIA H100, 79.1 GiB), bfloat16 base
        weights, a budget of 71.2 GiB``."""
        name = self.device.type
        if self.device.type == "cuda":
            name = torch.cuda.get_device_name(self.device)
        total = total_memory(self.device)
        return (
            f"{self.device} ({name}, {_size(total)}), "
            f"{str(self.dtype).removeprefix('torch.')} base weights, "
            f"a budget of {_size(self.memory_bytes)}"
        )


def _size(nbytes: int) -> str:
    return f"{nbytes / 2**30:.1f} GiB" if nbytes >= 2**30 else f"{nbytes / 2**20:.0f} MiB"


def placement_from_env(env: Mapping[str, str] = os.environ) -> Placement:
    """The placement the environment asks for; ``DeviceError`` if it cannot be had here."""
    device = resolve_device(env.get(DEVICE_VARIABLE, "") or "auto")
    dtype = resolve_dtype(env.get(DTYPE_VARIABLE, ""), device)
    raw = env.get(MEMORY_VARIABLE, "").strip()
    if raw:
        if not raw.isdigit() or int(raw) == 0:
            raise DeviceError(f"{MEMORY_VARIABLE} must be a positive number of MiB, got {raw!r}")
        budget = int(raw) << 20
    else:
        share = _share(env.get(SHARE_VARIABLE, "").strip(), device)
        budget = int(total_memory(device) * share)
    return Placement(device=device, dtype=dtype, memory_bytes=budget)


def _share(raw: str, device: torch.device) -> float:
    """The fraction of the device's memory this engine plans with: TINSMITH_DEVICE_MEMORY_SHARE,
    else 90% of a GPU and all of the CPU's."""
    if not raw:
        return 1.0 if device.type == "cpu" else _GPU_SHARE
    try:
        share = float(raw)
    except ValueError:
        share = math.nan
    if not 0 < share <= 1:
        raise DeviceError(f"{SHARE_VARIABLE} must be a fraction in (0, 1], got {raw!r:.40}")
    return share


def resolve_device(name: str) -> torch.device:
    """``auto``, ``cpu``, ``mps``, ``cuda`` or ``cuda:N`` as a device that is present."""
    name = name.strip().lower()
    if not _DEVICE.fullmatch(name):
        raise DeviceError(
            f"{DEVICE_VARIABLE}={name!r:.40} is not a device: use auto, cuda, cuda:N, mps or cpu"
        )
    if name == "auto":
        if torch.cuda.is_available():
            return torch.device("cuda", torch.cuda.current_device())
        if torch.backends.mps.is_available():
            return torch.device("mps")
        return torch.device("cpu")
    device = torch.device(name)
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise DeviceError(
                f"{DEVICE_VARIABLE}={name} but this torch sees no CUDA device (torch "
                f"{torch.__version__}, CUDA build: {torch.version.cuda or 'no'}); set "
                f"{DEVICE_VARIABLE}=cpu to compute on the CPU"
            )
        index = device.index if device.index is not None else torch.cuda.current_device()
        if index >= torch.cuda.device_count():
            raise DeviceError(
                f"{DEVICE_VARIABLE}={name} but only {torch.cuda.device_count()} CUDA devices are "
                "visible (CUDA_VISIBLE_DEVICES renumbers them from 0)"
            )
        return torch.device("cuda", index)
    if device.type == "mps" and not torch.backends.mps.is_available():
        raise DeviceError(f"{DEVICE_VARIABLE}=mps but this machine has no MPS device")
    return device


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    """The base weights' dtype: ``name``, or the device's default."""
    name = name.strip().lower()
    if not name:
        return torch.float32 if device.type == "cpu" else torch.bfloat16
    if name not in DTYPES:
        raise DeviceError(
            f"{DTYPE_VARIABLE}={name!r:.40} is not a dtype: use one of {', '.join(DTYPES)}"
        )
    return DTYPES[name]


def total_memory(device: torch.device) -> int:
    """The device's memory in bytes: a GPU's own, or for the CPU what this process may use (its
    cgroup's limit, if one is set, else the machine's RAM)."""
    if device.type == "cuda":
        return int(torch.cuda.get_device_properties(device).total_memory)
    if device.type == "mps":
        return int(torch.mps.recommended_max_memory())
    physical = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return min(physical, _cgroup_limit() or physical)


def allocated(device: torch.device) -> int:
    """Bytes torch holds in tensors on ``device`` now (0 on the CPU, which it does not count)."""
    if device.type == "cuda":
        return int(torch.cuda.memory_allocated(device))
    if device.type == "mps":
        return int(torch.mps.current_allocated_memory())
    return 0


def peak_allocated(device: torch.device) -> int:
    """The most bytes torch held on ``device`` since the last ``reset_peak`` (CUDA only)."""
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    return allocated(device)


def reset_peak(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def is_out_of_memory(error: BaseException) -> bool:
    """Whether ``error`` says the device ran out of memory (CUDA's ``OutOfMemoryError``, or the
    RuntimeError MPS and the CPU allocator raise)."""
    if isinstance(error, torch.OutOfMemoryError):
        return True
    text = str(error).lower()
    return isinstance(error, RuntimeError) and (
        "out of memory" in text or "can't allocate memory" in text
    )


def synchronize(device: torch.device) -> None:
    """Wait until the work queued on ``device`` is done (a GPU runs it asynchronously; the CPU
    has nothing to wait for): what a timer around GPU work must call before it reads the clock."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    elif device.type == "mps":
        torch.mps.synchronize()


def release(device: torch.device) -> None:
    """Give the caching allocator's free blocks back, after an out-of-memory error or an
    unload, so that the next request starts from what is really held."""
    if device.type == "cuda":
        torch.cuda.empty_cache()
    elif device.type == "mps":
        torch.mps.empty_cache()


def _cgroup_limit() -> int | None:
    for path in ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"):
        try:
            with open(path) as file:
                raw = file.read().strip()
        except OSError:
            continue
        if raw.isdigit() and int(raw) < 2**60:
            return int(raw)
    return None
