"""A generation job's prefills simulated as the engine packs them (plan/prefills.py), and the
seq values planned for them."""

from __future__ import annotations

import numpy as np

from graphrun.plan.prefills import (NEAR_BEST, Admission, packed_prefills, padded, plan_seq,
                                    simulated, waste)


def test_prompts_fill_the_free_slots_within_the_budget_and_wait_for_rows_to_finish():
    # 2 slots (a prefill waits for 1 free), budget 10: [4, 5] fill both slots at once; the
    # row of 3 steps frees its slot first, so 6 goes alone; its 1-step row ends next, then 2
    admission = Admission(slots=2, budget=10, max_new_tokens=8)
    packs = packed_prefills([4, 5, 6, 2], [3, 5, 1, 1], admission)
    assert packs.tolist() == [9, 6, 2]
    # every row as long: they finish together and the next prefill packs them again
    packs = packed_prefills([4, 5, 6, 2, 7], [4] * 5, admission)
    assert packs.tolist() == [9, 8, 7]


def test_a_prefill_never_passes_the_budget_and_a_longer_prompt_is_left_out():
    admission = Admission(slots=64, budget=100, max_new_tokens=16)
    rng = np.random.default_rng(3)
    prompts = rng.integers(1, 140, size=500)
    for packs in simulated(prompts, admission):
        assert packs.max() <= 100 and packs.min() >= 1
        assert packs.sum() == prompts[prompts <= 100].sum()  # each prompt prefilled once


def test_padded_positions_use_the_engines_doublings_past_the_largest_value():
    packs = np.array([10, 30, 70, 150])
    # values [16, 64]; the budget 200 adds 128 and 200 as the engine's prefill_sizes does
    assert padded(packs, [16, 64], 200) == 16 + 64 + 128 + 200
    assert waste([packs], [16, 64], 200) == 1 - 260 / 408


def test_planned_values_keep_the_top_and_stop_when_one_more_saves_little():
    rng = np.random.default_rng(0)
    prompts = rng.integers(4, 460, size=400)
    admission = Admission(slots=16, budget=464, max_new_tokens=32)
    runs = simulated(prompts, admission)
    values = plan_seq(runs, 464, 464, most=12)
    assert values[-1] == 464 and values == sorted(values) and len(values) <= 12
    assert waste(runs, values, 464) < waste(runs, [32, 64, 128, 256, 464], 464)
    # the next count's best values would save less than NEAR_BEST
    from graphrun.plan.planner import best_values

    needs = np.concatenate([*runs, [464]])
    weights = np.concatenate([np.full(len(p), 1 / p.sum()) for p in runs] + [[0.0]])
    more = best_values(needs, weights, len(values) + 1)
    assert waste(runs, values, 464) - waste(runs, more, 464) < NEAR_BEST
    # a multiple rounds every value but the top, which covers the longest prompt
    values = plan_seq(runs, 464, 464, most=12, multiple=64)
    assert all(v % 64 == 0 for v in values[:-1]) and values[-1] == 464


def test_the_spec_gives_the_slots_and_budget_as_the_runner_reads_them():
    from graphrun.spec.generate import GenerateSpec

    lists = {"batch": [4, 16], "seq": [64, 256]}
    a = Admission.of(GenerateSpec(max_new_tokens=8), lists, "batch", "seq")
    assert (a.slots, a.budget, a.max_new_tokens) == (16, 256, 8)
    a = Admission.of(GenerateSpec(slots=32, prefill_tokens=1024), lists, "batch", "seq")
    assert (a.slots, a.budget) == (32, 1024)
    a = Admission.of(GenerateSpec(slots="auto", prefill_tokens=100), lists, "batch", "seq")
    assert (a.slots, a.budget) == (16, 256)  # a budget below the longest prompt is that
