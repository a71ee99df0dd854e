"""Big Parquet row groups cut into pieces decoded in parallel (inputs/parquet_split.py): the
records, rejects and locations read are the same as when pyarrow reads the row group whole."""

from __future__ import annotations

import os
import sys

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from graphrun.base.errors import InputError
from graphrun.read.formats import parquet as parquet_in
from graphrun.read.formats import parquet_split
from graphrun.read.formats.parquet_split import Piece, PieceMismatch, plan_pieces
from graphrun.spec.keys import PipelineSpec
from graphrun.read.stream import read_batches
from graphrun.base.tuning import Tuning
from tests.test_stream import make_spec

# row groups over 1 KiB decoded are cut into pieces of about 16 KiB (some 600 records of 6 floats)
SMALL = Tuning(parquet_group_bytes=1024, parquet_piece_bytes=16 << 10, parquet_threads=3)
WHOLE = Tuning(parquet_threads=3)  # every row group here decoded whole by pyarrow: the reference


def everything(spec, tuning: Tuning = SMALL, **kw):
    """(valid ids in order, rejects in order, batches)."""
    batches = list(read_batches(spec, tuning=tuning, **kw))
    ids = [i for b in batches for i in b.ids]
    return ids, [r for b in batches for r in b.rejects], batches

VEC = {"x": {"shape": ["batch", 6], "dtype": "float32"}}
GRID = {"x": {"shape": ["batch", 2, 3], "dtype": "float32"}}
N = 3000


def vectors(n: int = N, width: int = 6) -> np.ndarray:
    return (np.arange(n * width, dtype=np.float32).reshape(n, width) % 997) / 7


def write(path, table: pa.Table, **kw):
    """One row group, pages of about 1 KiB: many pages to cut at."""
    kw = {"row_group_size": None, "data_page_size": 1024, **kw}
    pq.write_table(table, path, **kw)
    assert pq.ParquetFile(path).metadata.num_row_groups == 1
    return path


def vector_table(values: list, ids=None) -> pa.Table:
    cols = {"x": pa.array(values, type=pa.list_(pa.float32()))}
    if ids is not None:
        cols = {"id": ids, **cols}
    return pa.table(cols)


@pytest.fixture
def small_pieces(monkeypatch):
    """The rows each piece decoded (as planned) starts at, in its row group."""
    firsts = []
    decode = parquet_in.decode_piece

    def decoded(piece, *a):
        chunks = decode(piece, *a)
        firsts.append(piece.first)  # decoded as planned: not read again front to back
        return chunks

    monkeypatch.setattr(parquet_in, "decode_piece", decoded)
    return firsts


def front_to_back(spec, monkeypatch=None, **kw):
    """What read_batches gives with each row group decoded whole by pyarrow."""
    return everything(spec, tuning=WHOLE, **kw)


def same_reads(a, b) -> None:
    ids_a, rejects_a, batches_a = a
    ids_b, rejects_b, batches_b = b
    assert [int(i) if not isinstance(i, str) else i for i in ids_a] == [
        int(i) if not isinstance(i, str) else i for i in ids_b]
    assert [(r.index, r.id, r.where, r.reason) for r in rejects_a] == [
        (r.index, r.id, r.where, r.reason) for r in rejects_b]
    assert [w for b in batches_a for w in b.where] == [w for b in batches_b for w in b.where]
    xa = [np.asarray(x) for b in batches_a for x in b.fields["x"]]
    xb = [np.asarray(x) for b in batches_b for x in b.fields["x"]]
    assert len(xa) == len(xb) and all(np.array_equal(p, q) for p, q in zip(xa, xb))


def test_pieces_equal_the_plain_read(tmp_path):
    """plan_pieces against pyarrow's own read of the row group, column by column."""
    path = write(tmp_path / "d.parquet", vector_table(vectors().tolist(), ids=[f"r{i}" for i in
                                                                             range(N)]))
    meta = pq.ParquetFile(path).metadata
    pieces = plan_pieces(path, meta, 0, {"id": 1, "x": 6}, 500)
    assert pieces is not None and len(pieces) > 2
    assert [p.first for p in pieces] == sorted(p.first for p in pieces)
    assert sum(p.rows for p in pieces) == N
    got = pa.Table.from_batches([p.read() for p in pieces])
    assert got.to_pydict() == pq.read_table(path, columns=["id", "x"]).to_pydict()


