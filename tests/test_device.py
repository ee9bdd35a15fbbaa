"""Where the engines compute: the device and precision the environment asks for, refused at start
when this machine cannot give them, never replaced by the CPU silently."""

from __future__ import annotations

import pytest
import torch

from services import device
from services.device import DeviceError, placement_from_env


def test_auto_is_the_cpu_in_float32_on_a_machine_without_an_accelerator() -> None:
    if torch.cuda.is_available() or torch.backends.mps.is_available():
        pytest.skip("this machine has an accelerator")
    placement = placement_from_env({})
    assert (placement.device, placement.dtype) == (torch.device("cpu"), torch.float32)
    assert placement.memory_bytes == device.total_memory(placement.device) > 0
    assert placement.describe().startswith("cpu (cpu, ")


@pytest.mark.parametrize("name", ["cuda", "cuda:0", "cuda:7"])
def test_a_cuda_device_this_machine_lacks_is_refused_not_replaced(name: str) -> None:
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    with pytest.raises(DeviceError, match=r"sees no CUDA device.*TINSMITH_DEVICE=cpu"):
        placement_from_env({"TINSMITH_DEVICE": name})


def test_mps_this_machine_lacks_is_refused() -> None:
    if torch.backends.mps.is_available():
        pytest.skip("this machine has MPS")
    with pytest.raises(DeviceError, match="no MPS device"):
        placement_from_env({"TINSMITH_DEVICE": "mps"})


@pytest.mark.parametrize("name", ["gpu", "cuda:x", "tpu", "cpu:0 ", "cuda:1234"])
def test_a_device_name_that_is_not_one_is_refused_with_the_accepted_names(name: str) -> None:
    with pytest.raises(DeviceError, match="auto, cuda, cuda:N, mps or cpu"):
        placement_from_env({"TINSMITH_DEVICE": name})


def test_the_dtype_is_the_devices_default_or_the_one_asked_for() -> None:
    cpu = torch.device("cpu")
    assert device.resolve_dtype("", cpu) is torch.float32
    assert device.resolve_dtype("", torch.device("cuda", 0)) is torch.bfloat16
    assert device.resolve_dtype("", torch.device("mps")) is torch.bfloat16
    assert device.resolve_dtype("Float16", cpu) is torch.float16
    with pytest.raises(DeviceError, match="bfloat16, float16, float32"):
        device.resolve_dtype("fp8", cpu)


def test_the_memory_budget_is_the_devices_or_the_one_set() -> None:
    placement = placement_from_env({"TINSMITH_DEVICE": "cpu", "TINSMITH_DEVICE_MEMORY_MB": "64"})
    assert placement.memory_bytes == 64 << 20
    assert placement.describe().endswith("a budget of 64 MiB")
    for bad in ("0", "-1", "lots", "1.5"):
        with pytest.raises(DeviceError, match="TINSMITH_DEVICE_MEMORY_MB"):
            placement_from_env({"TINSMITH_DEVICE_MEMORY_MB": bad})


def test_out_of_memory_errors_are_told_from_others() -> None:
    assert device.is_out_of_memory(torch.OutOfMemoryError("CUDA out of memory. Tried to..."))
    assert device.is_out_of_memory(RuntimeError("MPS backend out of memory (MPS allocated..."))
    assert device.is_out_of_memory(RuntimeError("DefaultCPUAllocator: can't allocate memory"))
    assert not device.is_out_of_memory(RuntimeError("shape mismatch"))
    assert not device.is_out_of_memory(ValueError("out of memory"))


def test_a_share_of_the_devices_memory_is_the_budget_when_no_size_is_set() -> None:
    cpu = torch.device("cpu")
    half = placement_from_env({"TINSMITH_DEVICE": "cpu", "TINSMITH_DEVICE_MEMORY_SHARE": "0.45"})
    assert half.memory_bytes == int(device.total_memory(cpu) * 0.45)
    sized = placement_from_env(
        {"TINSMITH_DEVICE_MEMORY_SHARE": "0.45", "TINSMITH_DEVICE_MEMORY_MB": "64"}
    )
    assert sized.memory_bytes == 64 << 20  # a size set wins over a share
    for bad in ("0", "1.5", "half", "-0.2"):
        with pytest.raises(DeviceError, match="TINSMITH_DEVICE_MEMORY_SHARE"):
            placement_from_env({"TINSMITH_DEVICE_MEMORY_SHARE": bad})
