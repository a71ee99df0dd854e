"""A generation job's buckets planned (init --task generate; `graphrun plan` on a generation
spec and its `buckets: auto` at run time, those two through plan/auto.py's plan_spec): the batch
and prompt (seq) lists that minimise padded prefill work for the batches the run forms, with
every graph the lists make counted as the engine makes them (generate/engine.py): a packed
prefill graph per seq value and a decode graph per batch value; no graph depends on a length
the records reach, so the count is the lists' sizes alone.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Callable

from graphrun.generate.engine import decode_sizes
from graphrun.plan.planner import Evaluation, Histogram, plan, power_of_two
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


def plan_generation(hist: Histogram, max_graphs: int, max_new_tokens: int,
                    multiple_of: dict[str, int] | None = None,
                    fixed: dict[str, list[int]] | None = None
                    ) -> tuple[Evaluation, GenerationGraphs]:
    """plan() for a generation job: the Evaluation's graphs are prefill and decode graphs."""
    return within_graphs(lambda k: plan(hist, k, multiple_of, fixed), max_graphs,
                         max_new_tokens, hist)


def power_of_two_generation(hist: Histogram, max_graphs: int, max_new_tokens: int,
                            multiple_of: dict[str, int] | None = None,
                            limits: dict[str, int] | None = None
                            ) -> tuple[Evaluation, GenerationGraphs]:
    """power_of_two() for a generation job, its graphs counted as plan_generation counts."""
    return within_graphs(lambda k: power_of_two(hist, k, multiple_of, limits), max_graphs,
                         max_new_tokens, hist)
