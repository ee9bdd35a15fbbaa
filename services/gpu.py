"""GPU time for the compute spans of the services that run torch (the trainer and the sampler).

Owns: ``CudaClock``, a ``tinsmith.compute.GpuClock`` over CUDA events, and the GPU memory gauge.
Does not own: the spans, or when a span takes GPU time (tinsmith/compute.py: when the work's
device is a CUDA device).
"""

from __future__ import annotations

import torch

from tinsmith import telemetry
from tinsmith.compute import GpuClock


class CudaClock:
    """GPU milliseconds between two points of the compute thread's stream, from CUDA events:
    what the GPU spent, not what the host waited."""

    def start(self) -> object:
        mark = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
        mark.record()
        return mark

    def elapsed_ms(self, mark: object) -> float:
        assert isinstance(mark, torch.cuda.Event)
        end = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
        end.record()
        end.synchronize()
        return float(mark.elapsed_time(end))


def cuda_clock() -> GpuClock | None:
    """A CUDA clock where CUDA is available, else None."""
    return CudaClock() if torch.cuda.is_available() else None


def observe_memory() -> None:
    """Where CUDA is available, a gauge of the GPU memory torch has allocated and reserved (its
    caching allocator's pool, which the vLLM engine's KV cache also lives in), per device."""
    if not torch.cuda.is_available():
        return

    def reading() -> dict[tuple[tuple[str, str], ...], float]:
        values: dict[tuple[tuple[str, str], ...], float] = {}
        for index in range(torch.cuda.device_count()):
            device = ("tinsmith.device", f"cuda:{index}")
            values[(device, ("state", "allocated"))] = float(torch.cuda.memory_allocated(index))
            values[(device, ("state", "reserved"))] = float(torch.cuda.memory_reserved(index))
        return values

    telemetry.observe(
        "tinsmith.gpu.memory",
        reading,
        unit="By",
        description="GPU memory held by torch in this process, allocated and reserved",
    )
