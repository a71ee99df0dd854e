"""Buckets planned from the data: the histogram of what each batch needs on every bucket axis,
and the bucket lists that minimise padded work (padded rows x padded positions) under a graph
count.

A batch of n records whose longest record is L positions long runs in the bucket
(cover(batch, n), cover(seq, L)); the model's cost is taken as proportional to that bucket's
volume. For one axis with the others fixed, choosing k values out of the sorted distinct needs
is a 1-D partition problem solved exactly by dynamic programming; the other axes' few distinct
values (batch sizes: data.batch_size and the last batch) are enumerated, so the plan is exact
whenever that enumeration is small, and alternates axis by axis otherwise.
"""

from __future__ import annotations

import bisect
import itertools
import math
import random
from dataclasses import dataclass, field
from typing import Iterator

import numpy as np

from graphrun.engine.buckets import split_sizes
from graphrun.generate.records import with_implied_io
from graphrun.spec.generate import PROMPT_AXIS
from graphrun.spec.keys import BATCH, PipelineSpec

ENUMERATE_LIMIT = 4096  # combinations of the other axes' lists tried exactly before alternating
UNBOUNDED = 2**31 - 1


@dataclass
class Histogram:
    """Distinct batch shapes of the data: needs [u, axes] (batch size, then the longest record
    per variable axis), count [u] batches of that shape, real positions over all batches."""

    axes: tuple[str, ...]
    needs: np.ndarray  # [u, len(axes)] int64
    count: np.ndarray  # [u] int64
    real: int  # sum over records of the product of their lengths (the unpadded work)
    records: int
    batches: int
    rejected: int = 0
    sampled: bool = False
    reasons: dict[str, int] = field(default_factory=dict)
    first_reject: str = ""  # "file:line: reason" of the first bad record read
    # axis -> the largest value a plan may give it (plan/limits.py): rounding stops there
    limits: dict[str, int] = field(default_factory=dict)
    # a generation job's: each record's prompt tokens, in the order the engine takes them
    prompts: np.ndarray | None = None

    def no_records(self) -> str:
        """Why there is nothing to plan from: the records read were all bad, or none."""
        if self.rejected:
            return f"every record read ({self.rejected}) is bad, the first {self.first_reject}"
        return "no record was read (an empty file or slice)"

    def largest(self, axis: str) -> int:
        return int(self.needs[:, self.axes.index(axis)].max())


# ---- reading ------------------------------------------------------------------------------------

def read_batches_for_plan(spec: PipelineSpec, stop: int | None = None, start: int = 0
                          ) -> Iterator:
    """The one place the planner reads records (RecordBatch: lengths per axis, len = records),
    those with ordinals in [start, stop)."""
    from graphrun.read.stream import read_batches

    return read_batches(spec, start=start, stop=stop)


def reading_spec(spec: PipelineSpec) -> PipelineSpec:
    """The spec as the planner reads with it: bad records skipped (counted), and no record
    rejected for being longer than today's largest bucket, since the plan must cover it; but
    none past the axis' limit (plan/limits.py): text is cut there with truncate on, and a
    longer record is rejected (counted) with it off. A generation job's prompts are read as
    its run reads them (its implied inputs)."""
    from graphrun.plan.limits import axis_limits

    spec = with_implied_io(spec)
    limits = axis_limits(spec)
    buckets = {}
    for a, v in spec.buckets.items():
        if a == BATCH:
            buckets[a] = [spec.data.batch_size] if v == "auto" else v
        elif a in limits:
            top = limits[a].value
            buckets[a] = [x for x in ([] if v == "auto" else sorted(v)) if x < top] + [top]
        else:
            buckets[a] = [UNBOUNDED] if v == "auto" else sorted(v)[:-1] + [UNBOUNDED]
    data = spec.data.model_copy(update={"on_bad_record": "skip"})
    if data.text is not None and limits:
        top = next(iter(limits.values())).value
        data = data.model_copy(update={"text": data.text.model_copy(update={"max_length": top})})
    return spec.model_copy(update={"buckets": buckets, "data": data})


