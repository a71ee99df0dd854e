"""`buckets: {seq: auto}`: the planner run at the start of `graphrun run` on the input's first
records, so a spec need not guess its bucket values. The chosen lists replace `auto` in the
resolved spec (and so in the manifest's spec); the manifest's bucket_plan says what was planned
and the sample's padding waste."""

from __future__ import annotations

from .errors import InputError, Problem, SpecError
from .manifest import BucketPlan
from .plan import histogram, plan
from .spec import PipelineSpec

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
        raise SpecError([Problem(str(spec._source or "spec"), "buckets_max_graphs", (
            f"the lists given make {fixed_graphs} graphs, more than buckets_max_graphs "
            f"({spec.buckets_max_graphs}), so the auto axes {auto} get no value: raise it or "
            "shorten the lists"))])
    hist = histogram(spec, stop=AUTO_SAMPLE)
    if hist.batches == 0:
        raise InputError(f"buckets: auto plans from the first {AUTO_SAMPLE} records, and none "
                         "of them is valid", where=str(spec.data.path))
    chosen = plan(hist, spec.buckets_max_graphs, spec.buckets_multiple_of, fixed)
    buckets = {a: chosen.lists[a] for a in spec.buckets}
    info = BucketPlan(auto_axes=auto, buckets={a: chosen.lists[a] for a in auto},
                      sample_records=hist.records, graphs=chosen.graphs,
                      max_graphs=spec.buckets_max_graphs, padding_waste=chosen.waste)
    return spec.model_copy(update={"buckets": buckets}), info