@pytest.mark.parametrize("kw", [
    {}, {"compression": "none"}, {"compression": "zstd"}, {"use_dictionary": False},
    {"data_page_version": "2.0"}, {"write_page_index": True}])
@pytest.mark.parametrize("start,stop", [(0, None), (777, 2222), (2999, None)])
def test_pieces_read_what_the_row_group_holds(tmp_path, monkeypatch, small_pieces, kw, start,
                                              stop):
    path = write(tmp_path / "d.parquet", vector_table(vectors().tolist(), ids=np.arange(N) * 3),
                 **kw)
    spec = make_spec(path, VEC, id_field="id", batch_size=5)
    got = everything(spec, start=start, stop=stop)
    assert small_pieces  # decoded as planned, not read front to back after a failure
    if start == 0 and stop is None:
        assert len(small_pieces) > 2 and min(small_pieces) == 0
    assert [int(i) for i in got[0]] == [3 * i for i in range(N)[start:stop]]
    same_reads(got, front_to_back(spec, monkeypatch, start=start, stop=stop))


def test_pieces_of_nested_lists_and_string_ids(tmp_path, monkeypatch, small_pieces):
    values = vectors().reshape(N, 2, 3).tolist()
    table = pa.table({"id": [f"r{i}" for i in range(N)],
                      "x": pa.array(values, type=pa.list_(pa.list_(pa.float32())))})
    path = write(tmp_path / "d.parquet", table)
    spec = make_spec(path, GRID, id_field="id", batch_size=4)
    got = everything(spec)
    assert len(small_pieces) > 2
    assert got[0] == [f"r{i}" for i in range(N)]
    same_reads(got, front_to_back(spec, monkeypatch))


def test_rows_starting_mid_page_are_cut_only_where_a_row_starts(tmp_path, monkeypatch,
                                                                 small_pieces):
    """7 values a row: pages end at multiples of pyarrow's 1024-value mini-batches, most of
    them inside a row."""
    values = vectors(N, 7).tolist()
    path = write(tmp_path / "d.parquet", vector_table(values))
    spec = make_spec(path, {"x": {"shape": ["batch", 7], "dtype": "float32"}}, batch_size=8)
    got = everything(spec)
    assert len(small_pieces) > 2
    assert sum(len(b) for b in got[2]) == N
    same_reads(got, front_to_back(spec, monkeypatch))


@pytest.mark.parametrize("bad", ["short and long", "null row", "null value", "short"])
def test_records_of_another_size_read_as_before(tmp_path, monkeypatch, small_pieces, bad):
    """Rows of 5 and 7 floats (their sum as if both had 6), a null row, a null value, a short
    row: each rejected at its own ordinal, as when the row group is read front to back."""
    values = vectors().tolist()
    if bad == "short and long":
        values[1000] = values[1000][:5]
        values[1700] = values[1700] + [1.0]
    elif bad == "null row":
        values[1500] = None
    elif bad == "null value":
        values[1500][2] = None
    else:
        values[40] = values[40][:5]
    path = write(tmp_path / "d.parquet", vector_table(values, ids=np.arange(N)))
    spec = make_spec(path, VEC, id_field="id", batch_size=5, on_bad_record="skip")
    got = everything(spec)
    assert got[1] and sum(len(b) for b in got[2]) == N - len(got[1])
    same_reads(got, front_to_back(spec, monkeypatch))


def test_a_piece_that_does_not_match_its_plan_reads_the_rest_front_to_back(
        tmp_path, monkeypatch, small_pieces):
    path = write(tmp_path / "d.parquet", vector_table(vectors().tolist(), ids=np.arange(N)))
    spec = make_spec(path, VEC, id_field="id", batch_size=5)
    read = Piece.read

    def third_fails(piece):
        if piece.first == third:
            raise PieceMismatch("as if")
        return read(piece)

    everything(spec)
    third = sorted(small_pieces)[2]
    small_pieces.clear()

    monkeypatch.setattr(Piece, "read", third_fails)
    got = everything(spec)
    assert [int(i) for i in got[0]] == list(range(N))
    assert third not in small_pieces and min(small_pieces) < third
    same_reads(got, front_to_back(spec, monkeypatch))


