"""run_batch's path: one synchronous call on the caller's stream, the seed's loop with padding.

Copy the real rows into a lane's static input views and pad the rest, replay, copy the real
rows of the static outputs out, wait: no host slots for tensors, no copy streams, no events but
the wait for the result (none at all with device=True, whose outputs are ordered on the
caller's stream).
"""

from __future__ import annotations

import torch

from graphrun.engine.buckets import Bucket, cut_rows
from graphrun.base.errors import InputError
from graphrun.engine.inputs import ApiBatch
from graphrun.engine.lanes import Lane
from graphrun.engine.launch import Launcher, real_rows


class Views:
    """A lane's static views of one bucket, as run_batch copies them, built once."""

    __slots__ = ("inputs", "outputs", "ragged")

    def __init__(self, lane: Lane, bucket: Bucket, out_dims: dict[str, list]):
        self.inputs = lane.inputs.views(bucket)
        self.outputs = lane.outputs.views(bucket)
        # outputs with a per-record axis: cut to the batch's length on it
        self.ragged = {n: [(i, d) for i, d in enumerate(dims) if i and isinstance(d, str)]
                       for n, dims in out_dims.items()}


class Direct:
    """run_batch's two ways, on the launcher's slot 0, lanes and counts."""

    def __init__(self, launcher: Launcher):
        self.launcher = launcher
        self.cuda = launcher.cuda
        self._views: dict[tuple[int, Bucket], Views] = {}

    def views(self, lane: Lane, bucket: Bucket) -> Views:
        v = self._views.get((lane.index, bucket))
        if v is None:
            v = self._views[lane.index, bucket] = Views(lane, bucket, self.launcher.layout.out_dims)
        return v

    def _lane(self, bucket: Bucket) -> Lane:
        lane = self.launcher.pick_lane(bucket)
        if lane.free is not None:  # a launch's copy out of this lane may still be queued
            torch.cuda.current_stream().wait_event(lane.free)
            lane.free = None
        return lane

    def _replay(self, lane: Lane, bucket: Bucket, n: int) -> None:
        entry, state = lane.graphs[bucket], self.launcher.states[bucket]
        entry.run()
        if entry.check_real:
            self.launcher.check_real(lane, state)
        state.count(n)

    def arrays(self, batch: ApiBatch) -> dict:
        """numpy rows: padded into host slot 0 (pinned on a GPU; converted to bfloat16 there
        where the model takes it), copied in, replayed, copied out into the slot, cut into
        fresh arrays."""
        n = batch.n
        bucket = self.launcher.stage(batch.fields, n, batch.lengths, 0)
        slot = self.launcher.slots[0]
        lane = self._lane(bucket)
        copies = slot.copies(bucket, lane)
        for static, host in copies.h2d:
            static.copy_(host, non_blocking=True)
        self._replay(lane, bucket, n)
        copy_and_wait(copies.d2h)
        return {name: cut_rows(real_rows(slot.outputs, name, bucket, n), dims, batch.lengths)
                for name, dims in self.launcher.layout.out_dims.items()}

    def tensors(self, batch: ApiBatch, *, device: bool) -> dict:
        """Dense tensors: copied (and padded) straight into the static views, which hold the
        dtypes the model takes: a tensor in that dtype is copied as it is, another (float32
        for a bfloat16 model) is cast on the copy, one kernel. Outputs in the model's dtype,
        on the device (device=True) or in new host tensors (pinned on a GPU)."""
        n, fields = batch.n, batch.fields
        want = {a: int(v[0]) if len(v) else 1 for a, v in batch.lengths.items()}
        bucket = self.launcher.table.pick(n, want)
        if bucket is None:
            raise InputError(self.launcher.table.uncovered(n, want, self.launcher.layout.in_dims))
        lane = self._lane(bucket)
        views = self.views(lane, bucket)
        for name, static in views.inputs.items():
            t = fields[name]
            # device=True waits for nothing: a host input is copied before the call returns,
            # so the caller may reuse it at once
            async_ok = not device or not t.is_cpu
            if static.shape == t.shape:
                static.copy_(t, non_blocking=async_ok)
            else:
                self._pad(static, t, n, self.launcher.inputs[name].pad, async_ok)
        self._replay(lane, bucket, n)
        outs, last = {}, len(views.outputs) - 1
        for i, (name, static) in enumerate(views.outputs.items()):
            real = self._real(static, n, views.ragged[name], want)
            if device or not self.cuda:  # the CPU is both
                outs[name] = real.clone()
                continue
            host = outs[name] = torch.empty(real.shape, dtype=real.dtype, pin_memory=True)
            host.copy_(real, non_blocking=i < last)  # the last one waits for them all
        return outs

    @staticmethod
    def _pad(static: torch.Tensor, t: torch.Tensor, n: int, pad: float, async_ok: bool) -> None:
        if static.shape[1:] == t.shape[1:]:
            static[:n].copy_(t, non_blocking=async_ok)
            static[n:].fill_(pad)
        else:  # a shorter per-record axis: padded too
            static.fill_(pad)
            static[tuple(slice(0, s) for s in t.shape)].copy_(t, non_blocking=async_ok)

    @staticmethod
    def _real(static: torch.Tensor, n: int, ragged: list, lengths: dict) -> torch.Tensor:
        """The real part of a static output view: n rows, and on each per-record axis the
        batch's length (the same for every record of a dense batch)."""
        if ragged:
            index = [slice(0, n)] + [slice(None)] * (static.dim() - 1)
            for i, axis in ragged:
                index[i] = slice(0, lengths[axis])
            return static[tuple(index)]
        return static if n == static.shape[0] else static[:n]


def copy_and_wait(pairs: list) -> None:
    """Device -> host copies; the last one blocking, so that one wait covers them all."""
    last = len(pairs) - 1
    for i, (dst, src) in enumerate(pairs):
        dst.copy_(src, non_blocking=i < last)
