"""Launch: a staged batch enqueued on a lane; a typed handle whose result() waits and cuts.

A batch of the overlapped stream goes: pad into a host slot's pinned staging views (stage) ->
h2d on the copy-in stream into the lane's static input views -> replay on the compute stream ->
d2h on the copy-out stream into the slot's pinned output views -> Launch.result(), on another
thread, waits for the batch's last event and cuts the real rows out. Nothing waits in launch():
the copy-in stream waits for the lane's `free` event (its previous batch copied out), the
compute stream for the copy-in, the copy-out stream for the replay. With two lanes the compute
stream runs nothing but replays: one lane's copies run beside the other lane's replay.
On the CPU the same steps run one after another, timed with host clocks. run_batch takes a
shorter way, on one stream (direct.py).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch

from graphrun.engine.buckets import Bucket, BucketTable, cut_rows, split_rows
from graphrun.base.errors import InputError
from graphrun.engine.buffers import BufferSet
from graphrun.engine.capture import BucketState
from graphrun.engine.device import made_current
from graphrun.engine.lanes import Lane, Layout
from graphrun.engine.timing import BatchTimer, Marks, sampled

# overlapped: at least one being staged, one on the device, one being written; at most 16: the
# batches queued on the device carry it through the launching thread's waits for the GIL, and
# 16 already keep it busy through the longest such wait
SLOTS = (3, 16)
SLOT_BUDGET = 512 << 20  # bytes of host slots, at most


class SlotCopies:
    """One slot's copies for one bucket on one lane, as (destination, source) pairs built once,
    so the hot path only copies: h2d (pinned host staging -> the lane's static input views) and
    d2h (the lane's static output views -> pinned host)."""

    __slots__ = ("h2d", "d2h")

    def __init__(self, h2d: list, d2h: list):
        self.h2d, self.d2h = h2d, d2h


class HostSlot:
    """One batch in flight: host staging buffers for inputs and outputs (pinned on a GPU), in
    the static buffers' dtypes, so that every copy is a plain one: a floating input the model
    takes in bfloat16 is converted as it is staged (BufferSet.pad_rows), in the pass that pads
    it anyway, which halves its bytes to the device and adds no kernel to the launch."""

    def __init__(self, inputs: BufferSet, outputs: BufferSet):
        self.inputs, self.outputs = inputs, outputs
        self._copies: dict[tuple[Bucket, int], SlotCopies] = {}

    def copies(self, bucket: Bucket, lane: Lane) -> SlotCopies:
        """The copies between this slot and `lane`'s static buffers for `bucket`."""
        key = (bucket, lane.index)
        c = self._copies.get(key)
        if c is None:
            host_in, host_out = self.inputs.views(bucket), self.outputs.views(bucket)
            s_in, s_out = lane.inputs.views(bucket), lane.outputs.views(bucket)
            c = self._copies[key] = SlotCopies([(s_in[n], host_in[n]) for n in s_in],
                                               [(host_out[n], s_out[n]) for n in s_out])
        return c

    @property
    def nbytes(self) -> int:
        return self.inputs.nbytes + self.outputs.nbytes


@dataclass(eq=False, slots=True)
class Launch:
    """A launched batch: its n real rows of `bucket` in host slot `slot`, on `lane`."""

    bucket: Bucket
    slot: int
    lane: int
    n: int
    lengths: dict
    marks: Marks
    launcher: "Launcher"

    def wait(self) -> dict[str, float]:
        """Wait for the batch on the device; its phase times in microseconds."""
        return self.launcher.timer.finish(self.marks)

    def result(self) -> tuple[dict, dict[str, float]]:
        """Wait; the real rows of every output (fresh arrays, cut to each record's length,
        bfloat16 as float32) and the phase times. The slot is free again after it."""
        times = self.wait()
        return self.launcher.cut(self), times


class Launcher:
    """Host slots, copy streams and phase timers; stage() and launch() a batch on a lane. The
    feed's engine (feed/protocols.Engine): what it needs of the runner is given here, once.

    lanes: the runner's list, which grows by second_lane(); states: each bucket's status and
    counts; set_up(state, batch): capture.lazy's setup of a bucket on first use;
    check_real(lane, state): a bucket's first real batch checked against eager;
    second_lane(): the overlapped stream's second lane added, False where none is;
    eager(fields, n, lengths): rows larger than every batch bucket, with data.oversize eager;
    sampled(k): whether a bucket's k-th batch is timed per phase (timing.sampled)."""

    def __init__(self, table: BucketTable, layout: Layout, lanes: list[Lane],
                 states: dict[Bucket, BucketState], *, inputs: dict, device: torch.device,
                 set_up: Callable[[BucketState, int], None],
                 check_real: Callable[[Lane, BucketState], bool],
                 second_lane: Callable[[], bool], eager: Callable[[dict, int, dict], dict],
                 oversize: str, explain: Callable[[BaseException], str | None] = lambda e: None,
                 sampled: Callable[[int], bool] = sampled):
        self.sampled = sampled  # which of a bucket's batches are timed per phase (timing.py)
        self.table, self.layout, self.lanes, self.states = table, layout, lanes, states
        self.explain = explain  # what the model's own error most likely comes from, or None
        self.inputs, self.device, self.cuda = inputs, device, device.type == "cuda"
        self.set_up, self.check_real, self.second_lane = set_up, check_real, second_lane
        self.eager, self.oversize = eager, oversize
        self.timer = BatchTimer(device)  # CUDA events on the GPU, host clocks on the CPU
        # copies run on their own streams, beside the replays on the compute stream
        self.copy_streams = ((torch.cuda.Stream(device), torch.cuda.Stream(device))
                             if self.cuda else None)
        self.slots: list[HostSlot] = []
        self._turn = 0  # batches take the lanes that hold their bucket's graph in turn
        self._lanes_of: dict[Bucket, list[Lane]] = {}  # cleared when a lane is added
        self.add_slots(1)

    # -- the feed's surface (feed/protocols.Engine) --------------------------------------------

    @property
    def max_batch(self) -> int:
        return self.table.max_batch

    @property
    def slot_bytes(self) -> int:
        """Host bytes of one slot."""
        return self.slots[0].nbytes

    def make_room(self, overlap: bool) -> int:
        """Host slots for the feed's batches in flight, made now: overlapped, as many as
        SLOT_BUDGET holds (slot_count); serial, one. Returns how many there are."""
        return self.host_slots(slot_count(self.slot_bytes) if overlap else 1)

    def host_slots(self, count: int) -> int:
        """At least `count` host slots (pinned staging, one per batch in flight); returns how
        many. With two or more the captured buckets get a second lane."""
        self.add_slots(count)
        if count >= 2 and len(self.lanes) == 1 and self.second_lane():
            self.lanes_changed()
        return len(self.slots)

    def current_stream(self):
        """The stream launches go to from this thread (None on the CPU)."""
        if not self.cuda:
            return None
        with self.device_context():
            return torch.cuda.current_stream()

    def device_context(self):
        """The device made current for a stream of launches (a no-op on the CPU)."""
        return made_current(self.device)

    def lanes_changed(self) -> None:
        self._lanes_of.clear()

    def add_slots(self, count: int) -> None:
        lay, largest, cpu = self.layout, self.table.all[0], torch.device("cpu")
        while len(self.slots) < count:
            self.slots.append(HostSlot(
                BufferSet(lay.in_dims, lay.in_dtypes, largest, cpu, pin=self.cuda),
                BufferSet(lay.out_dims, lay.out_dtypes, largest, cpu, pin=self.cuda)))

    def stage(self, fields: dict, n: int, lengths: dict[str, np.ndarray], slot: int,
              ids=None, indices=None) -> Bucket:
        """Pick the bucket for n real rows and pad them into host slot `slot`'s staging views
        (one forward pass: ids and indices play no part)."""
        want = {a: int(v.max()) if len(v) else 1 for a, v in lengths.items()}
        bucket = self.table.pick(n, want)
        if bucket is None:
            raise InputError(self.table.uncovered(n, want, self.layout.in_dims))
        staging = self.slots[slot].inputs
        for name, rows in fields.items():
            staging.pad_rows(name, bucket, rows, self.inputs[name].pad)
        return bucket

    def pick_lane(self, bucket: Bucket) -> Lane:
        lanes = self._lanes_of.get(bucket)
        if lanes is None:
            state = self.states[bucket]
            if state.status == "unused":  # capture.lazy: the first batch that needs it
                self.set_up(state, self._turn)
            lanes = self._lanes_of[bucket] = [lane for lane in self.lanes
                                              if bucket in lane.graphs]
        lane = lanes[self._turn % len(lanes)]
        self._turn += 1
        return lane

    def launch(self, bucket: Bucket, slot: int, n: int, lengths: dict, *,
               timed: bool | None = None, stream=None) -> Launch:
        """Enqueue a staged batch; nothing waits here. The slot must be free (its last batch's
        result taken). stream: the compute stream, this thread's current one with the device
        current (device_context), None for it to be looked up; timed: per-phase events, None
        for a sample of the bucket's batches (timing.sampled)."""
        if self.cuda and stream is None:
            with self.device_context():
                return self.launch(bucket, slot, n, lengths, timed=timed,
                                   stream=torch.cuda.current_stream())
        state = self.states[bucket]
        lane = self.pick_lane(bucket)
        entry = lane.graphs[bucket]
        copies = self.slots[slot].copies(bucket, lane)
        if timed is None:
            timed = self.sampled(state.launches)
            state.launches += 1
        # events are reused per (slot, lane): a lane's free event is re-recorded only by its
        # next batch, after that batch waited on it
        marks = self.timer.start((slot, lane.index), timed=timed)
        if self.cuda:
            self._enqueue(lane, entry, state, copies, marks, timed, stream)
        else:
            self._run_here(lane, entry, state, copies, marks, timed)
        return Launch(bucket, slot, lane.index, n, lengths, marks, self)

    def check_ahead(self, first: dict) -> None:
        """Each captured bucket's first real batch, read ahead (bucket -> a record batch that
        runs in it whole), replayed on slot 0 and checked against eager before the stream:
        the check's sync and eager call then stall setup, not the device's queue of batches.
        The outputs are dropped and nothing is counted: the stream runs the batch again."""
        for bucket, rb in first.items():
            entry = self.lanes[0].graphs.get(bucket)
            if rb is None or entry is None or not entry.check_real:
                continue
            n, turn = len(rb.ids), self._turn
            if self.stage(rb.fields, n, rb.lengths, 0) == bucket:
                self.launch(bucket, 0, n, rb.lengths, timed=False).wait()
            self._turn = turn  # not one of the run's batches, which first use names by number

    def run_padded(self, fields: dict, n: int, lengths: dict[str, np.ndarray], *,
                   timed: bool = True):
        """Real rows (n of them) through the right bucket on slot 0, waited for:
        (outputs, bucket, timings)."""
        bucket = self.stage(fields, n, lengths, 0)
        outs, times = self.launch(bucket, 0, n, lengths, timed=timed).result()
        return outs, bucket, times

    def run_rows(self, fields: dict, n: int, lengths: dict[str, np.ndarray], ids=None,
                 indices=None):
        """n real rows, any n: through one bucket, or per data.oversize when n is larger than
        every batch bucket. Returns (outputs, [(bucket or None, phase times)])."""
        largest = self.table.max_batch
        if n <= largest:
            outs, bucket, times = self.run_padded(fields, n, lengths)
            return outs, [(bucket, times)]
        if self.oversize == "error":
            raise InputError(f"a batch of {n} records is larger than the largest batch bucket "
                             f"({largest}): add a bucket or set data.oversize: split")
        if self.oversize == "eager":
            t0 = time.perf_counter()
            outs = self.eager(fields, n, lengths)
            return outs, [(None, {"e2e": (time.perf_counter() - t0) * 1e6})]
        parts, ran = [], []
        for sl in split_rows(n, largest):
            outs, bucket, times = self.run_padded({k: v[sl] for k, v in fields.items()},
                                                  sl.stop - sl.start,
                                                  {a: v[sl] for a, v in lengths.items()})
            parts.append(outs)
            ran.append((bucket, times))
        return {name: concat_rows([p[name] for p in parts]) for name in self.layout.out_dims}, ran

    def _run_here(self, lane, entry, state, copies, marks, timed) -> None:
        """The CPU: the same steps one after another, host clocks."""
        record = self.timer.record
        t0 = record(marks, "start")
        for dst, src in copies.h2d:
            dst.copy_(src)
        t1 = record(marks, "h2d")
        entry.run()
        t2 = after = record(marks, "replay")
        if entry.check_real:  # the check's time is not the replay's
            self.check_real(lane, state)
            after = record(marks, "checked")
        for dst, src in copies.d2h:
            dst.copy_(src)
        if timed:
            marks.spans = {"h2d": (t0, t1), "replay": (t1, t2),
                           "d2h": (after, record(marks, "d2h"))}

    def _enqueue(self, lane, entry, state, copies, marks, timed, stream) -> None:
        """The GPU: as few CUDA calls as the copies need; each one lets another thread take
        the GIL, which this one must then wait for."""
        record, set_stream = self.timer.record, torch.cuda.set_stream
        copy_in, copy_out = self.copy_streams
        try:
            set_stream(copy_in)
            if lane.free is not None:
                copy_in.wait_event(lane.free)
            h0 = record(marks, "h2d<", copy_in) if timed else None
            for dst, src in copies.h2d:
                dst.copy_(src, non_blocking=True)
            h1 = record(marks, "h2d", copy_in)
            set_stream(stream)
            stream.wait_event(h1)
            r0 = record(marks, "replay<", stream) if timed else None
            entry.run()
            r1 = after = record(marks, "replay", stream)
            if entry.check_real:
                # the lane's first real batch, checked against eager: the static outputs then
                # hold eager's, copied out after the check (its time is not the replay's)
                self.check_real(lane, state)
                after = record(marks, "checked", stream)
            set_stream(copy_out)
            copy_out.wait_event(after)
            for dst, src in copies.d2h:
                dst.copy_(src, non_blocking=True)
            d1 = lane.free = record(marks, "d2h", copy_out)
        finally:
            set_stream(stream)
        if timed:
            marks.spans = {"h2d": (h0, h1), "replay": (r0, r1), "d2h": (after, d1)}

    def cut(self, launch: Launch) -> dict:
        """The real rows of a finished launch, as fresh numpy arrays; counts it."""
        host, n, bucket = self.slots[launch.slot].outputs, launch.n, launch.bucket
        outs = {name: cut_rows(real_rows(host, name, bucket, n), dims, launch.lengths)
                for name, dims in self.layout.out_dims.items()}
        self.states[bucket].count(n, launch.lengths)
        return outs


def real_rows(host: BufferSet, name: str, bucket: Bucket, n: int) -> np.ndarray:
    """The first n rows of a host output view as a new numpy array (bfloat16 -> float32)."""
    view = host.view(name, bucket)
    if view.dtype == torch.bfloat16:
        return view[:n].float().numpy()
    return host.numpy_view(name, bucket)[:n].copy()


def concat_rows(parts: list) -> np.ndarray | list:
    """One output's rows of several parts, in order: arrays joined, per-record lists chained."""
    if isinstance(parts[0], np.ndarray):
        return np.concatenate(parts)
    return [row for p in parts for row in p]


def fresh_rows(host: torch.Tensor, n: int) -> np.ndarray:
    """The first n rows of a host tensor as a new numpy array (bfloat16 -> float32)."""
    rows = host[:n]
    return rows.float().numpy() if rows.dtype == torch.bfloat16 else rows.numpy().copy()


def slot_count(slot_bytes: int) -> int:
    """Slots for an overlapped stream: as many as SLOT_BUDGET holds, within SLOTS. More slots
    absorb a thread's stall (a page fault, the GIL, a shard's commit) without the device
    waiting; beyond that they only hold memory."""
    low, high = SLOTS
    return max(low, min(high, SLOT_BUDGET // max(slot_bytes, 1)))
