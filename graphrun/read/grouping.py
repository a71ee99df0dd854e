"""data.group_by_length: batches formed within windows of records sorted by length, and the
outputs put back in input order before they are written.

A window is a run of N consecutive input ordinals (records and rejects), the first starting at
the run's first ordinal; stream.py cuts the valid records of each window into batches in
length order (sorted_batches). Every batch carries its window's first ordinal; the window's
last batch says so. The completer holds the window's outputs (Reorder) until its last batch is
done and writes them in input order, so the writer, the journal and --resume see what an
ungrouped run gives them: a shard's read_from is then a window's first ordinal, and a resume
re-reads whole windows, the same windows, batched the same way.
"""

from __future__ import annotations

import bisect

import numpy as np

from graphrun.engine.buckets import split_rows
from graphrun.read.records import RecordBatch, take, take_where


def sorted_batches(window: RecordBatch, batch_size: int, lo: int) -> list[RecordBatch]:
    """The window's records in length order (stable: ties keep input order), in batches of
    batch_size; each carries window=lo, the last window_end. At least one batch (which holds
    the window's rejects, empty when the window holds none)."""
    n = len(window)
    axes = list(window.lengths)
    # np.lexsort sorts by its last key first: the spec's first variable axis leads
    order = (np.lexsort([window.lengths[a] for a in reversed(axes)]) if axes and n
             else np.arange(n))
    out = []
    for start in range(0, max(n, 1), batch_size):
        rows = order[start:start + batch_size]
        out.append(RecordBatch(
            indices=window.indices[rows],
            ids=(window.ids[rows] if isinstance(window.ids, np.ndarray)
                 else [window.ids[i] for i in rows.tolist()]),
            where=take_where(window.where, rows),
            fields={name: take(r, rows) for name, r in window.fields.items()},
            lengths={a: v[rows] for a, v in window.lengths.items()},
            window=lo))
    out[0].rejects = window.rejects
    out[-1].window_end = True
    return out


class Reorder:
    """A window's outputs, held until its last batch is done, then handed out in input order.
    Holds at most one window's outputs (N records') at a time."""

    def __init__(self):
        self.parts: list[tuple] = []  # (indices [k], ids [k], outputs name -> [k, ...])

    def add(self, indices: np.ndarray, ids, outputs: dict) -> None:
        self.parts.append((indices, ids, outputs))

    def flush(self) -> tuple[np.ndarray, object, dict]:
        """(indices, ids, outputs) of every part added since the last flush, by input ordinal."""
        parts, self.parts = self.parts, []
        indices = np.concatenate([np.asarray(p[0], np.int64) for p in parts])
        order = np.argsort(indices, kind="stable")
        if all(isinstance(p[1], np.ndarray) for p in parts):
            ids = np.concatenate([p[1] for p in parts])[order]
        else:
            flat = [i for p in parts for i in (p[1].tolist() if isinstance(p[1], np.ndarray)
                                                 else p[1])]
            ids = [flat[i] for i in order.tolist()]
        outputs = {name: _ordered([p[2][name] for p in parts], order) for name in parts[0][2]}
        return indices[order], ids, outputs


def _ordered(parts: list, order: np.ndarray):
    """One output's parts (dense [k, ...] or k per-record arrays) joined and put in `order`."""
    if all(isinstance(p, np.ndarray) for p in parts) and len({p.shape[1:] for p in parts}) == 1:
        return np.concatenate(parts)[order]
    flat = [r for p in parts for r in p]
    return [flat[i] for i in order.tolist()]


class PaddingCount:
    """Padded positions per variable axis of the grouped batches, beside those the same records
    would take batched in input order, both in the spec's buckets as the runner picks them
    (smallest cover per axis; a batch larger than every batch bucket split)."""

    def __init__(self, spec):
        self.window = spec.data.group_by_length
        self.batch_size = spec.data.batch_size
        self.values = {a: sorted(v) for a, v in spec.buckets.items() if v != "auto"}
        self.windows = 0
        self.grouped: dict[str, list[int]] = {}  # axis -> [padded, run]
        self.input_order: dict[str, list[int]] = {}
        self.carry: dict[str, np.ndarray] = {}  # input order: records short of a full batch

    def add_window(self, window: RecordBatch, batches: list[RecordBatch]) -> None:
        """window: its records in input order; batches: as sorted_batches formed them."""
        self.windows += 1
        for b in batches:
            self._count(self.grouped, b.lengths)
        lengths = {a: np.concatenate([self.carry.get(a, np.empty(0, np.int64)), v])
                   for a, v in window.lengths.items()}
        n = len(next(iter(lengths.values()), ()))
        full = n - n % self.batch_size
        for start in range(0, full, self.batch_size):
            self._count(self.input_order,
                        {a: v[start:start + self.batch_size] for a, v in lengths.items()})
        self.carry = {a: v[full:] for a, v in lengths.items()}

    def _count(self, into: dict, lengths: dict[str, np.ndarray]) -> None:
        n = len(next(iter(lengths.values()), ()))
        batch_values = self.values.get("batch") or [self.batch_size]
        for sl in split_rows(n, batch_values[-1]):
            rows = _cover(batch_values, sl.stop - sl.start)
            for axis, lens in lengths.items():
                part = np.asarray(lens[sl], np.int64)
                cover = _cover(self.values.get(axis, []), int(part.max())) or int(part.max())
                counts = into.setdefault(axis, [0, 0])
                counts[0] += rows * cover - int(part.sum())
                counts[1] += rows * cover

    def report(self) -> dict:
        """The manifest's grouping entry (manifest.Grouping's fields)."""
        order = {a: list(c) for a, c in self.input_order.items()}
        if self.carry and len(next(iter(self.carry.values()))):  # the last, partial batch
            self._count(order, self.carry)
        grouped = self.grouped
        return {"window": self.window, "windows": self.windows,
                "padded_positions": {a: c[0] for a, c in grouped.items()},
                "padded_positions_input_order": {a: c[0] for a, c in order.items()},
                "positions_run": {a: c[1] for a, c in grouped.items()},
                "positions_run_input_order": {a: c[1] for a, c in order.items()},
                "padding_saved": {a: (1 - grouped[a][0] / c[0]) if c[0] else 0.0
                                  for a, c in order.items() if a in grouped}}


def _cover(values: list[int], need: int) -> int | None:
    i = bisect.bisect_left(values, need)
    return values[i] if i < len(values) else None
