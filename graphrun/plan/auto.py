"""`buckets: {seq: auto}`: the planner run at the start of `graphrun run` on the input's first
records, so a spec need not guess its bucket values. The chosen lists replace `auto` in the
resolved spec (and so in the manifest's spec); the manifest's bucket_plan says what was planned
and the sample's padding waste. plan_spec is the one planner of a spec's lists that `graphrun
plan` and the run share: a generation spec's by plan/generation.py (prefill and decode graphs
counted), any other's by plan/budget.py (within capture.memory_budget_mib)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np

from graphrun.base.errors import InputError, Problem, SpecError
from graphrun.manifest.keys import BucketPlan
from graphrun.plan.budget import BudgetNote, MemoryModel, budget_plan
from graphrun.plan.generation import GenerationGraphs, plan_generation
from graphrun.plan.planner import Evaluation, Histogram, histogram
from graphrun.spec.keys import BATCH, PipelineSpec

AUTO_SAMPLE = 10000  # records read from the start of the job's slice to plan the `auto` axes
# budget_plan scales a forward bucket, blind to the KV cache and graphs the generator budgets
GENERATION_BUDGET = ("capture.memory_budget_mib: not planned for in a generation spec (the run "
                     "keeps its KV cache and graphs within it)")


@dataclass(frozen=True)
class SpecPlan:
    """A spec's planned lists and what bounded them."""

    chosen: Evaluation  # its graphs: all the lists make (a generation spec's: prefill + decode)
    note: BudgetNote | None = None  # what capture.memory_budget_mib did to a forward plan
    memory: MemoryModel | None = None  # the estimate it was kept within
    generation: GenerationGraphs | None = None  # a generation spec's graphs, counted

    def budget_text(self, spec: PipelineSpec) -> str | None:
        """What capture.memory_budget_mib did to the plan, for the plan's output and the
        manifest; None without a budget."""
        if self.note is not None:
            return self.note.text()
        if spec.generate is not None and spec.capture.memory_budget_mib is not None:
            return GENERATION_BUDGET
        return None


def plan_spec(spec: PipelineSpec, hist: Histogram, max_graphs: int, multiple_of: dict[str, int],
              fixed: dict[str, list[int]], cuda: bool, where: str = "spec") -> SpecPlan:
    """The spec's lists planned from hist (already covered at the spec's limits, see
    covering) for at most max_graphs graphs, the axes in fixed keeping their lists: what
    `graphrun plan` proposes and `buckets: auto` runs with."""
    if spec.generate is not None:
        chosen, graphs = plan_generation(hist, max_graphs, spec.generate,
                                         multiple_of, fixed)
        return SpecPlan(chosen, generation=graphs)
    # capture.memory_budget_mib: one bucket is measured on the run's device first (the
    # model is built for it once more); without a budget nothing is measured
    chosen, note, model = budget_plan(spec, hist, max_graphs, multiple_of, fixed, cuda, where)
    return SpecPlan(chosen, note, model)


