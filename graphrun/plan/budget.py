"""capture.memory_budget_mib in the planner (`graphrun plan`, `buckets: auto`): no planned list
holds a bucket whose estimated graph memory passes the budget.

A bucket's memory is estimated from one measured bucket, scaled by volume (rows x positions):
on a GPU the pool growth of capturing it (what the engine's budget check counts), elsewhere
the peak of one eager run on the CPU (torch.profiler's allocations). Activations grow with the
batch linearly, so the batch axis is the one capped: batches larger than the cap are split,
as the runner splits them. Other axes keep their largest need (shorter values would reject
records). With a pool per graph the graphs' sum must fit, so the cap is lowered until it does.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import os
import sys
import tempfile
from contextlib import contextmanager
from dataclasses import dataclass

import numpy as np

from graphrun.engine.buckets import split_sizes
from graphrun.base.errors import Problem, SpecError
from graphrun.base.units import MiB
from graphrun.plan.planner import Evaluation, Histogram, evaluate, plan
from graphrun.spec.keys import BATCH

CAP_STEP = 0.8  # a pool per graph over budget: the batch cap is lowered by this factor a try


@dataclass(frozen=True)
class MemoryModel:
    """bytes measured for the bucket `ref`; any bucket estimated in proportion to its volume."""

    ref: dict[str, int]
    bytes: int
    how: str  # where the figure comes from, as the table says it

    def estimate(self, sizes: dict[str, int]) -> int:
        return math.ceil(self.bytes * math.prod(sizes.values()) / math.prod(self.ref.values()))

    def lists_bytes(self, lists: dict[str, list[int]], per_graph: bool) -> int:
        """A shared pool holds about the largest bucket's; a pool per graph, every graph's."""
        axes = list(lists)
        if not per_graph:
            return self.estimate({a: max(lists[a]) for a in axes})
        return sum(self.estimate(dict(zip(axes, combo)))
                   for combo in itertools.product(*(lists[a] for a in axes)))


@dataclass
class BudgetNote:
    """What the budget did to the plan, for the table's caption and the manifest."""

    budget_mib: float
    cap: int  # the largest batch value allowed
    largest_need: int  # the largest batch the data makes
    how: str

    def text(self) -> str:
        head = f"capture.memory_budget_mib={self.budget_mib:g}"
        if self.cap >= self.largest_need:
            return f"{head}: every planned bucket fits (estimated from {self.how})"
        return (f"{head}: batch buckets kept at <= {self.cap} (larger would pass the budget, "
                f"estimated from {self.how}); batches of up to {self.largest_need} records "
                "are split across them")


