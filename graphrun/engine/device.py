"""Which device and which backend a spec gets: auto picks CUDA where there is one."""

from __future__ import annotations

from contextlib import nullcontext

import torch

from graphrun.base.errors import GraphrunError


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise GraphrunError(f"device {name!r} asked for, but this machine has no CUDA "
                                "(torch.cuda.is_available() is False): set device: auto or cpu")
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise GraphrunError(f"device {name!r} does not exist: this machine has "
                                f"{torch.cuda.device_count()} CUDA device(s)")
        if device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
    return device


def resolve_backend(name: str, device: torch.device) -> str:
    if name == "auto":
        return "cuda-graph" if device.type == "cuda" else "eager"
    if name == "cuda-graph" and device.type != "cuda":
        raise GraphrunError(f"capture.backend: cuda-graph needs a CUDA device, but the device is "
                            f"{device}: set capture.backend: auto or eager")
    return name


def made_current(device: torch.device):
    """A context making `device` current, only where another device is (a multi-GPU process);
    a no-op on the CPU."""
    if device.type == "cuda" and torch.cuda.current_device() != device.index:
        return torch.cuda.device(device)
    return nullcontext()
