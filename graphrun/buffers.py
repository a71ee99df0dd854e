"""Static buffers: allocated once at the largest bucket, one contiguous view per bucket.

A CUDA graph replays fixed addresses, so every bucket's inputs and outputs must live in memory
that never moves. Each buffer is one flat allocation sized for the largest value of every axis;
a bucket's tensor is the first prod(shape) elements viewed as that shape. Such a view is
contiguous (unlike buf[:b, :s]), so models may .view() it freely, and all buckets share memory.
The same layout on the host, in pinned memory, is the staging area for the copies.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from .buckets import Bucket

TORCH_DTYPES = {
    "float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16,
    "float64": torch.float64, "int64": torch.int64, "int32": torch.int32, "int16": torch.int16,
    "int8": torch.int8, "uint8": torch.uint8, "bool": torch.bool,
}


def host_dtype(dtype: torch.dtype) -> torch.dtype:
    """numpy has no bfloat16: such data is staged as float32 and cast by the device copy."""
    return torch.float32 if dtype == torch.bfloat16 else dtype


class BufferSet:
    """Named flat tensors with per-bucket views. dims: name -> spec shape (names and ints)."""

    def __init__(self, dims: dict[str, list], dtypes: dict[str, torch.dtype], largest: Bucket,
                 device: torch.device, *, pin: bool = False):
        self.dims = dims
        self.flat = {}
        for name, d in dims.items():
            numel = math.prod(largest.shape(d))
            self.flat[name] = torch.empty(numel, dtype=dtypes[name], device=device,
                                          pin_memory=pin and device.type == "cpu")
        self._views: dict[tuple[str, Bucket], torch.Tensor] = {}
        self._numpy: dict[tuple[str, Bucket], np.ndarray] = {}

    def view(self, name: str, bucket: Bucket) -> torch.Tensor:
        key = (name, bucket)
        if key not in self._views:
            shape = bucket.shape(self.dims[name])
            self._views[key] = self.flat[name][: math.prod(shape)].view(shape)
        return self._views[key]

    def views(self, bucket: Bucket) -> dict[str, torch.Tensor]:
        return {name: self.view(name, bucket) for name in self.dims}

    def numpy_view(self, name: str, bucket: Bucket) -> np.ndarray:
        """The host view as a numpy array sharing memory (host buffers only)."""
        key = (name, bucket)
        if key not in self._numpy:
            self._numpy[key] = self.view(name, bucket).numpy()
        return self._numpy[key]

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.flat.values())


class HostSlot:
    """One set of pinned host staging buffers (inputs and outputs) and, per bucket, the
    (destination, source) pairs of its copies, built once so the hot path only copies."""

    def __init__(self, inputs: BufferSet, outputs: BufferSet):
        self.inputs, self.outputs = inputs, outputs
        self._copies: dict[Bucket, tuple[list, list]] = {}

    def copies(self, bucket: Bucket, device_in: BufferSet, device_out: BufferSet
               ) -> tuple[list, list]:
        if bucket not in self._copies:
            self._copies[bucket] = (
                [(d, self.inputs.view(n, bucket)) for n, d in device_in.views(bucket).items()],
                [(self.outputs.view(n, bucket), s) for n, s in device_out.views(bucket).items()])
        return self._copies[bucket]
