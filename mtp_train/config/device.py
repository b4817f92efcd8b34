"""The one place a configured device name becomes a device (torch is imported only when a function runs)."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

CPU, CUDA = "cpu", "cuda"
DEVICE_KINDS = (CPU, CUDA)


def resolve_device(device: str) -> str:
    """`auto` → cuda when available, else cpu; anything else (cpu, cuda, cuda:N) unchanged."""
    if device != "auto":
        return device
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def device_kind(device: str) -> str:
    """`cpu` or `cuda` (what a process group's backend depends on) from a device name such as `cuda:1`."""
    kind = resolve_device(device).split(":", 1)[0]
    if kind not in DEVICE_KINDS:
        raise ValueError(f"device must be auto|cpu|cuda|cuda:N, got {device!r}")
    return kind


def rank_device(device: str, world: int = 1, local_rank: int = 0) -> torch.device:
    """The device one process computes on: with several ranks on CUDA each takes `cuda:<local_rank>`; a single
    process honours an explicit `cuda:N`."""
    import torch

    name = resolve_device(device)
    if device_kind(name) == "cuda" and world > 1:
        return torch.device("cuda", local_rank)
    return torch.device(name)


def bf16_enabled(device: torch.device) -> bool:
    """bf16 training on CUDA devices that support it; fp32 elsewhere."""
    import torch

    return on_cuda(device) and torch.cuda.is_bf16_supported()


def on_cuda(device: torch.device | str) -> bool:
    """Whether a device (or device name such as `cuda:1`) is a CUDA device: the one test of device kind the
    library uses, so that no module compares device-type strings of its own."""
    kind = device.type if not isinstance(device, str) else device.split(":", 1)[0]
    return kind == CUDA


def on_cpu(device: torch.device | str) -> bool:
    """Whether a device (or device name) is the CPU."""
    kind = device.type if not isinstance(device, str) else device.split(":", 1)[0]
    return kind == CPU
