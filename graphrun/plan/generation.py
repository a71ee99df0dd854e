"""A generation job's buckets planned (init --task generate; `graphrun plan` on a generation
spec and its `buckets: auto` at run time, those two through plan/auto.py's plan_spec): the batch
and prompt (seq) lists that minimise padded prefill work for the batches the run forms, with
every graph the lists make counted as the generator makes them: a prefill graph per (batch, prompt
bucket) and a decode graph per (batch, KV length), the KV lengths derived from the prompt
buckets and generate.max_new_tokens (generate/steps.py's kv_lengths).

A prompt bucket's padding costs its decode steps too (a longer prompt bucket attends over a
longer cache), so the planner's padded prefill work (rows x prompt positions) is the measure;
the graph count is what bounds the lists.
"""

from __future__ import annotations

import bisect
import dataclasses
from dataclasses import dataclass
from typing import Callable

from graphrun.engine.buckets import split_sizes
from graphrun.generate.steps import decode_lengths, kv_lengths
from graphrun.plan.planner import Evaluation, Histogram, plan, power_of_two
from graphrun.spec.generate import GENERATE_MAX_GRAPHS, PROMPT_AXIS
from graphrun.spec.keys import BATCH

GRAPHS = GENERATE_MAX_GRAPHS  # prefill and decode graphs of a planned generation spec, at most


@dataclass(frozen=True)
class GenerationGraphs:
    """The graphs a generation spec's lists make."""

    prefill: int  # batch values x prompt values
    decode: int  # batch values x KV lengths
    selected: int  # of these, those the planned batches set up (capture.lazy sets up no other)
    kv: list[int]  # the decode graphs' KV lengths

    @property
    def total(self) -> int:
        return self.prefill + self.decode

    def text(self) -> str:
        return (f"{self.total} graphs ({self.prefill} prefill, {self.decode} decode over KV "
                f"lengths {self.kv}); the batches planned for set up {self.selected}")


def graphs_of(lists: dict[str, list[int]], max_new_tokens: int,
              hist: Histogram | None = None) -> GenerationGraphs:
    """The lists' graphs; with hist, how many of them its batches (count > 0) set up, each
    batch on the smallest covering buckets as the generator picks them."""
    batch, prompts = sorted(lists[BATCH]), sorted(lists[PROMPT_AXIS])
    kv = (kv_lengths(prompts, max_new_tokens, prompts[-1] + max_new_tokens)
          if max_new_tokens > 1 else [])
    keys: set[tuple] = set()
    if hist is not None:
        at = hist.axes.index(PROMPT_AXIS)
        for need, count in zip(hist.needs.tolist(), hist.count.tolist()):
            i = bisect.bisect_left(prompts, need[at])
            if not count or i == len(prompts):
                continue  # no weight (a limit the plan covers), or rejected by the run
            p = prompts[i]
            for part in split_sizes(need[hist.axes.index(BATCH)], batch[-1]):
                b = batch[bisect.bisect_left(batch, part)]
                keys.add(("prefill", b, p))
                keys.update(("decode", b, n) for n in decode_lengths(kv, p, max_new_tokens))
    return GenerationGraphs(len(batch) * len(prompts), len(batch) * len(kv), len(keys), kv)


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
