"""Per-batch phase timings: CUDA events on the GPU (never host clocks alone), host clocks on CPU.

A batch's phases are h2d (host staging -> static device views), replay (the graph, or the eager
step), d2h (static outputs -> pinned host views); e2e is the host wall time from start to the
outputs being ready on the host. Percentiles are computed over all batches of a bucket.
"""

from __future__ import annotations

import time

import numpy as np
import torch

PHASES = ("h2d", "replay", "d2h")


class BatchTimer:
    """Marks phases of a batch. Events are created once per (slot, mark) and reused: a slot is
    only timed again after finish() waited for its last event."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self._events: dict[tuple[int, int], torch.cuda.Event] = {}

    def start(self, slot: int = 0, *, timed: bool = True, stream=None) -> list:
        """marks: [slot, stream, (phase, host time, event)...]. Every event is recorded on
        `stream`, by default the current one, looked up once per batch (that costs
        microseconds: a stream of batches passes it in).
        timed=False: no start mark; only the batch's last mark, to wait on, will follow."""
        if stream is None and self.cuda:
            stream = torch.cuda.current_stream()
        marks: list = [slot, stream]
        if timed:
            self._mark(marks, "start")
        return marks

    def mark(self, marks: list, phase: str) -> None:
        self._mark(marks, phase)

    def _mark(self, marks: list, phase: str) -> None:
        event = None
        if self.cuda:
            key = (marks[0], len(marks))
            event = self._events.get(key)
            if event is None:
                event = self._events[key] = torch.cuda.Event(enable_timing=True)
            event.record(marks[1])
        marks.append((phase, time.perf_counter(), event))

    def finish(self, marks: list) -> dict[str, float]:
        """Wait for the batch's last copy and return microseconds per phase, plus e2e."""
        if self.cuda:
            marks[-1][2].synchronize()
        if len(marks) < 4:  # untimed: only the last mark, to wait on
            return {}
        out = {}
        for (_, t0, e0), (phase, t1, e1) in zip(marks[2:], marks[3:]):
            out[phase] = e0.elapsed_time(e1) * 1e3 if self.cuda else (t1 - t0) * 1e6
        out["e2e"] = (time.perf_counter() - marks[2][1]) * 1e6
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
