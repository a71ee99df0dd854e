"""`buckets: {seq: auto}`: the planner run at the start of `graphrun run` on the input's first
records, so a spec need not guess its bucket values. The chosen lists replace `auto` in the
resolved spec (and so in the manifest's spec); the manifest's bucket_plan says what was planned
and the sample's padding waste."""

from __future__ import annotations

import dataclasses

import numpy as np

from graphrun.base.errors import InputError, Problem, SpecError
from graphrun.manifest.keys import BucketPlan
from graphrun.plan.planner import histogram
from graphrun.plan.budget import budget_plan
from graphrun.spec.keys import PipelineSpec

AUTO_SAMPLE = 10000  # records read from the start of the input to plan the `auto` axes


def resolve_auto(spec: PipelineSpec) -> tuple[PipelineSpec, BucketPlan | None]:
    """The spec with every `auto` axis planned, and what was planned; unchanged without one.
    A record after the sample longer than the planned largest value is a bad record (as for
    any list); data.on_bad_record decides."""
    auto = spec.auto_axes
    if not auto:
        return spec, None
    fixed = {a: v for a, v in spec.buckets.items() if v != "auto"}
    fixed_graphs = 1
    for values in fixed.values():
        fixed_graphs *= len(values)
    if fixed_graphs > spec.buckets_max_graphs:
        raise SpecError([Problem(str(spec.source_path or "spec"), "buckets_max_graphs", (
            f"the lists given make {fixed_graphs} graphs, more than buckets_max_graphs "
            f"({spec.buckets_max_graphs}), so the auto axes {auto} get no value: raise it or "
            "shorten the lists"))])
    hist = histogram(spec, stop=AUTO_SAMPLE)
    if hist.batches == 0:
        raise InputError(f"buckets: auto plans from the first {AUTO_SAMPLE} records, and none "
                         "of them is valid", where=str(spec.data.path))
    spec, limits = _pin_text_length(spec, auto)
    # capture.memory_budget_mib: one bucket is measured on the run's device first (the
    # model is built for it once more); without a budget nothing is measured
    chosen, note, _ = budget_plan(spec, covering(hist, limits), spec.buckets_max_graphs,
                                  spec.buckets_multiple_of, fixed, _cuda(spec),
                                  str(spec.source_path or "spec"))
    buckets = {a: chosen.lists[a] for a in spec.buckets}
    info = BucketPlan(auto_axes=auto, buckets={a: chosen.lists[a] for a in auto},
                      sample_records=hist.records, graphs=chosen.graphs,
                      max_graphs=spec.buckets_max_graphs, padding_waste=chosen.waste,
                      memory_budget=note.text() if note else None)
    info.keep_shapes(hist.needs)  # capture.lazy sets up the buckets these select
    return spec.model_copy(update={"buckets": buckets}), info


def _pin_text_length(spec: PipelineSpec, auto: list[str]) -> tuple[PipelineSpec, dict]:
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

    limit = max_length(spec, tokenizer_folder(spec))
    if axis in (limits := axis_limits(spec)):  # the model's position table may be shorter
        limit = min(limit, limits[axis].value)
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