def test_a_row_group_that_cannot_be_cut_is_streamed(tmp_path, monkeypatch, small_pieces):
    """An input of a varying length per record: no count of values per row to cut pages by."""
    seq = {"x": {"shape": ["batch", "seq"], "dtype": "float32"}}
    values = [[float(i)] * (1 + i % 4) for i in range(N)]
    path = write(tmp_path / "d.parquet", vector_table(values))
    spec = seq_spec(path, seq)
    got = everything(spec)
    assert small_pieces == [] and sum(len(b) for b in got[2]) == N


def seq_spec(path, inputs) -> PipelineSpec:
    return PipelineSpec.model_validate({
        "version": 1, "name": "t", "model": {"builtin": "mlp"}, "inputs": inputs,
        "outputs": {"y": {"shape": ["batch"]}}, "buckets": {"batch": [1, 4], "seq": [4]},
        "data": {"path": str(path), "batch_size": 4}, "output": {"dir": str(path.parent / "o")}})


def test_a_column_of_too_many_pages_is_read_front_to_back(tmp_path, monkeypatch, small_pieces):
    monkeypatch.setattr(parquet_split, "MAX_PAGES", 10)
    path = write(tmp_path / "d.parquet", vector_table(vectors().tolist(), ids=np.arange(N)))
    spec = make_spec(path, VEC, id_field="id", batch_size=5)
    got = everything(spec)
    assert small_pieces == [] and [int(i) for i in got[0]] == list(range(N))


def test_plan_refuses_what_it_cannot_cut(tmp_path):
    path = write(tmp_path / "d.parquet", vector_table(vectors().tolist()))
    meta = pq.ParquetFile(path).metadata
    assert plan_pieces(path, meta, 0, {"x": 6}, 500) is not None
    assert plan_pieces(path, meta, 0, {"x": 5}, 500) is None  # counts do not add up
    assert plan_pieces(path, meta, 0, {"x": 6}, N) is None  # one piece
    assert plan_pieces(path, meta, 0, {"x": 6, "y": 1}, 500) is None  # no such column


def test_a_damaged_page_in_a_piece_names_the_file(tmp_path, monkeypatch, small_pieces):
    """A page whose levels cannot be decoded, late in the row group: the pieces before it are
    read, its piece fails, and the rest of the row group read front to back raises an
    InputError naming the file."""
    path = write(tmp_path / "d.parquet", vector_table(vectors().tolist(), ids=np.arange(N)),
                 compression="none", use_dictionary=False)
    pieces = plan_pieces(path, pq.ParquetFile(path).metadata, 0, {"id": 1, "x": 6}, 600)
    column, _, end, _ = pieces[-1].parts[1]
    page = column.pages[end - 1]
    body = page.offset + page.size - page.header[3]  # its repetition levels' byte length first
    raw = bytearray(path.read_bytes())
    raw[body:body + 4] = b"\xff" * 4
    path.write_bytes(bytes(raw))
    spec = make_spec(path, VEC, id_field="id", batch_size=5)
    read = []
    with pytest.raises(InputError, match=r"^d\.parquet: cannot decode the Parquet file"):
        for batch in read_batches(spec, tuning=SMALL):
            read += [int(i) for i in batch.ids]
    assert sorted(small_pieces) == [0, 1024]  # the third failed
    assert read == list(range(len(read))) and len(read) >= 2000