def floor_sizes(hist: Histogram, multiple_of: dict[str, int]) -> dict[str, int]:
    """The smallest useful bucket: the least batch, every other axis at its largest need."""
    return {a: (multiple_of.get(a, 1) if a == BATCH
                else -(-hist.largest(a) // multiple_of.get(a, 1)) * multiple_of.get(a, 1))
            for a in hist.axes}


def batch_cap(hist: Histogram, model: MemoryModel, budget: int, multiple_of: dict[str, int],
              where: str) -> int:
    """The largest batch value whose bucket (other axes at their largest need) fits; a
    SpecError when not even the smallest useful bucket does."""
    floor = floor_sizes(hist, multiple_of)
    step = floor[BATCH]
    if model.estimate(floor) > budget:
        shown = ", ".join(f"{a}={v}" for a, v in floor.items())
        raise SpecError([Problem(where, "capture.memory_budget_mib", (
            f"{budget / MiB:.4g} MiB cannot hold even the smallest useful bucket ({shown}: "
            f"about {model.estimate(floor) / MiB:.3g} MiB, estimated from {model.how}); raise the "
            "budget, or cut the longest records (data.text.max_length for text)"))])
    per_row = model.estimate({**floor, BATCH: 1}) or 1
    cap = max(step, budget // per_row // step * step)
    while cap > step and model.estimate({**floor, BATCH: cap}) > budget:  # rounding up
        cap -= step
    return min(cap, -(-hist.largest(BATCH) // step) * step)


def capped(hist: Histogram, cap: int) -> Histogram:
    """The histogram with every batch larger than cap split into parts of at most cap (each
    part keeps the batch's other needs, and its share of the real work)."""
    b = hist.axes.index(BATCH)
    needs, count, real = [], [], []
    for need, c, work in zip(hist.needs.tolist(), hist.count.tolist(), hist.real.tolist()):
        parts = split_sizes(need[b], cap)
        for p in parts:
            needs.append(need[:b] + [p] + need[b + 1:])
            count.append(c)
            real.append(work * p // need[b])
    return dataclasses.replace(hist, needs=np.asarray(needs, np.int64),
                               count=np.asarray(count, np.int64),
                               real=np.asarray(real, np.int64))


def plan_within(hist: Histogram, max_graphs: int, multiple_of: dict[str, int] | None,
                fixed: dict[str, list[int]] | None, model: MemoryModel | None,
                budget_mib: float | None, per_graph: bool = False, where: str = "spec"
                ) -> tuple[Evaluation, BudgetNote | None]:
    """plan() whose lists fit the budget (when there is one and a batch axis to cap)."""
    multiple_of, fixed = multiple_of or {}, fixed or {}
    if model is None or budget_mib is None or BATCH in fixed:
        return plan(hist, max_graphs, multiple_of, fixed), None
    budget = math.ceil(budget_mib * MiB)
    cap = batch_cap(hist, model, budget, multiple_of, where)
    step = multiple_of.get(BATCH, 1)
    while True:
        chosen = evaluate(hist, plan(capped(hist, cap), max_graphs, multiple_of, fixed).lists)
        total = model.lists_bytes(chosen.lists, per_graph)
        if total <= budget or cap <= step:
            break
        cap = max(step, min(cap - step, int(cap * CAP_STEP) // step * step))
    if total > budget:
        raise SpecError([Problem(where, "capture.memory_budget_mib", (
            f"{budget_mib:g} MiB cannot hold the planned graphs with a pool each (about "
            f"{total / MiB:.3g} MiB, estimated from {model.how}): raise the budget, plan "
            "fewer graphs, or set capture.pool: shared"))])
    return chosen, BudgetNote(budget_mib, cap, hist.largest(BATCH), model.how)


# ---- measuring one bucket -----------------------------------------------------------------------

def reference_sizes(spec, hist: Histogram, multiple_of: dict[str, int]) -> dict[str, int]:
    """The bucket measured: data.batch_size rows, every other axis at its largest need."""
    sizes = floor_sizes(hist, multiple_of)
    step = sizes[BATCH]
    sizes[BATCH] = -(-spec.data.batch_size // step) * step
    return sizes


def measure_memory(spec, sizes: dict[str, int], cuda: bool) -> MemoryModel:
    """One bucket measured on the spec's device: on CUDA, the pool growth of its capture;
    elsewhere, the peak that one eager run allocates on the CPU."""
    shown = ",".join(f"{a}={v}" for a, v in sizes.items())
    if cuda:
        one = _measuring_spec(spec, sizes)
        _, memory = largest_bucket_cost(one, {a: [v] for a, v in sizes.items()})
        return MemoryModel(sizes, memory, f"capturing {shown} on the GPU")
    return MemoryModel(sizes, eager_peak_bytes(spec, sizes),
                       f"one eager run of {shown} on the CPU")


def eager_peak_bytes(spec, sizes: dict[str, int]) -> int:
    """The most memory one eager run of the bucket holds beyond its inputs and the model: the
    running sum of torch.profiler's allocations and frees, in time order."""
    import torch

    from graphrun.engine.probe import synthetic_batch
    from graphrun.engine.runner import Runner

    one = _measuring_spec(spec, sizes).model_copy(update={"device": "cpu"})
    batch = synthetic_batch(one, sizes, seed=0)
    with Runner(one) as runner, _quiet_profiler():
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU],
                                    profile_memory=True) as prof:
            runner.run_batch(batch)
    live = peak = 0
    for event in sorted(prof.events(), key=lambda e: e.time_range.start):
        live += event.self_cpu_memory_usage
        peak = max(peak, live)
    return peak


@contextmanager
def _quiet_profiler():
    """The profiler's C++ side prints a line to stderr (fd 2) as it starts and stops: those
    are dropped, anything else written there meanwhile is passed on."""
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile() as caught:
        os.dup2(caught.fileno(), 2)
        try:
            yield
        finally:
            os.dup2(saved, 2)
            os.close(saved)
            caught.seek(0)
            kept = [x for x in caught.read().splitlines(keepends=True)
                    if not x.startswith(b"USDT:")]
            if kept:
                os.write(2, b"".join(kept))


def _measuring_spec(spec, sizes: dict[str, int]):
    """The spec with the one bucket, no budget (it would drop the bucket measured), no
    verification (only memory is wanted), set up before the run that is measured."""
    capture = spec.capture.model_copy(update={
        "memory_budget_mib": None, "lazy": False,
        "verify": spec.capture.verify.model_copy(update={"enabled": False})})
    return spec.model_copy(update={"buckets": {a: [v] for a, v in sizes.items()},
                                   "capture": capture})


def largest_bucket_cost(spec, lists: dict[str, list[int]]) -> tuple[float, int]:
    """(capture s, memory bytes) of capturing the largest bucket of these lists alone, on the
    spec's (CUDA) device: the cost estimate's unit."""
    from graphrun.engine.probe import bucket_costs
    from graphrun.engine.runner import Runner

    # without the budget, which would drop the very bucket measured, and captured now, to be timed
    capture = spec.capture.model_copy(update={"memory_budget_mib": None, "lazy": False})
    one = spec.model_copy(update={"buckets": {a: [max(v)] for a, v in lists.items()},
                                  "capture": capture})
    with Runner(one) as runner:
        (cost,) = bucket_costs(runner).values()
    return cost["capture_s"] or 0.0, cost["memory_bytes"] or 0


def budget_plan(spec, hist: Histogram, max_graphs: int, multiple_of: dict[str, int],
                fixed: dict[str, list[int]], cuda: bool, where: str = "spec"
                ) -> tuple[Evaluation, BudgetNote | None, MemoryModel | None]:
    """The plan, within capture.memory_budget_mib when the spec sets one (one bucket is
    measured for it); the note and the memory model are None without a budget."""
    budget = spec.capture.memory_budget_mib
    if budget is None or BATCH in fixed:  # a batch list given: nothing the plan can cap
        return plan(hist, max_graphs, multiple_of, fixed), None, None
    model = measure_memory(spec, reference_sizes(spec, hist, multiple_of), cuda)
    chosen, note = plan_within(hist, max_graphs, multiple_of, fixed, model, budget,
                               spec.capture.pool == "per-graph", where)
    return chosen, note, model
