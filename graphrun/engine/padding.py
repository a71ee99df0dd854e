"""Padding counted per bucket axis: besides padded rows, the padded positions of each other
axis (token slots for seq), as the manifest and the summary report them."""

from __future__ import annotations

import numpy as np


def add_padded_positions(stats: dict, bucket, lengths: dict, n: int) -> None:
    """stats["padded_positions"][axis] += the bucket's slots on `axis` (rows x size) that hold
    no real value: the real rows' padding and every slot of the padded rows."""
    sizes = dict(zip(bucket.axes, bucket.sizes))
    counts = stats.setdefault("padded_positions", {})
    for axis, lens in lengths.items():
        if axis in sizes:
            real = int(np.asarray(lens[:n], dtype=np.int64).sum())
            counts[axis] = counts.get(axis, 0) + bucket.batch * sizes[axis] - real


def padding_ratio(buckets: list) -> float:
    """Padded rows over all rows run (bucket reports' counts)."""
    run = sum(b.records + b.padded_rows for b in buckets)
    return sum(b.padded_rows for b in buckets) / run if run else 0.0


def position_ratios(buckets: list) -> dict[str, float]:
    """Per axis: padded positions over all positions run (bucket reports' counts)."""
    padded: dict[str, int] = {}
    run: dict[str, int] = {}
    for b in buckets:
        rows = b.records + b.padded_rows
        for axis, count in b.padded_positions.items():
            padded[axis] = padded.get(axis, 0) + count
            run[axis] = run.get(axis, 0) + rows * b.sizes[axis]
    return {a: padded[a] / run[a] if run[a] else 0.0 for a in padded}
