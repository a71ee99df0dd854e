"""Per-batch phase timings: CUDA events on the GPU (never host clocks alone), host clocks on CPU.

A batch's phases are h2d (pinned host -> the static input views, on the copy-in stream), replay
(the graph or the eager step, on the compute stream) and d2h (the static output views -> pinned
host, on the copy-out stream); e2e is the host wall
time from launch to the outputs being ready on the host. Percentiles are computed per bucket
(manifest/latency.py).

Every event recorded is a CUDA call, and each CUDA call lets another thread take the GIL, which
the launching thread must then wait for: so after a bucket's first TIME_ALL batches only one in
TIME_EVERY is timed per phase (e2e, a host clock, is taken for every batch). Percentiles over
such a sample of thousands of batches are what they would be over all of them.
"""

from __future__ import annotations

import time

import numpy as np
import torch

TIME_ALL, TIME_EVERY = 256, 8


def sampled(k: int, first: int = TIME_ALL, every: int = TIME_EVERY) -> bool:
    """Whether a bucket's k-th batch (from 0) is timed per phase: each of the first `first`,
    then one in `every`."""
    return k < first or k % every == 0


class Marks:
    """One batch's marks: per phase (start, end) (events on the GPU, host clocks on the CPU),
    and the last event recorded, which finish() waits on."""

    __slots__ = ("key", "timed", "t0", "spans", "last")

    def __init__(self, key: object, timed: bool):
        self.key, self.timed = key, timed
        self.t0 = time.perf_counter()
        self.spans: dict[str, tuple] = {}
        self.last = None


class BatchTimer:
    """Marks points of a batch. Events are created once per (key, point) and reused; a launch's
    key is its (host slot, lane), and a slot is only launched again after finish() waited for
    its last event, which every other event of the batch precedes."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self._events: dict[tuple, torch.cuda.Event] = {}

    def start(self, key: object = 0, *, timed: bool = True) -> Marks:
        """timed=False: only the points that later work or finish() waits on are recorded."""
        return Marks(key, timed)

    def record(self, marks: Marks, point: str, stream=None):
        """A point of the batch: on the GPU an event recorded on `stream` (returned, for other
        streams to wait on, and the one finish() waits on until a later point), on the CPU the
        host clock."""
        if not self.cuda:
            return time.perf_counter()
        key = (marks.key, point)
        event = self._events.get(key)
        if event is None:
            event = self._events[key] = torch.cuda.Event(enable_timing=True)
        event.record(stream)
        marks.last = event
        return event

    def finish(self, marks: Marks) -> dict[str, float]:
        """Wait for the batch's last event; microseconds per timed phase, and e2e."""
        if marks.last is not None:
            marks.last.synchronize()
        if self.cuda:
            out = {phase: a.elapsed_time(b) * 1e3 for phase, (a, b) in marks.spans.items()}
        else:
            out = {phase: (b - a) * 1e6 for phase, (a, b) in marks.spans.items()}
        out["e2e"] = (time.perf_counter() - marks.t0) * 1e6
        return out


def median_us(timer: BatchTimer, fn, iters: int) -> float:
    """Median time of fn() over iters calls after one untimed call (report.baseline)."""
    fn()  # caches warm
    times = []
    stream = torch.cuda.current_stream() if timer.cuda else None
    for _ in range(iters):
        marks = timer.start(-1)  # not a launch's events
        t0 = timer.record(marks, "run<", stream)
        fn()
        marks.spans["run"] = (t0, timer.record(marks, "run", stream))
        times.append(timer.finish(marks)["run"])
    return float(np.median(times))
