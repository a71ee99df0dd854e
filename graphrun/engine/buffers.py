"""Static buffers: allocated once at the largest bucket, one contiguous view per bucket.

A CUDA graph replays fixed addresses, so every bucket's inputs and outputs must live in memory
that never moves. Each buffer is one flat allocation sized for the largest value of every axis;
a bucket's tensor is the first prod(shape) elements viewed as that shape. Such a view is
contiguous (unlike buf[:b, :s]), so models may .view() it freely, and all buckets share memory.
The same layout on the host, in pinned memory, is a host slot's staging area (launch.py): in
the same dtypes, so that the copy to the device is a plain one.
"""

from __future__ import annotations

import math
import warnings

import numpy as np
import torch

from graphrun.engine.buckets import Bucket, pad_into



def host_dtype(dtype: torch.dtype) -> torch.dtype:
    """numpy has no bfloat16: such rows are read and handed to numpy as float32."""
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
        self._scratch: dict[tuple, np.ndarray] = {}  # ragged rows of bfloat16 inputs

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

    def pad_rows(self, name: str, bucket: Bucket, rows, pad: float) -> None:
        """Write real rows (dense [n, ...] or n per-record arrays, numpy) into the bucket's view
        and pad the rest, converting to the buffer's dtype on the way (host buffers only).

        numpy writes its own dtypes. bfloat16 is converted by torch from the rows' dtype (the
        spec's: float32 for bfloat16) in the same single pass; ragged rows are padded in their
        own dtype into a scratch first, since per-record torch copies cost more than a pass."""
        view = self.view(name, bucket)
        if view.dtype != torch.bfloat16:
            pad_into(self.numpy_view(name, bucket), rows, pad)
            return
        n = len(rows)
        if isinstance(rows, np.ndarray) and rows.shape[1:] == view.shape[1:]:
            view[:n].copy_(from_numpy(rows))
            if n < len(view):
                view[n:].fill_(pad)
            return
        dtype = rows[0].dtype if n else np.dtype(np.float32)
        flat = self._scratch.get((name, dtype))
        if flat is None:
            flat = self._scratch[name, dtype] = np.empty(self.flat[name].numel(), dtype)
        scratch = flat[: view.numel()].reshape(view.shape)
        pad_into(scratch, rows, pad)
        view.copy_(torch.from_numpy(scratch))

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.flat.values())


def from_numpy(rows: np.ndarray) -> torch.Tensor:
    """A tensor sharing the rows' memory, only read from: a read-only array (a memory-mapped
    file) is shared too, without torch's warning about writing to it."""
    if rows.flags.writeable:
        return torch.from_numpy(rows)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        return torch.from_numpy(rows)
