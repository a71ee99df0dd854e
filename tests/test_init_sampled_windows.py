"""init's plan for a grouped text file it sampled only the head of: the batches it plans for
are the file's (whole windows of whole batches), not the sample's share of a window."""

from __future__ import annotations

import numpy as np

from graphrun.init.text import batch_shapes, file_batch_shapes
from graphrun.plan.planner import batches_histogram, evaluate, plan

AXES = ("batch", "seq")
RECORDS, SAMPLE, BATCH, WINDOW = 20_000, 2_000, 64, 4_096


def lengths(n: int) -> np.ndarray:
    rng = np.random.default_rng(7)
    return np.clip(np.round(rng.lognormal(np.log(24), 0.7, n)), 4, 128).astype(np.int64)


def test_whole_windows_have_whole_batches_and_the_file_tail_one_short_batch():
    shapes = file_batch_shapes(lengths(SAMPLE), BATCH, WINDOW, RECORDS)
    sizes = [s[0] for s in shapes]
    assert sum(sizes) == RECORDS
    tail = RECORDS % WINDOW % BATCH  # 20,000 = 4 x 4,096 + 3,616; 3,616 = 56 x 64 + 32
    assert sorted(set(sizes)) == [tail, BATCH] and sizes.count(tail) == 1
    # within a window, batches come out shortest first, as the sorted window cuts them
    first_window = [s[1] for s in shapes[:WINDOW // BATCH]]
    assert first_window == sorted(first_window)


def test_the_plan_from_the_sample_pads_the_file_as_it_expects_and_less_than_share_windows():
    every = lengths(RECORDS)
    sample = every[:SAMPLE]
    truth = batches_histogram(AXES, batch_shapes(every, BATCH, WINDOW))
    planned = plan(batches_histogram(AXES, file_batch_shapes(sample, BATCH, WINDOW, RECORDS)),
                   12, {"seq": 8})
    # the old model: the sample cut in windows of its share of the file's window
    share = plan(batches_histogram(AXES, batch_shapes(sample, BATCH,
                                                      WINDOW * SAMPLE // RECORDS)), 12, {"seq": 8})
    got = evaluate(truth, planned.lists)
    assert got.uncovered == 0
    assert planned.lists["batch"][-1] == BATCH
    assert abs(got.waste - planned.waste) < 0.05  # what init prints is what the run pads
    assert got.waste < evaluate(truth, share.lists).waste


def test_the_slack_lifts_a_batch_longest_to_the_next_records():
    sample = lengths(SAMPLE)
    plain = file_batch_shapes(sample, BATCH, WINDOW, RECORDS)
    slack = file_batch_shapes(sample, BATCH, WINDOW, RECORDS, slack=BATCH // 16)
    assert [s[0] for s in slack] == [s[0] for s in plain]
    assert all(b[1] >= a[1] for a, b in zip(plain, slack))