def histogram(spec: PipelineSpec, sample: int | None = None, seed: int = 0,
              stop: int | None = None, start: int = 0) -> Histogram:
    """Read the input once (streamed; the records in [start, stop)) and count batch shapes; with
    `sample`, a uniform sample of whole batches (reservoir) of about that many records, so
    batch shapes stay real."""
    axes = tuple(spec.axes)
    keep = None if sample is None else max(1, math.ceil(sample / spec.data.batch_size))
    rng = random.Random(seed)
    rows: list[tuple] = []
    prompts: list[tuple[int, np.ndarray]] = []  # (batch number, its prompts' lengths)
    generating = spec.generate is not None
    seen = rejected = 0
    reasons: dict[str, int] = {}
    first_reject = ""
    for batch in read_batches_for_plan(reading_spec(spec), stop, start):
        rejected += len(batch.rejects)
        if batch.rejects and not first_reject:
            first_reject = f"{batch.rejects[0].where}: {batch.rejects[0].reason}"
        for r in batch.rejects:
            reasons[r.reason] = reasons.get(r.reason, 0) + 1
        n = len(batch)
        if n == 0:
            continue
        lens = [np.asarray(batch.lengths[a], np.int64) for a in axes[1:]]
        real = int(np.prod(lens, axis=0).sum()) if lens else n
        row = (n, *(int(x.max()) for x in lens), real)
        own = (seen, np.asarray(batch.lengths[PROMPT_AXIS], np.int64)) if generating else None
        seen += 1
        if keep is None or len(rows) < keep:
            rows.append(row)
            prompts.append(own)
        else:
            j = rng.randrange(seen)
            if j < keep:
                rows[j], prompts[j] = row, own
    if not rows:
        empty = np.zeros(0, np.int64)
        return Histogram(axes, np.zeros((0, len(axes)), np.int64), empty, empty, 0, 0, rejected,
                         False, reasons, first_reject=first_reject)
    table = np.asarray(rows, np.int64)
    shapes, inverse = np.unique(table[:, :-1], axis=0, return_inverse=True)
    inverse = inverse.reshape(-1)
    return Histogram(axes, shapes, np.bincount(inverse).astype(np.int64),
                     np.bincount(inverse, weights=table[:, -1]).astype(np.int64),
                     int(table[:, 0].sum()), len(rows), rejected, seen > len(rows), reasons,
                     prompts=np.concatenate([x for _, x in sorted(prompts, key=lambda p: p[0])])
                     if generating else None)


# ---- cost ---------------------------------------------------------------------------------------

@dataclass
class Evaluation:
    lists: dict[str, list[int]]
    graphs: int
    padded: int  # padded work over the covered batches
    waste: float  # 1 - real / padded over the covered batches
    uncovered: int  # batches longer than the largest value of some variable axis


def _cover(values: list[int], need: int) -> int | None:
    i = bisect.bisect_left(values, need)
    return values[i] if i < len(values) else None


def evaluate(hist: Histogram, lists: dict[str, list[int]]) -> Evaluation:
    """Padded work of running the histogram's batches in these buckets, as the runner picks
    them (smallest cover per axis; a batch larger than every batch bucket split)."""
    lists = {a: sorted(lists[a]) for a in hist.axes}
    padded = real = uncovered = 0
    for need, count, work in zip(hist.needs.tolist(), hist.count.tolist(), hist.real.tolist()):
        covers = [_cover(lists[a], x) for a, x in zip(hist.axes[1:], need[1:])]
        if any(c is None for c in covers):
            uncovered += count
            continue
        rows = sum(_cover(lists[BATCH], c) for c in split_sizes(need[0], lists[BATCH][-1]))
        padded += count * rows * math.prod(covers)
        real += work
    waste = 1 - real / padded if padded else 0.0
    return Evaluation(lists, math.prod(len(v) for v in lists.values()), padded, waste, uncovered)


