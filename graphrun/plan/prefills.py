"""A generation job's prefills as the engine packs them, simulated from its prompts' token
lengths, so that buckets.seq is planned for the token counts its prefill graphs receive.

The engine (generate/engine.py's serve and _admit) admits waiting prompts in input order into
free slots and packs them into one sequence of at most the prefill budget (generate.
prefill_tokens, else the largest seq value), padded up to the smallest seq value that covers
it. While rows run, a prefill waits for admit_least(slots) free slots, or ADMIT_WAIT decode
steps since a slot freed; at the start, and once nothing runs, it fills the slots. How many
slots free up between prefills depends on when completions end, which the planner cannot
know, so two runs are simulated and weigh the same: every completion max_new_tokens long (rows
finish together, prefills fill the budget), and completions ending evenly over
1..max_new_tokens (seeded: a few slots free at a time, prefills of a few prompts). The prefix
cache, which computes less, is left out.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass

import numpy as np

from graphrun.generate.engine import ADMIT_WAIT, WINDOW, admit_least, prefill_sizes
from graphrun.plan.planner import best_values

ASSUMED = ("two runs weighed the same: every completion max_new_tokens long, and completions "
           "ending evenly over 1..max_new_tokens")
SEED = 0  # the simulated completions' lengths: a plan is the same every time
NEAR_BEST = 0.02  # a seq value more is kept only while it saves this share of prefill positions


@dataclass(frozen=True)
class Admission:
    """What decides how the engine packs prompts."""

    slots: int
    budget: int  # prompt tokens one prefill packs at most
    max_new_tokens: int

    @classmethod
    def of(cls, generate, lists: dict[str, list[int]], batch_axis: str, prompt_axis: str
           ) -> "Admission":
        """The spec's generate section with these bucket lists, as the runner reads them: the
        slots given (auto: on the CPU, and here, the largest batch value), else the largest
        batch value; the budget, prefill_tokens or the largest seq value (at least that)."""
        top = max(lists[prompt_axis])
        slots = generate.slots if isinstance(generate.slots, int) else max(lists[batch_axis])
        return cls(slots, max(top, generate.prefill_tokens or top), generate.max_new_tokens)


def simulated(prompts: np.ndarray, admission: Admission) -> list[np.ndarray]:
    """The prefills of both runs (module docstring) for these prompts."""
    lengths = [int(n) for n in prompts if 0 < n <= admission.budget]  # a longer one is rejected
    most = admission.max_new_tokens
    varied = np.random.default_rng(SEED).integers(1, most + 1, size=len(lengths)).tolist()
    return [packed_prefills(lengths, [most] * len(lengths), admission),
            packed_prefills(lengths, varied, admission)]


def packed_prefills(lengths: list[int], steps: list[int], admission: Admission) -> np.ndarray:
    """The prompt tokens of each prefill the engine runs for prompts of these lengths (in the
    order the engine takes them), each record decoding for its steps."""
    least, slots, budget = admit_least(admission.slots), admission.slots, admission.budget
    ends: list[int] = []  # the decode step each running row finishes at
    packs: list[int] = []
    now = i = 0
    free, since = slots, None  # since: the step a slot freed at, since the last prefill
    while i < len(lengths):
        left = len(lengths) - i
        ended = left <= max(free + least, WINDOW)  # the scheduler has taken the input's end
        waited = since is not None and now - since >= ADMIT_WAIT
        if free >= least or not ends or ended or (free and waited):
            while i < len(lengths) and free:  # prefills back to back while slots are free
                total = 0
                while i < len(lengths) and free and total + lengths[i] <= budget:
                    total += lengths[i]
                    heapq.heappush(ends, now + steps[i])
                    free -= 1
                    i += 1
                packs.append(total)
            since = now if free else None
        if ends:  # the decode steps until the next row finishes or the wait ends
            now = ends[0] if since is None else min(ends[0], max(now + 1, since + ADMIT_WAIT))
            while ends and ends[0] <= now:
                heapq.heappop(ends)
                since = now if since is None else since
                free += 1
    return np.asarray(packs, np.int64)


def padded(packs: np.ndarray, seq: list[int], budget: int) -> int:
    """The positions those prefills compute with these seq values, and the doublings of the
    largest up to the budget that the engine adds (generate/engine.py's prefill_sizes)."""
    values = np.asarray(prefill_sizes(seq, max(seq), budget), np.int64)
    at = np.minimum(np.searchsorted(values, packs), len(values) - 1)
    return int(values[at].sum())


def waste(runs: list[np.ndarray], seq: list[int], budget: int) -> float:
    """The padded share of the prefills' positions, the runs weighed the same."""
    shares = [1 - int(packs.sum()) / padded(packs, seq, budget) for packs in runs if packs.sum()]
    return float(np.mean(shares)) if shares else 0.0


def plan_seq(runs: list[np.ndarray], top: int, budget: int, most: int, multiple: int = 1
             ) -> list[int]:
    """At most `most` seq values, `top` the largest (it covers the longest prompt), that
    minimise the prefills' padded positions (each run's relative to its prompt tokens); fewer
    where a value more would save less than NEAR_BEST of them (each value is a graph to set
    up)."""
    runs = [packs for packs in runs if packs.sum()]
    needs = np.concatenate([np.minimum(-(-packs // multiple) * multiple, top) for packs in runs]
                           + [[top]])
    weights = np.concatenate([np.full(len(packs), 1 / packs.sum()) for packs in runs] + [[0.0]])
    best = None
    for k in range(1, max(1, most) + 1):
        values = best_values(needs, weights, k)
        cost = waste(runs, values, budget)
        if best is not None and best[1] - cost < NEAR_BEST:
            break
        best = (values, cost)
        if len(values) < k:  # every distinct total has its value
            break
    return best[0]
