"""GPU time for the compute spans of the services that run torch (the trainer and the sampler).

Owns: ``CudaClock``, a ``tinsmith.compute.GpuClock`` over CUDA events, and the GPU memory gauge,
each for the device an engine computes on (its ``services.device.Placement``), or, given no
device, for every CUDA device this process sees. Does not own: the spans, or when a span takes
GPU time (tinsmith/compute.py: when the work's device is a CUDA device).
"""

from __future__ import annotations

import torch

from tinsmith import telemetry
from tinsmith.compute import GpuClock


class CudaClock:
    """GPU milliseconds between two points of a device's current stream (the compute thread's),
    from CUDA events: what the GPU spent, not what the host waited."""

    def __init__(self, device: torch.device | None = None) -> None:
        self.device = device

    def start(self) -> object:
        mark = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
        mark.record(self._stream())
        return mark

    def elapsed_ms(self, mark: object) -> float:
        assert isinstance(mark, torch.cuda.Event)
        end = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
        end.record(self._stream())
        end.synchronize()
        return float(mark.elapsed_time(end))

    def _stream(self) -> torch.cuda.Stream:
        return torch.cuda.current_stream(self.device)


def _cuda(device: torch.device | str | None) -> torch.device | None:
    """``device`` as a CUDA device, or None when it is another kind."""
    if device is None:
        return None
    where = torch.device(device)
    return where if where.type == "cuda" else None


def cuda_clock(device: torch.device | str | None = None) -> GpuClock | None:
    """A CUDA clock for ``device`` when it is a CUDA device, else None; given no device, for the
    current CUDA device where CUDA is available."""
    if device is None:
        return CudaClock() if torch.cuda.is_available() else None
    where = _cuda(device)
    return CudaClock(where) if where is not None else None


def observe_memory(device: torch.device | str | None = None) -> None:
    """A gauge of the GPU memory torch has allocated and reserved (its caching allocator's pool,
    which the vLLM engine's KV cache also lives in) on ``device``, when that is a CUDA or MPS
    device; nothing on the CPU. Given no device, every CUDA device, where CUDA is available."""
    if device is None:
        if not torch.cuda.is_available():
            return
        devices = [torch.device("cuda", i) for i in range(torch.cuda.device_count())]
    else:
        where = torch.device(device)
        if where.type not in ("cuda", "mps"):
            return
        if where.type == "cuda" and where.index is None:
            where = torch.device("cuda", torch.cuda.current_device())
        devices = [where]

    def reading() -> dict[tuple[tuple[str, str], ...], float]:
        values: dict[tuple[tuple[str, str], ...], float] = {}
        for where in devices:
            label = ("tinsmith.device", str(where))
            if where.type == "mps":
                allocated = torch.mps.current_allocated_memory()
                reserved = torch.mps.driver_allocated_memory()
            else:
                allocated = torch.cuda.memory_allocated(where)
                reserved = torch.cuda.memory_reserved(where)
            values[(label, ("state", "allocated"))] = float(allocated)
            values[(label, ("state", "reserved"))] = float(reserved)
        return values

    telemetry.observe(
        "tinsmith.gpu.memory",
        reading,
        unit="By",
        description="GPU memory held by torch in this process, allocated and reserved",
    )