# ---- the exact 1-D plan -------------------------------------------------------------------------

def best_values(needs: np.ndarray, weights: np.ndarray, k: int) -> list[int]:
    """k values (the largest need among them) minimising sum(weight * cover(need)): dynamic
    programming over the sorted distinct needs, each segment covered by its last value."""
    values, inverse = np.unique(needs, return_inverse=True)
    w = np.bincount(inverse.reshape(-1), weights=weights).astype(np.float64)
    m = len(values)
    if k >= m:
        return values.tolist()
    prefix = np.concatenate([[0.0], np.cumsum(w)])  # prefix[j] = weight of values[:j]
    v = values.astype(np.float64)
    cost = v * prefix[1:]  # cost[j]: values[:j+1] covered by one value, values[j]
    back = np.zeros((k, m), np.int64)
    for level in range(1, k):
        new = np.full(m, np.inf)
        for j in range(level, m):
            # the last segment is values[i+1 .. j], covered by values[j]
            cand = cost[level - 1:j] + v[j] * (prefix[j + 1] - prefix[level:j + 1])
            i = int(np.argmin(cand))
            new[j], back[level, j] = cand[i], i + level - 1
        cost = new
    chosen, j = [m - 1], m - 1
    for level in range(k - 1, 0, -1):
        j = int(back[level, j])
        chosen.append(j)
    return sorted(values[chosen].tolist())


def batches_histogram(axes: tuple[str, ...], rows: list[tuple],
                      prompts: np.ndarray | None = None) -> Histogram:
    """A histogram of batches known without reading the file (init's sample): rows of (records,
    longest per variable axis..., real positions); prompts: a generation job's prompt
    lengths."""
    table = np.asarray(rows, np.int64).reshape(-1, len(axes) + 1)
    shapes, inverse = np.unique(table[:, :-1], axis=0, return_inverse=True)
    inverse = inverse.reshape(-1)
    return Histogram(axes, shapes, np.bincount(inverse).astype(np.int64),
                     np.bincount(inverse, weights=table[:, -1]).astype(np.int64),
                     int(table[:, 0].sum()), len(table), prompts=prompts)