def resolve_auto(spec: PipelineSpec, sample: int = AUTO_SAMPLE, window: tuple = (0, None)
                 ) -> tuple[PipelineSpec, BucketPlan | None]:
    """The spec with every `auto` axis planned from the first `sample` records of the job's
    slice (window: its [start, stop) of the input; every worker of a job plans from the same
    one), and what was planned; unchanged without one. A record after the sample longer than
    the planned largest value is a bad record (as for any list); data.on_bad_record decides."""
    auto = spec.auto_axes
    if not auto:
        return spec, None
    where, most = str(spec.source_path or "spec"), spec.max_graphs
    fixed = {a: v for a, v in spec.buckets.items() if v != "auto"}
    fixed_graphs = 1
    for values in fixed.values():
        fixed_graphs *= len(values)
    if fixed_graphs > most:
        raise SpecError([Problem(where, "buckets_max_graphs", (
            f"the lists given make {fixed_graphs} graphs, more than buckets_max_graphs "
            f"({most}), so the auto axes {auto} get no value: raise it or shorten the lists"))])
    start, stop = window
    end = start + sample if stop is None else min(stop, start + sample)
    hist = histogram(spec, start=start, stop=end)
    if hist.batches == 0:
        fix = (": fix the records, or give buckets: lists (with data.on_bad_record: skip the "
               "run writes each bad one to rejects.jsonl)") if hist.rejected else ""
        first = f"the first {sample} records" + (f" from record {start}" if start else "")
        raise InputError(f"buckets: auto plans from {first}, and "
                         f"{hist.no_records()}{fix}", where=str(spec.data.path))
    spec, limits = pin_text_length(spec, auto)
    planned = plan_spec(spec, covering(hist, limits), most, spec.buckets_multiple_of, fixed,
                        _cuda(spec), where)
    chosen, graphs = planned.chosen, planned.generation
    if graphs is not None and graphs.total > most:
        fewer = ", or give fewer batch values" if BATCH in fixed else ""
        raise SpecError([Problem(where, "buckets_max_graphs", (
            f"the fewest graphs a generation plan makes here are {graphs.total} "
            f"({graphs.prefill} prefill, {graphs.decode} decode: each prompt bucket brings its "
            f"decode KV lengths), more than buckets_max_graphs ({most}): raise it{fewer}"))])
    buckets = {a: chosen.lists[a] for a in spec.buckets}
    info = BucketPlan(auto_axes=auto, buckets={a: chosen.lists[a] for a in auto},
                      sample_records=hist.records, graphs=chosen.graphs,
                      decode_graphs=graphs.decode if graphs is not None else None,
                      max_graphs=most, padding_waste=chosen.waste,
                      memory_budget=planned.budget_text(spec))
    info.keep_shapes(hist.needs)  # capture.lazy sets up the buckets these select
    return spec.model_copy(update={"buckets": buckets}), info


def pin_text_length(spec: PipelineSpec, auto: list[str]) -> tuple[PipelineSpec, dict]:
    """Text tokenized into an auto seq axis: its length limit is fixed before planning (the
    tokenizer's, or data.text.max_length), so a record the sample did not see is cut or
    rejected at that limit, never at whatever the plan's largest value happens to be, and
    never past the model's position table."""
    if spec.data.text is None:
        return spec, {}
    from graphrun.read.text import max_length, seq_axis
    from graphrun.models.hf import tokenizer_folder

    axis = seq_axis(spec)
    if axis not in auto:
        return spec, {}
    from graphrun.plan.limits import axis_limits

    # the limit `graphrun plan` stops at (the model's positions, less a generation job's new
    # tokens; the tokenizer's; data.text.max_length), else the run's own default length
    limits = axis_limits(spec)
    limit = limits[axis].value if axis in limits else max_length(spec, tokenizer_folder(spec))
    text = spec.data.text.model_copy(update={"max_length": limit})
    data = spec.data.model_copy(update={"text": text})
    return spec.model_copy(update={"data": data}), {axis: limit}


def covering(hist, limits: dict, caps: dict | None = None):
    """The histogram with a batch shape of no weight at each limit, so that the plan's largest
    value on that axis covers it (a limit below the sample's largest changes nothing); no
    planned value passes a limit or a cap (caps: limits not to cover, e.g. the model's
    positions where longer texts are rejected, not cut)."""
    hist = dataclasses.replace(hist, limits={**hist.limits, **(caps or {}), **limits})
    if not limits:
        return hist
    row = np.ones((1, len(hist.axes)), dtype=hist.needs.dtype)
    for i, a in enumerate(hist.axes):
        row[0, i] = limits.get(a, int(hist.needs[:, i].min()))
    return dataclasses.replace(
        hist, needs=np.concatenate([hist.needs, row]),
        count=np.concatenate([hist.count, np.zeros(1, dtype=hist.count.dtype)]),
        real=np.concatenate([hist.real, np.zeros(1, dtype=np.asarray(hist.real).dtype)]))


def _cuda(spec: PipelineSpec) -> bool:
    from graphrun.engine.device import resolve_device

    return resolve_device(spec.device).type == "cuda"
