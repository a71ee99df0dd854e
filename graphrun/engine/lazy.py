"""capture.lazy: which buckets the input's batches select, known cheaply before the stream.

Two sources: the planner's histogram of batch shapes when `buckets: auto` ran (plan/auto.py),
and the first batches the reader already holds (stream.ReadAhead). A bucket neither shows is
set up when a batch first selects it (Capturer.first_use), or never.
"""

from __future__ import annotations

from typing import Callable, Iterable

import numpy as np

from graphrun.engine.buckets import Bucket, BucketTable, split_sizes
from graphrun.base.errors import CaptureError, GraphrunError, ModelError

LOOK_AHEAD = 4  # batches the reader reads ahead, beside the model's build, to decide from


def look_ahead(spec) -> int:
    """Batches the reader reads before the stream: with capture.lazy LOOK_AHEAD, or with
    data.group_by_length all of the first window's (they come out together, once the window is
    read and sorted by length, shortest first: its first batches alone would leave the longer
    buckets to be set up mid-stream); 1 without (the first batch, read beside setup)."""
    if not spec.capture.lazy:
        return 1
    window = spec.data.group_by_length
    # a window's batches: its records' (the last may be short), and one that may hold rejects
    return max(LOOK_AHEAD, -(-window // spec.data.batch_size) + 1) if window else LOOK_AHEAD


def selected(table: BucketTable, n: int, want: dict[str, int], split: bool) -> set[Bucket]:
    """The buckets a batch of n records, each axis's longest record `want`, runs in: itself,
    or parts of the largest batch bucket (data.oversize: split); none when it runs whole."""
    if n == 0 or (n > table.max_batch and not split):
        return set()
    picked = (table.pick(size, want) for size in set(split_sizes(n, table.max_batch)))
    return {b for b in picked if b is not None}


def batch_needs(table: BucketTable, batches: Iterable, split: bool) -> dict[Bucket, object]:
    """Buckets the record batches select (the lengths of a split batch's longest record
    stand for each part's: at most one bucket too many), each with the first batch that runs
    in it whole (None where only a split batch's part does): the bucket's first real batch,
    which setup checks against eager (Launcher.check_ahead)."""
    found: dict[Bucket, object] = {}
    for rb in batches:
        want = {a: int(v.max()) if len(v) else 1 for a, v in rb.lengths.items()}
        whole = len(rb.ids) <= table.max_batch
        for b in selected(table, len(rb.ids), want, split):
            if found.get(b) is None:
                found[b] = rb if whole else None
    return found


def shape_needs(table: BucketTable, shapes: np.ndarray, split: bool) -> set[Bucket]:
    """Buckets the planner's batch shapes select; a row is (records, longest per other axis)."""
    found: set[Bucket] = set()
    for row in np.asarray(shapes).tolist():
        found |= selected(table, int(row[0]), dict(zip(table.axes[1:], row[1:])), split)
    return found


def data_needs(spec, reader, plan=None) -> Callable[[BucketTable], dict[Bucket, object]]:
    """Runner's `needs`: the buckets of the reader's read-ahead batches, each with its first
    batch there, and, when buckets: auto ran, those of the planner's histogram (plan: the
    manifest's BucketPlan), with no batch."""
    split = spec.data.oversize == "split"

    def needs(table: BucketTable) -> dict[Bucket, object]:
        batches, _ = reader.peek()
        found = batch_needs(table, batches, split)
        shapes = getattr(plan, "shapes", None)
        if shapes is not None:
            for b in shape_needs(table, shapes, split):
                found.setdefault(b, None)
        return found

    return needs


def first_use_failed(err: GraphrunError, bucket: str, batch: int) -> GraphrunError:
    """A bucket's setup on first use failed (capture, verification, the model at that size):
    the same error, naming the batch that needed the bucket and what was kept."""
    where = f"its setup on first use, for batch {batch} of this run (capture.lazy), failed"
    kept = ("the run's batches before it are committed: after a fix, graphrun run --resume "
            "(with --accept-model-change where the model's files changed) continues from this "
            "batch; capture.lazy: false checks every bucket before the first batch")
    if isinstance(err, CaptureError):
        return CaptureError(f"{where}: {err.message}\n  {kept}", bucket=err.bucket or bucket,
                            remedies=err.remedies)
    if isinstance(err, ModelError):
        return ModelError(f"bucket {bucket}: {where}: {err}\n  {kept}")
    return err
