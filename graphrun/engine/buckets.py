"""Shape buckets: one graph per combination of the axes' values; picking and padding to one.

A bucket is a tuple of sizes in axis order (batch first), e.g. (8,) or (8, 64). A batch of
records goes to the smallest active bucket (by volume) that covers it on every axis; the
answer is kept per question, as the hot path asks the same few.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import numpy as np

from graphrun.base.errors import Problem, SpecError
from graphrun.spec.keys import BATCH, PipelineSpec


@dataclass(frozen=True, order=True)
class Bucket:
    sizes: tuple[int, ...]  # in axis order, batch first
    axes: tuple[str, ...]

    def __post_init__(self) -> None:
        # Buckets key the per-batch lookups (states, views, copies): hash once, not per lookup.
        object.__setattr__(self, "_hash", hash((self.sizes, self.axes)))

    def __hash__(self) -> int:
        return self._hash

    @property
    def batch(self) -> int:
        return self.sizes[0]

    def size(self, axis: str) -> int:
        return self.sizes[self.axes.index(axis)]

    def shape(self, dims: list) -> tuple[int, ...]:
        """Concrete shape of a buffer whose spec shape is `dims` (names and ints)."""
        return tuple(self.size(d) if isinstance(d, str) else d for d in dims)

    @property
    def name(self) -> str:
        return ",".join(f"{a}={s}" for a, s in zip(self.axes, self.sizes))

    @property
    def volume(self) -> int:
        return int(np.prod(self.sizes))


class BucketTable:
    """The buckets still in use (a memory budget or a failed capture can drop some)."""

    def __init__(self, spec: PipelineSpec):
        if spec.auto_axes:  # graphrun.run plans them; a Runner built directly cannot guess
            raise SpecError([Problem(str(spec.source_path or "spec"), "buckets", (
                f"{', '.join(spec.auto_axes)}: auto must be planned before a Runner is built: "
                "spec = graphrun.plan.auto.resolve_auto(spec)[0], or give the values"))])
        self.axes = tuple(spec.axes)
        self.values = {a: list(spec.buckets[a]) for a in self.axes}
        self.all = sorted((Bucket(s, self.axes) for s in
                           itertools.product(*(self.values[a] for a in self.axes))),
                          key=lambda b: b.sizes, reverse=True)  # largest first
        self.dropped: set[Bucket] = set()
        self._picked: dict[tuple, Bucket | None] = {}  # the hot path asks the same few questions
        self.max_batch = max(b.batch for b in self.all)  # of the active buckets; drop() updates

    @property
    def active(self) -> list[Bucket]:
        return [b for b in self.all if b not in self.dropped]

    def drop(self, bucket: Bucket) -> None:
        self.dropped.add(bucket)
        self._picked.clear()
        self.max_batch = max((b.batch for b in self.active), default=0)

    def pick(self, n: int, lengths: dict[str, int]) -> Bucket | None:
        """Smallest active bucket with batch >= n and every other axis >= its length."""
        want = (n,) + tuple(lengths.get(a, 1) for a in self.axes[1:])
        if want not in self._picked:
            self._picked[want] = self._smallest_covering(want)
        return self._picked[want]

    def uncovered(self, n: int, lengths: dict[str, int], in_dims: dict[str, list]) -> str:
        """Why no active bucket covers n records of these lengths: each axis past its largest
        value, the inputs that carry it (in_dims: input -> its spec dims) and what to do."""
        active = self.active
        if not active:
            return "no bucket is left to run (every one was dropped at setup)"
        said = []
        for i, a in enumerate(self.axes):
            want = n if i == 0 else lengths.get(a, 1)
            top = max(b.sizes[i] for b in active)
            if want > top:
                carry = [name for name, dims in in_dims.items() if a in dims]
                said.append(f"{want} {'records' if i == 0 else 'along ' + a}"
                            + (f" ({', '.join(carry)})" if carry and i else "")
                            + f", more than the largest {a} bucket, {top}")
        if not said:  # each axis fits some bucket, but no one bucket fits them all
            said.append(f"{n} records with lengths {lengths} fit no single active bucket")
        return ("no bucket covers the batch: " + "; ".join(said)
                + ": cut the input to fit, or add a larger value to the spec's buckets")

    def _smallest_covering(self, want: tuple[int, ...]) -> Bucket | None:
        best = None
        for b in self.active:
            if all(s >= w for s, w in zip(b.sizes, want)):
                if best is None or (b.volume, b.sizes) < (best.volume, best.sizes):
                    best = b
        return best


def split_rows(n: int, largest: int) -> list[slice]:
    """Oversize 'split': the rows of a batch of n records, in order, as parts of at most the
    largest batch bucket (one part, all rows, when n fits)."""
    return [slice(start, min(start + largest, n)) for start in range(0, n, largest)]


def split_sizes(n: int, largest: int) -> list[int]:
    """The sizes of split_rows' parts."""
    return [part.stop - part.start for part in split_rows(n, largest)]


