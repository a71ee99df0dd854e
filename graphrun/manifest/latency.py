"""A run's latencies summed up for its manifest: percentiles, and whether their spread is worth a
warning. Numbers only (no torch): a job's parent merging its workers' manifests uses them too."""

from __future__ import annotations

import numpy as np

# a batch's phases timed on the device's streams (engine/timing.py)
DEVICE_PHASES = ("h2d", "replay", "d2h")


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
    return EVENT_FLOOR_US if cuda and phase in DEVICE_PHASES else HOST_FLOOR_US


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
