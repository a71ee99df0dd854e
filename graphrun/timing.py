"""Per-batch phase timings: CUDA events on the GPU (never host clocks alone), host clocks on CPU.

A batch's phases are h2d (pinned host slot -> the slot's device buffers, on the copy-in
stream), replay (the step on the compute stream: slot -> static inputs, the graph or eager step,
static outputs -> slot) and d2h (the slot's device outputs -> pinned host, on the copy-out
stream); e2e is the host wall time from launch to the outputs being ready on the host. On the
GPU the three run on different streams, so one batch's copies overlap its neighbours' replays.
Percentiles are computed over all batches of a bucket.
"""

from __future__ import annotations

import time

import numpy as np
import torch

PHASES = ("h2d", "replay", "d2h")


class Marks:
    """One batch's marks: per phase [start, end] (events on the GPU, host clocks on the CPU),
    and the last event recorded, which finish() waits on."""

    __slots__ = ("slot", "timed", "t0", "spans", "last")

    def __init__(self, slot: int, timed: bool):
        self.slot, self.timed = slot, timed
        self.t0 = time.perf_counter()
        self.spans: dict[str, list] = {}
        self.last = None


class BatchTimer:
    """Marks phases of a batch. Events are created once per (slot, mark) and reused: a slot is
    only launched again after finish() waited for its last event, which every other event of
    the batch precedes."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self._events: dict[tuple, torch.cuda.Event] = {}

    def start(self, slot: int = 0, *, timed: bool = True) -> Marks:
        """timed=False: only the events that later work or finish() wait on are recorded."""
        return Marks(slot, timed)

    def _event(self, key: tuple) -> "torch.cuda.Event":
        event = self._events.get(key)
        if event is None:
            event = self._events[key] = torch.cuda.Event(enable_timing=True)
        return event

    def begin(self, marks: Marks, phase: str, stream=None) -> None:
        """A phase starts: on the GPU where `stream` reaches this point."""
        if not marks.timed:
            return
        if self.cuda:
            event = self._event((marks.slot, phase, 0))
            event.record(stream)
            marks.spans[phase] = [event, None]
        else:
            marks.spans[phase] = [time.perf_counter(), None]

    def end(self, marks: Marks, phase: str, stream=None):
        """A phase ends; on the GPU returns its event, which other streams may wait on. Recorded
        even untimed (it may be waited on), but then not timed."""
        if not self.cuda:
            if marks.timed:
                marks.spans[phase][1] = time.perf_counter()
            return None
        event = marks.last = self._event((marks.slot, phase, 1))
        event.record(stream)
        if marks.timed:
            marks.spans[phase][1] = event
        return event

    def point(self, marks: Marks, name: str, stream=None):
        """An event in no phase, for other streams (or finish) to wait on (None on the CPU)."""
        if not self.cuda:
            return None
        event = marks.last = self._event((marks.slot, name, 1))
        event.record(stream)
        return event

    def finish(self, marks: Marks) -> dict[str, float]:
        """Wait for the batch's last event and return microseconds per phase, plus e2e."""
        if marks.last is not None:
            marks.last.synchronize()
        if not marks.timed:
            return {}
        if self.cuda:
            out = {phase: e0.elapsed_time(e1) * 1e3 for phase, (e0, e1) in marks.spans.items()}
        else:
            out = {phase: (t1 - t0) * 1e6 for phase, (t0, t1) in marks.spans.items()}
        out["e2e"] = (time.perf_counter() - marks.t0) * 1e6
        return out


def percentiles(values: list[float], ps: list[float]) -> dict[str, float]:
    if not values:
        return {}
    arr = np.asarray(values, dtype=np.float64)
    return {f"p{p:g}": float(np.percentile(arr, p)) for p in ps}


def spread_warning(values: list[float], label: str) -> str | None:
    """Timings too spread to trust (p99 more than 3x the median over enough samples)."""
    if len(values) < 20:
        return None
    p50, p99 = np.percentile(values, [50, 99])
    if p50 > 0 and p99 > 3 * p50:
        return (f"{label}: p99 latency is {p99 / p50:.1f}x the median; timings are noisy "
                "(another process on the device or host?)")
    return None
