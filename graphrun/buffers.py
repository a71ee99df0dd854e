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


SPLIT_BYTES = 512 << 10  # copies at least this big (a bucket's, one way) get their own stream


class SlotCopies:
    """One slot's copies for one bucket, as (destination, source) pairs built once, so the hot
    path only copies.

    On the GPU each direction is either split or direct. Split, a bucket's copies of at least
    SPLIT_BYTES go through the slot's device buffers on their own stream: h2d (pinned host ->
    slot, copy-in stream) then to_static (slot -> static views, compute stream,
    device-to-device), and from_static (static -> slot, compute stream) then d2h (slot ->
    pinned host, copy-out stream), so they overlap the replays of the batches before and after.
    That costs three more CUDA calls a launch (a copy, an event, a wait), each of which lets
    another thread take the GIL, and a device-to-device copy: worth it for a 1 MB copy (about
    25 us on the device), not for a few kilobytes of token ids. Direct, h2d and d2h copy
    between pinned host and the static views on the compute stream (to_static and from_static
    empty). On the CPU every copy is direct."""

    __slots__ = ("h2d", "to_static", "from_static", "d2h")

    def __init__(self, h2d: list, to_static: list, from_static: list, d2h: list):
        self.h2d, self.to_static, self.from_static, self.d2h = h2d, to_static, from_static, d2h


def _nbytes(views: dict[str, torch.Tensor]) -> int:
    return sum(v.numel() * v.element_size() for v in views.values())


class HostSlot:
    """One batch in flight: pinned host staging buffers (inputs and outputs) and, on the GPU,
    device buffers of the same layout for the directions that may be split (SlotCopies).
    Outputs are in the host's dtype, as the static outputs are (a bfloat16 output is float32
    there: the captured step casts it), so every copy is a plain one."""

    def __init__(self, inputs: BufferSet, outputs: BufferSet,
                 device: tuple[BufferSet | None, BufferSet | None] | None = None):
        self.inputs, self.outputs = inputs, outputs
        self.device = device or (None, None)
        self._copies: dict[Bucket, SlotCopies] = {}

    def copies(self, bucket: Bucket, static_in: BufferSet, static_out: BufferSet) -> SlotCopies:
        c = self._copies.get(bucket)
        if c is None:
            host_in, host_out = self.inputs.views(bucket), self.outputs.views(bucket)
            s_in, s_out = static_in.views(bucket), static_out.views(bucket)
            dev_in, dev_out = self.device
            if dev_in is not None and _nbytes(host_in) >= SPLIT_BYTES:
                d_in = dev_in.views(bucket)
                h2d = [(d_in[n], host_in[n]) for n in s_in]
                to_static = [(s_in[n], d_in[n]) for n in s_in]
            else:
                h2d, to_static = [(s_in[n], host_in[n]) for n in s_in], []
            if dev_out is not None and _nbytes(host_out) >= SPLIT_BYTES:
                d_out = dev_out.views(bucket)
                from_static = [(d_out[n], s_out[n]) for n in s_out]
                d2h = [(host_out[n], d_out[n]) for n in s_out]
            else:
                from_static, d2h = [], [(host_out[n], s_out[n]) for n in s_out]
            c = self._copies[bucket] = SlotCopies(h2d, to_static, from_static, d2h)
        return c


def may_split(host: BufferSet) -> bool:
    """Whether some bucket's copies of these buffers (sized for the largest) may be split."""
    return host.nbytes >= SPLIT_BYTES