def pad_into(dst: np.ndarray, rows: np.ndarray | list[np.ndarray], pad: float) -> None:
    """Write real rows into the bucket-shaped host array `dst` and pad everything else.

    dst: [B_bucket, *bucket dims]; rows: dense [n, *dims<=bucket] or n per-record arrays.
    """
    n = len(rows)
    if isinstance(rows, np.ndarray) and rows.shape[1:] == dst.shape[1:]:
        dst[:n] = rows  # dense and already bucket-shaped: one copy, the common npy case
        if n < dst.shape[0]:
            dst[n:] = pad
        return
    dst[...] = pad
    if isinstance(rows, np.ndarray) and rows.ndim == dst.ndim:
        # dense, padded to its batch's longest when read: past the bucket only where a part of
        # a split batch is shorter than the batch, and there the rows hold padding alone
        fit = tuple(slice(0, min(s, d)) for s, d in zip(rows.shape[1:], dst.shape[1:]))
        dst[(slice(0, n),) + fit] = rows[(slice(None),) + fit]
        return
    flat = _concatenated(rows, dst) if n and dst.ndim >= 2 else None
    if flat is not None:
        # one masked copy: a per-row loop holds the GIL the launching thread waits for
        lengths = np.fromiter(map(len, rows), np.intp, count=n)
        dst[:n][np.arange(dst.shape[1]) < lengths[:, None]] = flat
        return
    for i, row in enumerate(rows):
        dst[(i,) + tuple(slice(0, s) for s in np.shape(row))] = row


def _concatenated(rows: list, dst: np.ndarray) -> np.ndarray | None:
    """The records joined along their first axis when they differ only in it (text's tokens,
    a sequence of fixed-size vectors), so that they pad as one copy under a length mask; None
    for records ragged on other axes too."""
    try:
        flat = np.concatenate(rows)
    except ValueError:  # the records differ in a later axis, or one is a scalar
        return None
    return flat if flat.ndim == dst.ndim - 1 and flat.shape[1:] == dst.shape[2:] else None


def cut_rows(rows: np.ndarray, dims: list, lengths: dict[str, np.ndarray]
             ) -> np.ndarray | list[np.ndarray]:
    """Real outputs: `rows` holds the batch's n real rows (a fresh array, not the staging
    buffer); each record is cut back to its own length on every non-batch named axis.
    Dense (as given) when the output has no such axis, else a list of per-record views."""
    ragged = [(i, d) for i, d in enumerate(dims) if i > 0 and isinstance(d, str) and d != BATCH]
    if not ragged:
        return rows
    out = []
    for r in range(len(rows)):
        idx = [r] + [slice(None)] * (len(dims) - 1)
        for i, axis in ragged:
            idx[i] = slice(0, int(lengths[axis][r]))
        out.append(rows[tuple(idx)])
    return out

