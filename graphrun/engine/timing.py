"""Per-batch phase timings: CUDA events on the GPU (never host clocks alone), host clocks on CPU.

A batch's phases are h2d (pinned host -> the static input views, on the copy-in stream), replay
(the graph or the eager step, on the compute stream) and d2h (the static output views -> pinned
host, on the copy-out stream); e2e is the host wall
time from launch to the outputs being ready on the host. Percentiles are computed per bucket.

Every event recorded is a CUDA call, and each CUDA call lets another thread take the GIL, which
the launching thread must then wait for: so after a bucket's first TIME_ALL batches only one in
TIME_EVERY is timed per phase (e2e, a host clock, is taken for every batch). Percentiles over
such a sample of thousands of batches are what they would be over all of them.
"""

from __future__ import annotations

import time

import numpy as np
import torch

PHASES = ("h2d", "replay", "d2h")
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


def percentiles(values: list[float], ps: list[float]) -> dict[str, float]:
    if not values:
        return {}
    arr = np.asarray(values, dtype=np.float64)
    return {f"p{p:g}": float(np.percentile(arr, p)) for p in ps}


# The shortest median (us) at which a phase's spread means something, by how it is timed.
# CUDA events time the device's own work: a copy or replay under 20 us is mostly launch
# latency. Host clocks (every phase on the CPU, e2e everywhere) include the scheduler's and
# the GIL's hand-offs (sys.getswitchinterval(), 5 ms by default), which dwarf shorter steps.
EVENT_FLOOR_US, HOST_FLOOR_US = 20.0, 1000.0


def noise_floor_us(phase: str, cuda: bool) -> float | None:
    """The median a phase's timings must reach before their spread is worth a warning; None
    where the phase is not worth one: on the CPU, h2d and d2h copy between two host buffers
    (no device, no bus) and are no cost a user can act on."""
    if phase in ("h2d", "d2h") and not cuda:
        return None
    return EVENT_FLOOR_US if cuda and phase in PHASES else HOST_FLOOR_US


def spread_warning(values: list[float], label: str, min_us: float = 0.0) -> str | None:
    """Timings too spread to trust (p99 more than 3x the median over enough samples), for a
    median of at least min_us (noise_floor_us)."""
    if len(values) < 20:
        return None
    p50, p99 = np.percentile(values, [50, 99])
    if p50 >= min_us and p50 > 0 and p99 > 3 * p50:
        return (f"{label}: p99 latency is {p99 / p50:.1f}x the median; timings are noisy "
                "(another process on the device or host?)")
    return None


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
