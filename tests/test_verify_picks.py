"""Verification of picked ids (argmax, top-k ids): a near tie may swap a pick under capture, so a
few rows may differ; a wrong graph, which changes most rows, still fails."""

import torch

from graphrun.engine.verify import Tolerance, compare_outputs
from graphrun.spec.keys import OutputSpec

TOL = Tolerance(rtol=1e-3, atol=1e-3, picks=frozenset({"ids"}), picked_rows=0.05)


def ids_differing_in(rows: int, differ: int) -> tuple[torch.Tensor, torch.Tensor]:
    want = torch.arange(rows * 8).reshape(rows, 1, 8)
    got = want.clone()
    got[:differ, 0, 0] += 1000
    return got, want


def test_a_few_swapped_picks_pass_and_many_fail():
    got, want = ids_differing_in(128, 6)  # floor(0.05 * 128) = 6 rows allowed
    assert compare_outputs({"ids": got}, {"ids": want}, TOL, "").passed
    got, want = ids_differing_in(128, 7)
    check = compare_outputs({"ids": got}, {"ids": want}, TOL, "")
    assert not check.passed
    assert check.failures == ["output 'ids': replay picks other ids than eager in 7 of 128 rows "
                              "(picked_rows=0.05 allows 6)"]


def test_one_row_may_differ_in_a_small_batch():
    got, want = ids_differing_in(1, 1)
    assert compare_outputs({"ids": got}, {"ids": want}, TOL, "").passed
    got, want = ids_differing_in(8, 2)
    assert not compare_outputs({"ids": got}, {"ids": want}, TOL, "").passed


def test_computed_outputs_keep_rtol_and_atol():
    got, want = torch.ones(4, 3), torch.ones(4, 3)
    got[0, 0] = 1.5
    check = compare_outputs({"scores": got}, {"scores": want}, TOL, "")
    assert not check.passed and "max abs error 0.5" in check.failures[0]


def test_the_spec_says_which_outputs_are_picks():
    assert OutputSpec(shape=["batch", 1], reduce=["argmax"]).picks_ids
    assert OutputSpec(shape=["batch", 5], topk={"k": 5}).picks_ids
    assert not OutputSpec(shape=["batch", 5], topk={"k": 5, "take": "values"}).picks_ids
    assert not OutputSpec(shape=["batch", 5], reduce=["softmax"]).picks_ids
    assert not OutputSpec(shape=["batch", 5]).picks_ids
