"""Parquet columns read without their levels (parquet_pages._read_flat, formats.PARQUET_FLAT):
the level check says yes exactly where the levels are those of fixed-shape rows without nulls,
and the values read so are those pyarrow reads with the levels."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from graphrun import formats, parquet_pages
from graphrun.parquet_pages import Flat, Levels, levels_match, read_footer, read_piece, whole_piece
from tests.test_parquet_pages import N, front_to_back, same_reads, vectors, write
from tests.test_stream import everything, make_spec


# ---- the level check, against levels encoded here in every layout the hybrid allows ---------

def encode(levels: list[int], width: int, rng) -> bytes:
    """levels as the RLE / bit-packed hybrid, in runs of random kinds and lengths (bit-packed
    runs hold whole groups of 8; the last one may be padded)."""
    out, i = bytearray(), 0
    nbytes = (width + 7) // 8

    def varint(n: int) -> None:
        while n >= 0x80:
            out.append(n & 0x7F | 0x80)
            n >>= 7
        out.append(n)

    while i < len(levels):
        n = int(rng.integers(1, 40))
        run = levels[i:i + n]
        if rng.random() < 0.5 and len(set(run)) == 1:
            varint(len(run) << 1)
            out += run[0].to_bytes(nbytes, "little")
            i += len(run)
            continue
        groups = -(-min(n, len(levels) - i) // 8)
        values = levels[i:i + 8 * groups]
        values = values + [0] * (8 * groups - len(values))
        varint(groups << 1 | 1)
        bits = np.array([(v >> b) & 1 for v in values for b in range(width)], np.uint8)
        out += np.packbits(bits, bitorder="little").tobytes()
        i += 8 * groups
    return bytes(out)


def rows_levels(row: list[int], phase: int, count: int) -> list[int]:
    return [row[(phase + j) % len(row)] for j in range(count)]


@pytest.mark.parametrize("seed", range(40))
def test_levels_match_exactly_the_rows_levels(seed):
    rng = np.random.default_rng(seed)
    dims = [(6,), (7,), (2, 3), (1,), (3, 1, 2)][seed % 5]
    row = parquet_pages._rep_levels(dims).tolist()
    width = max(row).bit_length() or 1
    phase, count = int(rng.integers(0, len(row))), int(rng.integers(1, 400))
    good = rows_levels(row, phase, count)
    levels = Levels(np.array(row))
    data = encode(good, width, rng)
    assert levels_match(data, width, levels, phase, count)
    assert levels_match(data, width, levels, phase, count)  # remembered: the same answer
    # a page's header gives its count; a last bit-packed group may pad up to 7 levels more
    assert not levels_match(data, width, Levels(np.array(row)), phase, count + 8)
    assert not levels_match(data + b"\x00", width, Levels(np.array(row)), phase, count)
    bad = list(good)
    j = int(rng.integers(0, count))
    bad[j] = (bad[j] + 1) % (1 << width) if width > 1 or max(row) == 1 else 1 - bad[j]
    if bad != good:
        assert not levels_match(encode(bad, width, rng), width, Levels(np.array(row)), phase,
                                count)


def test_levels_match_a_long_section_by_its_repeats():
    """Many rows whose encoding repeats row after row (as pyarrow writes 256-value rows) are
    checked without reading every run; a row of another length among them is still found."""
    row = [0] + [1] * 255
    one = bytes([0x03, 0xFE, 0xF0, 0x03, 0x01])  # 8 bit-packed (0, then 1s), then 248 1s
    assert levels_match(one * 5000, 1, Levels(np.array(row)), 0, 256 * 5000)
    short = bytes([0x03, 0xFE, 0xEE, 0x03, 0x01])  # 247 1s after the 8
    assert not levels_match(one * 2000 + short + one * 2999, 1, Levels(np.array(row)), 0,
                            256 * 5000 - 1)
    assert not levels_match(one * 5000, 1, Levels(np.array(row)), 0, 256 * 5001)


def test_definition_levels_of_no_nulls_are_one_run():
    rng = np.random.default_rng(1)
    full = Levels(np.array([3]))
    assert levels_match(encode([3] * 1000, 2, rng), 2, full, 0, 1000)
    assert not levels_match(encode([3] * 500 + [2] + [3] * 499, 2, rng), 2, full, 0, 1000)


# ---- what is read: the same as pyarrow's reading ----------------------------------------------

def flat_calls(monkeypatch) -> list:
    """(column, read without levels?) for each column part _read_flat is asked for."""
    calls = []
    read = parquet_pages._read_flat

    def counted(path, footer, group, part, dims):
        out = read(path, footer, group, part, dims)
        calls.append((part.name, out is not None))
        return out

    monkeypatch.setattr(parquet_pages, "_read_flat", counted)
    return calls


def read_whole(path, shapes):
    with open(path, "rb") as f:
        footer = read_footer(f)
        piece = whole_piece(f, footer, 0, {n: int(np.prod(s)) for n, s in shapes.items()})
    assert piece is not None
    return read_piece(path, footer, piece, Flat(shapes))


@pytest.mark.parametrize("kind", ["float32", "float64", "int32", "int64", "int8", "float16",
                                  "bool", "nested"])
@pytest.mark.parametrize("kw", [{}, {"use_dictionary": False}, {"compression": "zstd"},
                                {"compression": "none", "data_page_version": "2.0"},
                                {"data_page_version": "2.0"}])
def test_values_read_without_levels_are_pyarrows(tmp_path, monkeypatch, kind, kw):
    rng = np.random.default_rng(2)
    dims = (2, 3) if kind == "nested" else (7,)
    dtype = "float32" if kind == "nested" else kind
    values = rng.standard_normal((N, *dims)) * 100
    if kind == "bool":
        values = values > 0
    typ = pa.float32() if kind == "nested" else pa.from_numpy_dtype(np.dtype(dtype))
    for _ in dims:
        typ = pa.list_(typ)
    table = pa.table({"id": [f"r{i}" for i in range(N)],
                      "x": pa.array(values.astype(dtype).tolist(), type=typ)})
    path = write(tmp_path / "d.parquet", table, **kw)
    calls = flat_calls(monkeypatch)
    rb = read_whole(path, {"id": (), "x": dims})
    assert sorted(calls) == [("id", True), ("x", True)]
    assert rb.column("x").to_pylist() == table.column("x").to_pylist()
    assert rb.column("id").to_pylist() == table.column("id").to_pylist()


def test_byte_stream_split_floats(tmp_path, monkeypatch):
    table = pa.table({"x": pa.array(vectors().tolist(), type=pa.list_(pa.float32()))})
    path = write(tmp_path / "d.parquet", table, use_dictionary=False,
                 column_encoding={"x.list.element": "BYTE_STREAM_SPLIT"})
    calls = flat_calls(monkeypatch)
    assert read_whole(path, {"x": (6,)}).column("x").to_pylist() == table.column("x").to_pylist()
    assert calls == [("x", True)]


@pytest.mark.parametrize("bad", ["null value", "null row and a long one", "short and long"])
def test_levels_that_do_not_check_out_are_read_with_them(tmp_path, monkeypatch, bad):
    """Levels in the count that rows of 6 would have, but not theirs (a null row holds one)."""
    values = vectors().tolist()
    if bad == "null value":
        values[2100][3] = None
    elif bad == "null row and a long one":
        values[5], values[6] = None, values[6] + [1.0] * 5
    else:
        values[1000], values[1001] = values[1000][:5], values[1001] + [1.0]
    table = pa.table({"x": pa.array(values, type=pa.list_(pa.float32()))})
    path = write(tmp_path / "d.parquet", table)
    calls = flat_calls(monkeypatch)
    rb = read_whole(path, {"x": (6,)})
    assert calls == [("x", False)]
    assert rb.column("x").to_pylist() == table.column("x").to_pylist()


def test_a_column_is_given_up_on_after_two_misses(tmp_path, monkeypatch):
    """Nulls in every piece: two pieces try without levels, the rest do not try (one
    decoding thread: with more, pieces decoding at once may each try before a miss is
    counted)."""
    monkeypatch.setattr(formats, "PARQUET_FLAT", True)
    monkeypatch.setattr(formats, "PARQUET_THREADS", 1)
    monkeypatch.setattr(formats, "PARQUET_GROUP_BYTES", 1024)
    monkeypatch.setattr(formats, "PARQUET_PIECE_BYTES", 16 << 10)
    values = vectors().tolist()
    for i in range(0, N, 50):
        values[i][1] = None
    path = write(tmp_path / "d.parquet", pa.table({"x": pa.array(values, pa.list_(pa.float32()))}))
    spec = make_spec(path, {"x": {"shape": ["batch", 6], "dtype": "float32"}}, batch_size=5,
                     on_bad_record="skip")
    calls = flat_calls(monkeypatch)
    got = everything(spec)
    assert calls == [("x", False), ("x", False)]
    assert len(got[1]) == N // 50
    same_reads(got, front_to_back(spec, monkeypatch))


def test_flat_keeps_track_of_misses_per_column():
    flat = Flat({"x": (6,), "id": ()})
    assert flat.shape("x") == (6,) and flat.trying()
    flat.missed("x")
    assert flat.shape("x") == (6,)
    flat.missed("x")
    assert flat.shape("x") is None and flat.shape("id") == () and flat.trying()
    flat.missed("id")
    flat.missed("id")
    assert not flat.trying()


@pytest.mark.parametrize("start,stop", [(0, None), (1234, 2500)])
def test_small_row_groups_are_read_whole_without_levels(tmp_path, monkeypatch, start, stop):
    """Row groups too small to cut are read as one piece each, where decoding is short of
    cores (formats.PARQUET_FLAT); records, ids and locations as pyarrow reads them."""
    monkeypatch.setattr(formats, "PARQUET_FLAT", True)
    table = pa.table({"id": np.arange(N) * 2,
                      "x": pa.array(vectors().tolist(), type=pa.list_(pa.float32()))})
    path = tmp_path / "d.parquet"
    pq.write_table(table, path, row_group_size=700)
    spec = make_spec(path, {"x": {"shape": ["batch", 6], "dtype": "float32"}}, id_field="id",
                     batch_size=8)
    calls = flat_calls(monkeypatch)
    got = everything(spec, start=start, stop=stop)
    groups = -(-N // 700)
    assert len(calls) >= 2 * (groups - 2) and all(ok for _, ok in calls)
    assert [int(i) for i in got[0]] == [2 * i for i in range(N)[start:stop]]
    same_reads(got, front_to_back(spec, monkeypatch, start=start, stop=stop))


def small_groups(tmp_path):
    table = pa.table({"x": pa.array(vectors().tolist(), type=pa.list_(pa.float32()))})
    path = tmp_path / "d.parquet"
    pq.write_table(table, path, row_group_size=700)
    return make_spec(path, {"x": {"shape": ["batch", 6], "dtype": "float32"}}, batch_size=8)


def test_many_cores_read_with_levels(tmp_path, monkeypatch):
    """With enough cores to decode with levels (PARQUET_FLAT off), nothing is read without."""
    monkeypatch.setattr(formats, "PARQUET_FLAT", False)
    spec = small_groups(tmp_path)
    calls = flat_calls(monkeypatch)
    got = everything(spec)
    assert calls == [] and sum(len(b) for b in got[2]) == N