@pytest.mark.parametrize("start,stop", [(0, None), (1500, 3700), (2100, 2200)])
def test_big_and_small_row_groups_keep_file_order(tmp_path, monkeypatch, small_pieces, start,
                                                  stop):
    """Row groups of 2000, 200 and 2000 records: the big ones cut into pieces, the small one
    decoded whole, all read in file order wherever start and stop fall."""
    table = vector_table(vectors(4200).tolist(), ids=np.arange(4200))
    path = tmp_path / "d.parquet"
    with pq.ParquetWriter(path, table.schema, data_page_size=1024) as w:
        for lo, n in [(0, 2000), (2000, 200), (2200, 2000)]:
            w.write_table(table.slice(lo, n), row_group_size=n)
    tuning = Tuning(parquet_group_bytes=20 << 10, parquet_piece_bytes=16 << 10,
                    parquet_threads=3)  # the 200 are ~7 KiB
    groups = []
    decode = parquet_in.decode_group
    monkeypatch.setattr(parquet_in, "decode_group", lambda path, tuning, meta, group, *a: (
        groups.append(group), decode(path, tuning, meta, group, *a))[1])
    spec = make_spec(path, VEC, id_field="id", batch_size=7)
    got = everything(spec, tuning=tuning, start=start, stop=stop)
    assert [int(i) for i in got[0]] == list(range(4200))[start:stop]
    if stop is None:
        assert groups == [1] and len(small_pieces) >= 4
    same_reads(got, front_to_back(spec, monkeypatch, start=start, stop=stop))


@pytest.mark.skipif(not hasattr(os, "getpriority") or sys.platform != "linux",
                    reason="a thread's own priority is Linux's")
def test_decoding_threads_run_below_the_process_priority(tmp_path, monkeypatch):
    import threading

    seen = []
    decode = parquet_in.decode_group

    def noted(*a):
        seen.append(os.getpriority(os.PRIO_PROCESS, threading.get_native_id()))
        return decode(*a)

    monkeypatch.setattr(parquet_in, "decode_group", noted)
    table = vector_table(vectors().tolist())
    pq.write_table(table, tmp_path / "d.parquet", row_group_size=500)
    spec = make_spec(tmp_path / "d.parquet", VEC, batch_size=5)
    assert sum(len(b) for b in read_batches(spec, tuning=WHOLE)) == N
    mine = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    assert len(seen) == 6 and set(seen) == {min(19, mine + WHOLE.parquet_nice)}