def _rounded(needs: np.ndarray, multiple: int) -> np.ndarray:
    return -(-needs // multiple) * multiple


def _allocations(sizes: list[int], max_graphs: int) -> Iterator[tuple[int, ...]]:
    """Counts per axis (each at most its distinct values) whose product fits, maximal ones."""
    ranges = [range(1, min(s, max_graphs) + 1) for s in sizes]
    fits = [c for c in itertools.product(*ranges) if math.prod(c) <= max_graphs]
    for c in fits:
        bigger = (c[:i] + (c[i] + 1,) + c[i + 1:] for i in range(len(c)))
        if not any(b in fits for b in bigger):
            yield c


def plan(hist: Histogram, max_graphs: int, multiple_of: dict[str, int] | None = None,
         fixed: dict[str, list[int]] | None = None) -> Evaluation:
    """The bucket lists of at most max_graphs graphs that minimise padded work; the axes in
    `fixed` keep their lists."""
    multiple_of, fixed = multiple_of or {}, fixed or {}
    needs = np.stack([np.minimum(_rounded(hist.needs[:, i], multiple_of.get(a, 1)),
                                 hist.limits.get(a, UNBOUNDED))
                      for i, a in enumerate(hist.axes)], axis=1)
    distinct = [np.asarray(sorted(fixed[a])) if a in fixed else np.unique(needs[:, i])
                for i, a in enumerate(hist.axes)]
    free = [i for i, a in enumerate(hist.axes) if a not in fixed]
    budget = max_graphs // math.prod(len(v) for v in fixed.values())
    if not free or budget < 1:
        return evaluate(hist, fixed)
    best = None
    for free_counts in _allocations([len(distinct[i]) for i in free], budget):
        counts = [len(d) for d in distinct]
        for i, c in zip(free, free_counts):
            counts[i] = c
        lists = _plan_allocation(hist, needs, distinct, tuple(counts), free)
        found = evaluate(hist, lists)
        if best is None or (found.padded, found.graphs) < (best.padded, best.graphs):
            best = found
    return best


def _plan_allocation(hist: Histogram, needs: np.ndarray, distinct: list, counts: tuple,
                     free: list[int]) -> dict[str, list[int]]:
    axes = hist.axes
    dp_axis = max(free, key=lambda i: len(distinct[i]))
    others = [i for i in range(len(axes)) if i != dp_axis]
    options = [[sorted(c) + [int(distinct[i][-1])] for c in itertools.combinations(
                distinct[i][:-1].tolist(), counts[i] - 1)] if i in free
               else [distinct[i].tolist()] for i in others]
    if math.prod(len(o) for o in options) <= ENUMERATE_LIMIT:
        best, best_cost = None, None
        for picked in itertools.product(*options):
            lists = {axes[i]: p for i, p in zip(others, picked)}
            lists[axes[dp_axis]] = _solve_axis(hist, needs, lists, dp_axis, counts[dp_axis])
            cost = evaluate(hist, lists).padded
            if best_cost is None or cost < best_cost:
                best, best_cost = lists, cost
        return best
    return _alternate(hist, needs, distinct, counts, free)


def _factor(values: list[int], axis: str, need: int) -> int:
    """What a batch needing `need` on this axis multiplies the work by; 0 when not covered (the
    run rejects its records, so it weighs nothing)."""
    if axis == BATCH:
        return sum(_cover(values, c) for c in split_sizes(need, values[-1]))
    return _cover(values, need) or 0


def _solve_axis(hist: Histogram, needs: np.ndarray, lists: dict, axis: int, k: int) -> list:
    """Exact values of one axis with the other axes' lists fixed."""
    weights = hist.count.astype(np.float64)
    for i, a in enumerate(hist.axes):
        if i != axis:
            weights = weights * np.asarray([_factor(lists[a], a, x) for x in needs[:, i]])
    return best_values(needs[:, axis], weights, k)


def _alternate(hist: Histogram, needs: np.ndarray, distinct: list, counts: tuple,
               free: list[int]) -> dict[str, list[int]]:
    """Many combinations: each free axis solved exactly in turn until the work stops falling."""
    axes = hist.axes
    lists = {a: (best_values(needs[:, i], hist.count.astype(np.float64), counts[i])
                 if i in free else distinct[i].tolist()) for i, a in enumerate(axes)}
    cost = evaluate(hist, lists).padded
    for _ in range(20):
        for i in free:
            lists[axes[i]] = _solve_axis(hist, needs, lists, i, counts[i])
        new = evaluate(hist, lists).padded
        if new >= cost:
            break
        cost = new
    return lists


def power_of_two(hist: Histogram, max_graphs: int, multiple_of: dict[str, int] | None = None,
                 limits: dict[str, int] | None = None) -> Evaluation:
    """The best plain power-of-two lists of at most max_graphs graphs: per axis the largest k
    powers of two up to the first covering the data's largest need, or the axis' limit where
    that comes first (the limit is then the last value)."""
    multiple_of, limits = multiple_of or {}, limits or {}
    ladders = []
    for a in hist.axes:
        top = 1 << max(0, math.ceil(math.log2(max(1, hist.largest(a)))))
        m = multiple_of.get(a, 1)
        ladder = [p for p in (1 << e for e in range(top.bit_length())) if p % m == 0] or [top]
        if a in limits and ladder[-1] > limits[a]:
            ladder = [p for p in ladder if p < limits[a]] + [limits[a]]
        ladders.append(ladder)
    best = None
    for counts in _allocations([len(x) for x in ladders], max_graphs):
        lists = {a: ladder[-k:] for a, ladder, k in zip(hist.axes, ladders, counts)}
        found = evaluate(hist, lists)
        if best is None or (found.padded, found.graphs) < (best.padded, best.graphs):
            best = found
    return best
