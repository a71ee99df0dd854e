"""A generation job's buckets planned (init --task generate; `graphrun plan` on a generation
spec and its `buckets: auto` at run time, those two through plan/auto.py's plan_spec), with
every graph the lists make counted as the engine makes them (generate/engine.py): a packed
prefill graph per seq value and a decode graph per batch value; no graph depends on a length
the records reach, so the count is the lists' sizes alone.

The batch list and the largest seq value (the longest prompt) come from the batches the run
forms; the other seq values from the prefills the engine packs those prompts into
(plan/prefills.py), which is what the prefill graphs receive. An Evaluation's padded work and
waste are then those prefills' positions.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Callable

from graphrun.generate.engine import decode_sizes
from graphrun.plan.planner import Evaluation, Histogram, evaluate, plan, power_of_two
from graphrun.plan.prefills import Admission, padded, plan_seq, simulated, waste
from graphrun.spec.generate import GENERATE_MAX_GRAPHS, PROMPT_AXIS
from graphrun.spec.keys import BATCH

GRAPHS = GENERATE_MAX_GRAPHS  # prefill and decode graphs of a planned generation spec, at most


@dataclass(frozen=True)
class GenerationGraphs:
    """The graphs a generation spec's lists make."""

    prefill: int  # seq values: packed prefill token counts
    decode: int  # batch values: decode row counts

    @property
    def total(self) -> int:
        return self.prefill + self.decode

    @property
    def selected(self) -> int:
        return self.total  # the engine sets every graph up before the first prompt

    def text(self) -> str:
        return f"{self.total} graphs ({self.prefill} prefill, {self.decode} decode)"


def graphs_of(lists: dict[str, list[int]], max_new_tokens: int,
              hist: Histogram | None = None) -> GenerationGraphs:
    """The lists' graphs (hist: kept for the callers' one signature; every graph is set up)."""
    batch, prompts = sorted(lists[BATCH]), sorted(set(lists[PROMPT_AXIS]))
    decode = len(decode_sizes(batch[-1], batch)) if max_new_tokens > 1 else 0
    return GenerationGraphs(len(prompts), decode)


def within_graphs(make: Callable[[int], Evaluation], max_graphs: int, max_new_tokens: int,
                  hist: Histogram) -> tuple[Evaluation, GenerationGraphs]:
    """The best of make(k) (lists of at most k prefill graphs) whose prefill and decode
    graphs together are at most max_graphs: k from max_graphs // 2 down (every prompt bucket
    brings a decode graph at least); where even k = 1 makes more, that one."""
    found = None
    for k in range(max(1, max_graphs // 2), 0, -1):
        chosen = make(k)
        graphs = graphs_of(chosen.lists, max_new_tokens, hist)
        found = (dataclasses.replace(chosen, graphs=graphs.total), graphs)
        if graphs.total <= max_graphs:
            break
    return found


def plan_generation(hist: Histogram, max_graphs: int, generate,
                    multiple_of: dict[str, int] | None = None,
                    fixed: dict[str, list[int]] | None = None
                    ) -> tuple[Evaluation, GenerationGraphs]:
    """plan() for a generation job (generate: the spec's generate section): the batch list
    and the longest prompt from the batches, the seq values below it from the prefills (module
    docstring); the Evaluation's graphs are prefill and decode graphs."""
    multiple_of, fixed = multiple_of or {}, fixed or {}
    new = generate.max_new_tokens
    chosen, _ = within_graphs(lambda k: plan(hist, k, multiple_of, fixed), max_graphs, new,
                              hist)
    lists = dict(chosen.lists)
    if PROMPT_AXIS not in fixed and hist.prompts is not None and len(hist.prompts):
        top = lists[PROMPT_AXIS][-1]
        admission = Admission.of(generate, {**lists, PROMPT_AXIS: [top]}, BATCH, PROMPT_AXIS)
        decode = graphs_of({**lists, PROMPT_AXIS: [top]}, new).decode
        lists[PROMPT_AXIS] = plan_seq(simulated(hist.prompts, admission), top,
                                      admission.budget, max(1, max_graphs - decode),
                                      multiple_of.get(PROMPT_AXIS, 1))
    return prefill_evaluation(hist, lists, generate)


def power_of_two_generation(hist: Histogram, max_graphs: int, generate,
                            multiple_of: dict[str, int] | None = None,
                            limits: dict[str, int] | None = None
                            ) -> tuple[Evaluation, GenerationGraphs]:
    """power_of_two() for a generation job, its graphs and padding as plan_generation's."""
    chosen, _ = within_graphs(lambda k: power_of_two(hist, k, multiple_of, limits), max_graphs,
                              generate.max_new_tokens, hist)
    return prefill_evaluation(hist, chosen.lists, generate)


def prefill_evaluation(hist: Histogram, lists: dict[str, list[int]], generate
                       ) -> tuple[Evaluation, GenerationGraphs]:
    """These lists' graphs, and the padded work (a run's, the two runs' mean) and waste of
    the prefills the engine would pack the histogram's prompts into (plan/prefills.py; the
    batches' rows x positions where no prompt lengths were kept)."""
    lists = {a: sorted(v) for a, v in lists.items()}
    graphs = graphs_of(lists, generate.max_new_tokens)
    batches = evaluate(hist, lists)
    if hist.prompts is None or not len(hist.prompts):
        return dataclasses.replace(batches, graphs=graphs.total), graphs
    admission = Admission.of(generate, lists, BATCH, PROMPT_AXIS)
    runs = simulated(hist.prompts, admission)
    seq = lists[PROMPT_AXIS]
    work = sum(padded(packs, seq, admission.budget) for packs in runs) // len(runs)
    return (Evaluation(lists, graphs.total, work, waste(runs, seq, admission.budget),
                       batches.uncovered), graphs)