@pytest.mark.parametrize("seed", range(24))
def test_random_files_read_as_front_to_back(tmp_path, monkeypatch, small_pieces, seed):
    """Random widths, nesting, page sizes, codecs, page versions, ids, bad records and
    start/stop: what the pieces give is what the row group read front to back gives."""
    rng = np.random.default_rng(seed)
    n = int(rng.integers(400, 2500))
    inner = [int(rng.integers(1, 4))] if rng.random() < 0.3 else []
    width = int(rng.integers(1, 10))
    shape = [width, *inner]
    values = (rng.standard_normal((n, *shape)).astype(np.float32)).tolist()
    bad = rng.random() < 0.35  # a null row or one of another size: the plan may refuse
    for i in rng.choice(n, size=int(rng.integers(1, 4)) if bad else 0, replace=False).tolist():
        kind = rng.integers(0, 3)
        values[i] = None if kind == 0 else values[i][:-1] if kind == 1 and width > 1 else \
            values[i] + values[i][:1]
    t = pa.list_(pa.float32())
    cols = {"x": pa.array(values, type=pa.list_(t) if inner else t)}
    ids = rng.random() < 0.7
    if ids:
        cols = {"id": [f"k{i}" for i in range(n)] if rng.random() < 0.5 else np.arange(n),
                **cols}
    kw = {"data_page_size": int(rng.integers(64, 2048)),
          "write_batch_size": int(rng.integers(16, 512)),  # values a page holds at least
          "compression": str(rng.choice(["snappy", "zstd", "none", "gzip"])),
          "use_dictionary": bool(rng.random() < 0.5),
          "data_page_version": str(rng.choice(["1.0", "2.0"]))}
    path = write(tmp_path / "d.parquet", pa.table(cols), **kw)
    tuning = Tuning(parquet_group_bytes=1024, parquet_threads=3,
                    parquet_piece_bytes=int(rng.integers(2, 8)) << 10)
    inputs = {"x": {"shape": ["batch", *shape], "dtype": "float32"}}
    start = int(rng.integers(0, n // 2)) if rng.random() < 0.5 else 0
    stop = int(rng.integers(start + 1, n + 1)) if rng.random() < 0.5 else None
    spec = make_spec(path, inputs, batch_size=int(rng.integers(1, 9)), on_bad_record="skip",
                     **({"id_field": "id"} if ids else {}))
    got = everything(spec, tuning=tuning, start=start, stop=stop)
    meta = pq.ParquetFile(path).metadata
    piece_rows = max(1, n * tuning.parquet_piece_bytes // parquet_in.decoded_bytes(
        meta.row_group(0), spec))
    planned = plan_pieces(path, meta, 0, parquet_in.values_per_row(spec), piece_rows)
    assert planned is not None or bad  # these seeds' good files all have pages to cut at
    assert small_pieces or planned is None  # planned, then decoded as planned
    same_reads(got, front_to_back(spec, monkeypatch, start=start, stop=stop))


@pytest.mark.parametrize("kind", ["required", "large_list", "fixed_size_list", "float16"])
def test_other_list_types_read_as_front_to_back(tmp_path, monkeypatch, small_pieces, kind):
    """Non-nullable items and lists, large and fixed-size lists, half floats: the pieces'
    footers carry no Arrow schema, so each decodes to a plain list of the Parquet type."""
    x = vectors()
    if kind == "float16":
        x = x.astype(np.float16)
    flat = pa.array(x.reshape(-1))
    if kind == "required":
        item = pa.field("item", flat.type, nullable=False)
        col = pa.ListArray.from_arrays(pa.array(np.arange(0, x.size + 1, 6, dtype=np.int32)),
                                       flat, type=pa.list_(item))
        schema = pa.schema([pa.field("x", pa.list_(item), nullable=False)])
        table = pa.Table.from_arrays([col], schema=schema)
    elif kind == "large_list":
        table = pa.table({"x": pa.LargeListArray.from_arrays(
            pa.array(np.arange(0, x.size + 1, 6, dtype=np.int64)), flat)})
    elif kind == "fixed_size_list":
        table = pa.table({"x": pa.FixedSizeListArray.from_arrays(flat, 6)})
    else:
        table = pa.table({"x": pa.ListArray.from_arrays(
            pa.array(np.arange(0, x.size + 1, 6, dtype=np.int32)), flat)})
    path = write(tmp_path / "d.parquet", table)
    dtype = "float16" if kind == "float16" else "float32"
    spec = make_spec(path, {"x": {"shape": ["batch", 6], "dtype": dtype}}, batch_size=5)
    got = everything(spec)
    assert len(small_pieces) > 2 and sum(len(b) for b in got[2]) == N
    same_reads(got, front_to_back(spec, monkeypatch))


@pytest.mark.parametrize("layout", ["row groups", "one big row group"])
def test_parquet_reads_the_records_an_npy_file_holds(tmp_path, layout, small_pieces):
    """The same records as .npy and as Parquet (row groups of 700, or one row group cut into
    pieces): the same values, ordinals and batches."""
    x = vectors()
    np.save(tmp_path / "x.npy", x)
    table = pa.table({"x": pa.ListArray.from_arrays(
        pa.array(np.arange(0, x.size + 1, 6, dtype=np.int32)), pa.array(x.reshape(-1)))})
    if layout == "row groups":
        pq.write_table(table, tmp_path / "x.parquet", row_group_size=700)
    else:
        write(tmp_path / "x.parquet", table)
    want = everything(make_spec(tmp_path / "x.npy", VEC, batch_size=16))
    got = everything(make_spec(tmp_path / "x.parquet", VEC, batch_size=16))
    assert [len(b) for b in got[2]] == [len(b) for b in want[2]]
    assert [b.indices.tolist() for b in got[2]] == [b.indices.tolist() for b in want[2]]
    np.testing.assert_array_equal(np.concatenate([b.fields["x"] for b in got[2]]), x)
    assert (len(small_pieces) > 2) == (layout == "one big row group")
