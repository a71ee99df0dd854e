"""Bucket choice, padding into bucket-shaped staging, cutting real rows back out."""

from __future__ import annotations

import numpy as np
import pytest

from graphrun.engine.buckets import BucketTable, cut_rows, pad_into, split_rows, split_sizes
from graphrun.spec.keys import PipelineSpec


def make_spec(buckets, inputs=None):
    return PipelineSpec.model_validate({
        "version": 1, "name": "t", "model": {"builtin": "mlp"},
        "inputs": inputs or {"x": {"shape": ["batch", "seq"]}},
        "outputs": {"y": {"shape": ["batch", "seq"]}},
        "buckets": buckets, "data": {"path": "d.jsonl"}, "output": {"dir": "o"}})


def test_buckets_are_every_combination_largest_first():
    table = BucketTable(make_spec({"batch": [1, 4], "seq": [8, 16]}))
    assert [b.sizes for b in table.all] == [(4, 16), (4, 8), (1, 16), (1, 8)]
    assert table.all[0].name == "batch=4,seq=16"


@pytest.mark.parametrize("n,seq,want", [(1, 1, (1, 8)), (1, 8, (1, 8)), (1, 9, (1, 16)),
                                        (2, 3, (4, 8)), (4, 16, (4, 16)), (3, 12, (4, 16))])
def test_pick_is_the_smallest_bucket_covering_every_axis(n, seq, want):
    table = BucketTable(make_spec({"batch": [1, 4], "seq": [8, 16]}))
    assert table.pick(n, {"seq": seq}).sizes == want


def test_pick_returns_none_beyond_the_largest_and_skips_dropped_buckets():
    table = BucketTable(make_spec({"batch": [1, 4, 8], "seq": [8]}))
    assert table.pick(9, {"seq": 1}) is None
    assert table.pick(2, {"seq": 17}) is None
    table.drop(table.pick(3, {"seq": 8}))  # batch=4 gone: 3 records now take batch=8
    assert table.pick(3, {"seq": 8}).sizes == (8, 8)
    table.drop(table.all[0])
    assert table.max_batch == 1


def test_split_rows_cover_the_batch_in_order_in_largest_bucket_parts():
    assert split_rows(10, 4) == [slice(0, 4), slice(4, 8), slice(8, 10)]
    assert split_rows(8, 4) == [slice(0, 4), slice(4, 8)]
    assert split_rows(3, 4) == [slice(0, 3)]
    parts = split_rows(1001, 32)
    assert [i for p in parts for i in range(1001)[p]] == list(range(1001))
    assert split_sizes(10, 4) == [4, 4, 2] and sum(split_sizes(1001, 32)) == 1001


def test_pad_into_dense_rows_pads_the_rest():
    dst = np.full((4, 3), 7.0, dtype=np.float32)
    pad_into(dst, np.ones((2, 3), dtype=np.float32), pad=-1)
    assert dst.tolist() == [[1, 1, 1], [1, 1, 1], [-1, -1, -1], [-1, -1, -1]]


def test_pad_into_ragged_rows_pads_each_record_to_the_bucket():
    dst = np.zeros((3, 4), dtype=np.int64)
    pad_into(dst, [np.array([1, 2]), np.array([3, 4, 5])], pad=9)
    assert dst.tolist() == [[1, 2, 9, 9], [3, 4, 5, 9], [9, 9, 9, 9]]


def test_pad_into_records_of_vectors_ragged_on_more_axes_and_empty_ones():
    """Records that differ in their first axis only, in more axes, or hold nothing: each one
    at the top left of its row, the rest padding, whichever way it is copied."""
    rng = np.random.default_rng(3)
    vectors = [rng.standard_normal((k, 3)).astype(np.float32) for k in (2, 0, 5, 1)]
    dst = np.zeros((6, 5, 3), np.float32)
    pad_into(dst, vectors, pad=-1)
    for i, r in enumerate(vectors):
        np.testing.assert_array_equal(dst[i, :len(r)], r)
        assert (dst[i, len(r):] == -1).all()
    assert (dst[4:] == -1).all()
    grids = [np.ones((2, 1)), np.full((1, 3), 2.0)]  # ragged on both axes
    dst = np.zeros((2, 3, 3))
    pad_into(dst, grids, pad=0)
    assert dst[0].tolist() == [[1, 0, 0], [1, 0, 0], [0, 0, 0]]
    assert dst[1].tolist() == [[2, 2, 2], [0, 0, 0], [0, 0, 0]]
    tokens = [np.array([], np.int64), np.array([4], np.int64)]
    dst = np.zeros((3, 2), np.int64)
    pad_into(dst, tokens, pad=7)
    assert dst.tolist() == [[7, 7], [4, 7], [7, 7]]


def test_cut_rows_returns_real_rows_each_at_its_own_length():
    rows = np.arange(2 * 4 * 2).reshape(2, 4, 2)
    cut = cut_rows(rows, ["batch", "seq", 2], {"seq": np.array([1, 3])})
    assert [r.shape for r in cut] == [(1, 2), (3, 2)]
    np.testing.assert_array_equal(cut[1], rows[1, :3])
    assert cut_rows(rows, ["batch", 4, 2], {}) is rows


def test_slot_copies_pair_the_slot_with_each_lanes_static_views():
    """A slot's copies for a bucket and a lane: its pinned inputs into that lane's static input
    views, that lane's static outputs into its pinned outputs; built once per (bucket, lane)."""
    from types import SimpleNamespace

    import torch

    from graphrun.engine.buckets import Bucket
    from graphrun.engine.buffers import BufferSet
    from graphrun.engine.launch import HostSlot

    cpu = torch.device("cpu")
    big, small = Bucket(sizes=(64,), axes=("batch",)), Bucket(sizes=(8,), axes=("batch",))

    def buffers():
        return (BufferSet({"x": ["batch", 3]}, {"x": torch.float32}, big, cpu),
                BufferSet({"y": ["batch", 2]}, {"y": torch.float32}, big, cpu))

    lanes = [SimpleNamespace(index=i, inputs=b[0], outputs=b[1])
             for i, b in enumerate([buffers(), buffers()])]
    h_in, h_out = buffers()
    slot = HostSlot(h_in, h_out)
    for lane in lanes:
        s_in, s_out = lane.inputs, lane.outputs
        for bucket in (big, small):
            c = slot.copies(bucket, lane)
            assert [(d.data_ptr(), s.data_ptr(), d.shape) for d, s in c.h2d] == [
                (s_in.flat["x"].data_ptr(), h_in.flat["x"].data_ptr(), (bucket.batch, 3))]
            assert [(d.data_ptr(), s.data_ptr(), d.shape) for d, s in c.d2h] == [
                (h_out.flat["y"].data_ptr(), s_out.flat["y"].data_ptr(), (bucket.batch, 2))]
            assert slot.copies(bucket, lane) is c
    assert slot.copies(big, lanes[0]) is not slot.copies(big, lanes[1])
