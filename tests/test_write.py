"""The write step: shards, rejects, journal, resume, and the output folder's guards."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from graphrun.errors import OutputError
from graphrun.spec import PipelineSpec
from graphrun import sinks
from graphrun.write import ShardWriter, prepare_out_dir, read_journal, sha256_file

FP = {"spec_sha256": "a" * 64, "input_sha256": "b" * 64}


def make_spec(tmp_path: Path, fmt: str = "npy", rows_per_file: int = 3,
              outputs: dict | None = None) -> PipelineSpec:
    return PipelineSpec.model_validate({
        "version": 1, "name": "t", "model": {"builtin": "mlp"},
        "inputs": {"x": {"shape": ["batch", 4]}},
        "outputs": outputs or {"y": {"shape": ["batch", 2]}},
        "buckets": {"batch": [1, 2, 4], "seq": [2, 4]},
        "data": {"path": str(tmp_path / "in.jsonl")},
        "output": {"dir": str(tmp_path / "out"), "format": fmt, "rows_per_file": rows_per_file},
    })


RAGGED = {"y": {"shape": ["batch", 2]}, "h": {"shape": ["batch", "seq", 2]},
          "s": {"shape": ["batch"]}}


def make_rows(n: int, ragged: bool, seed: int = 0) -> dict:
    """n records' outputs: y [n, 2] float32; with ragged, h [len_i, 2] and s [n] int64."""
    rng = np.random.default_rng(seed)
    rows = {"y": rng.standard_normal((n, 2)).astype(np.float32)}
    if ragged:
        rows["h"] = [rng.standard_normal((i % 4, 2)).astype(np.float32) for i in range(n)]
        rows["s"] = np.arange(n, dtype=np.int64) * 10
    return rows


def take(rows: dict, idx: list[int]) -> dict:
    return {k: [v[i] for i in idx] if isinstance(v, list) else v[idx] for k, v in rows.items()}


def feed(writer: ShardWriter, rows: dict, ids: list, start: int, batch: int,
         rejected: set[int], stop_after: int | None = None) -> None:
    """Stream records start.. as the pipeline does: per batch of `batch` records, rejects
    first, then the good rows. stop_after: give up after that many batches (a crash)."""
    n = len(ids)
    for k, b in enumerate(range(start, n, batch)):
        if stop_after is not None and k == stop_after:
            return
        span = range(b, min(b + batch, n))
        for i in span:
            if i in rejected:
                writer.reject(i, ids[i], "read", f"record {i} is bad")
        good = [i for i in span if i not in rejected]
        if good:
            writer.write(np.array(good), [ids[i] for i in good], take(rows, good), batch_start=b)


def dir_bytes(d: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(d.iterdir())}


def journal_lines(d: Path) -> list[dict]:
    return [json.loads(line) for line in (d / "journal.jsonl").read_text().splitlines()]


# --- shards and formats ---

def test_npy_shards_follow_rows_per_file_across_batches(tmp_path):
    out = tmp_path / "out"
    w = ShardWriter(make_spec(tmp_path), out)
    rows = make_rows(8, ragged=False)
    start = 0
    for n in (2, 5, 1):
        idx = list(range(start, start + n))
        w.write(np.array(idx), [100 + i for i in idx], take(rows, idx))
        start += n
    files = w.close()

    assert [(f.path, f.rows) for f in files] == [
        ("part-00000.ids.npy", 3), ("part-00000.y.npy", 3),
        ("part-00001.ids.npy", 3), ("part-00001.y.npy", 3),
        ("part-00002.ids.npy", 2), ("part-00002.y.npy", 2)]
    for f in files:
        assert f.sha256 == sha256_file(out / f.path)
        assert f.bytes == (out / f.path).stat().st_size
    ids = np.concatenate([np.load(out / f"part-0000{k}.ids.npy") for k in range(3)])
    y = np.concatenate([np.load(out / f"part-0000{k}.y.npy") for k in range(3)])
    assert ids.dtype == np.int64 and ids.tolist() == list(range(100, 108))
    assert y.dtype == np.float32 and np.array_equal(y, rows["y"])
    assert w.rows_written == 8
    assert not list(out.glob(".*.tmp"))


def test_npy_dtypes_ids_and_bfloat16_rounding(tmp_path):
    spec = make_spec(tmp_path, rows_per_file=10, outputs={
        "half": {"shape": ["batch", 2], "dtype": "float16"},
        "keep": {"shape": ["batch"]},
        "bf": {"shape": ["batch", 3], "dtype": "bfloat16"}})
    w = ShardWriter(spec, tmp_path / "out")
    bf = np.array([[1 + 2 ** -8, 1 + 3 * 2 ** -8, np.nan],
                   [-(1 + 2 ** -8), np.finfo(np.float32).max, np.inf]], dtype=np.float32)
    w.write(np.array([0, 1]), ["a", 7],
            {"half": np.ones((2, 2), np.float64) / 3, "keep": np.array([5, 6], np.int32),
             "bf": bf})
    w.close()
    out = tmp_path / "out"
    half = np.load(out / "part-00000.half.npy")
    assert half.dtype == np.float16 and np.array_equal(half, np.full((2, 2), 1 / 3, np.float16))
    keep = np.load(out / "part-00000.keep.npy")
    assert keep.dtype == np.int32 and keep.tolist() == [5, 6]
    got = np.load(out / "part-00000.bf.npy")
    assert got.dtype == np.float32
    # ties go to the even bfloat16 (7 mantissa bits); too large rounds to inf; NaN stays NaN
    assert got[0, :2].tolist() == [1.0, 1 + 2 ** -6]
    assert np.isnan(got[0, 2])
    assert got[1].tolist() == [-1.0, np.inf, np.inf]
    ids = np.load(out / "part-00000.ids.npy")
    assert ids.dtype.kind == "U" and ids.tolist() == ["a", "7"]


def test_jsonl_lines_hold_id_and_nested_outputs(tmp_path):
    spec = make_spec(tmp_path, "jsonl", rows_per_file=4, outputs=RAGGED)
    w = ShardWriter(spec, tmp_path / "out")
    rows = make_rows(5, ragged=True)
    ids = ["r0", 1, np.int64(2), "r3", 4]
    w.write(np.arange(5), ids, rows)
    files = w.close()
    assert [(f.path, f.rows) for f in files] == [("part-00000.jsonl", 4), ("part-00001.jsonl", 1)]
    lines = [json.loads(line) for k in range(2)
             for line in (tmp_path / "out" / f"part-0000{k}.jsonl").read_text().splitlines()]
    assert [line["id"] for line in lines] == ["r0", 1, 2, "r3", 4]
    for i, line in enumerate(lines):
        assert list(line) == ["id", "y", "h", "s"]
        assert line["y"] == rows["y"][i].tolist()
        assert line["h"] == rows["h"][i].tolist()
        assert line["s"] == 10 * i


def test_parquet_table_holds_id_scalar_and_ragged_list_columns(tmp_path):
    spec = make_spec(tmp_path, "parquet", rows_per_file=10, outputs=RAGGED)
    w = ShardWriter(spec, tmp_path / "out")
    rows = make_rows(6, ragged=True)
    w.write(np.arange(3), [0, 1, 2], take(rows, [0, 1, 2]))
    w.write(np.arange(3, 6), [3, 4, 5], take(rows, [3, 4, 5]))
    (info,) = w.close()
    table = pq.read_table(tmp_path / "out" / info.path)
    assert info.rows == 6 and table.num_rows == 6
    assert table.schema.field("id").type == pa.int64()
    h_type = table.schema.field("h").type
    assert pa.types.is_list(h_type) and pa.types.is_list(h_type.value_type)
    assert h_type.value_type.value_type == pa.float32()
    assert table.schema.field("s").type == pa.int64()
    got = table.to_pydict()
    assert got["id"] == list(range(6))
    assert got["y"] == rows["y"].tolist()
    assert got["h"] == [h.tolist() for h in rows["h"]]  # lengths 0, 1, 2, 3, 0, 1
    assert got["s"] == rows["s"].tolist()


def test_parquet_string_ids_and_row_groups_cut_by_bytes(tmp_path, monkeypatch):
    monkeypatch.setattr(sinks._ParquetSink, "row_group_bytes", 40)  # 5 rows of y (8 B)
    w = ShardWriter(make_spec(tmp_path, "parquet", rows_per_file=12), tmp_path / "out")
    rows = make_rows(12, ragged=False)
    for b in range(0, 12, 7):
        idx = list(range(b, min(b + 7, 12)))
        w.write(np.array(idx), [f"k{i}" for i in idx], take(rows, idx))
    (info,) = w.close()
    meta = pq.ParquetFile(tmp_path / "out" / info.path).metadata
    assert [meta.row_group(g).num_rows for g in range(meta.num_row_groups)] == [5, 5, 2]
    table = pq.read_table(tmp_path / "out" / info.path)
    assert table.column("id").to_pylist() == [f"k{i}" for i in range(12)]
    assert table.column("y").to_pylist() == rows["y"].tolist()


def test_temp_files_exist_only_while_a_shard_fills(tmp_path):
    out = tmp_path / "out"
    w = ShardWriter(make_spec(tmp_path, rows_per_file=4), out)
    rows = make_rows(5, ragged=False)
    w.write(np.arange(5), list(range(5)), rows)
    assert sorted(p.name for p in out.glob(".*.tmp")) == [".part-00001.y.npy.tmp"]
    w.close()
    assert not list(out.glob(".*.tmp"))
    assert sorted(p.name for p in out.iterdir()) == [
        "journal.jsonl", "part-00000.ids.npy", "part-00000.y.npy", "part-00001.ids.npy",
        "part-00001.y.npy"]


# --- journal and rejects ---

def test_journal_and_rejects_when_a_shard_ends_mid_batch(tmp_path):
    out = tmp_path / "out"
    w = ShardWriter(make_spec(tmp_path, "jsonl", rows_per_file=3), out)
    rows = make_rows(6, ragged=False)
    # one batch of records 0..5: 2 and 5 are bad; shard 0 = rows 0, 1, 3, shard 1 = row 4
    feed(w, rows, [f"r{i}" for i in range(6)], 0, 6, rejected={2, 5})
    journal_after_first = journal_lines(out)
    files = w.close()
    reject_lines = (out / "rejects.jsonl").read_bytes().splitlines(keepends=True)
    assert [json.loads(line) for line in reject_lines] == [
        {"index": 2, "id": "r2", "where": "read", "reason": "record 2 is bad"},
        {"index": 5, "id": "r5", "where": "read", "reason": "record 5 is bad"}]
    first = len(reject_lines[0])
    lines = journal_lines(out)
    assert lines[:1] == journal_after_first
    assert [(j["shard"], j["rows"], j["next_index"], j["rejects"], j["rejects_bytes"])
            for j in lines] == [(0, 3, 4, 1, first), (1, 4, 5, 1, first)]
    assert lines[0]["files"] == [
        {"path": f.path, "rows": f.rows, "sha256": f.sha256, "bytes": f.bytes} for f in files[:1]]
    point = read_journal(out)
    assert (point.next_index, point.shard, point.rows, point.rejects, point.rejects_bytes) == (
        5, 2, 4, 1, first)
    assert point.files == files
    assert w.rows_written == 4 and w.rejects_written == 2


def test_read_journal_ignores_a_torn_last_line(tmp_path):
    out = tmp_path / "out"
    w = ShardWriter(make_spec(tmp_path, rows_per_file=2), out)
    w.write(np.arange(3), [0, 1, 2], make_rows(3, ragged=False))
    with open(out / "journal.jsonl", "ab") as f:
        f.write(b'{"shard": 1, "fi')
    point = read_journal(out)
    assert (point.shard, point.next_index, point.rows) == (1, 2, 2)


def test_read_journal_refuses_a_corrupt_middle_line(tmp_path):
    (tmp_path / "journal.jsonl").write_text('not json\n{"shard": 0}\n')
    with pytest.raises(OutputError, match=r"journal.jsonl:1 .*--overwrite"):
        read_journal(tmp_path)
    assert read_journal(tmp_path / "absent") is None


# --- crash and resume ---

@pytest.mark.parametrize("fmt", ["npy", "jsonl", "parquet"])
def test_resume_after_a_crash_equals_an_uninterrupted_run(tmp_path, monkeypatch, fmt):
    monkeypatch.setattr(sinks._ParquetSink, "row_group_bytes", 48)
    spec = make_spec(tmp_path, fmt, rows_per_file=4, outputs=None if fmt == "npy" else RAGGED)
    n, rejected = 22, {2, 7, 8, 15, 20, 21}
    rows, ids = make_rows(n, ragged=fmt != "npy"), [f"id{i}" for i in range(n)]

    whole = tmp_path / "whole"
    prepare_out_dir(whole, resume=False, overwrite=False, fingerprint=FP)
    w = ShardWriter(spec, whole)
    feed(w, rows, ids, 0, 5, rejected)
    whole_files = w.close()

    crashed = tmp_path / "crashed"
    prepare_out_dir(crashed, resume=False, overwrite=False, fingerprint=FP)
    dead = ShardWriter(spec, crashed)
    # records 0..9: shard 0 = rows 0, 1, 3, 4 committed; rows 5, 6, 9 in temp files
    feed(dead, rows, ids, 0, 5, rejected, stop_after=2)
    assert list(crashed.glob(".*.tmp"))
    # What else a crash can leave: a shard renamed before its journal line, a torn journal
    # line, a reject past the last commit, a temp file of a later shard.
    suffix = {"npy": "y.npy", "jsonl": "jsonl", "parquet": "parquet"}[fmt]
    (crashed / f"part-00001.{suffix}").write_bytes(b"half a shard")
    with open(crashed / "journal.jsonl", "ab") as f:
        f.write(b'{"shard": 1, "files": [{"pa')
    with open(crashed / "rejects.jsonl", "ab") as f:
        f.write(b'{"index": 7}\n')
    (crashed / ".part-00009.jsonl.tmp").write_bytes(b"junk")
    (crashed / f"part-00099.{suffix}").write_bytes(b"no journal line lists this shard")

    point = prepare_out_dir(crashed, resume=True, overwrite=False, fingerprint=FP)
    assert (point.next_index, point.shard, point.rows, point.rejects) == (5, 1, 4, 1)
    # Reading restarts at the start of the batch that held the last committed row; the rows
    # and rejects of it that were committed already are dropped by the writer.
    assert point.start == 0
    w = ShardWriter(spec, crashed, resume=point)
    feed(w, rows, ids, point.start, 5, rejected)
    files = w.close()

    assert files == whole_files
    assert w.rows_written == n - len(rejected) and w.rejects_written == len(rejected)
    assert dir_bytes(crashed) == dir_bytes(whole)
    reject_index = [json.loads(line)["index"]
                    for line in (crashed / "rejects.jsonl").read_text().splitlines()]
    assert reject_index == sorted(rejected)


def test_resume_with_nothing_committed_starts_over(tmp_path):
    out = tmp_path / "out"
    prepare_out_dir(out, resume=False, overwrite=False, fingerprint=FP)
    w = ShardWriter(make_spec(tmp_path, rows_per_file=10), out)
    w.reject(0, "a", "read", "bad")
    w.write(np.array([1, 2]), [1, 2], make_rows(2, ragged=False))  # flushes the reject
    assert (out / "rejects.jsonl").exists() and list(out.glob(".*.tmp"))
    assert prepare_out_dir(out, resume=True, overwrite=False, fingerprint=FP) is None
    assert [p.name for p in out.iterdir()] == ["run.json"]
    ShardWriter(make_spec(tmp_path, rows_per_file=10), out).close()


def test_resume_refuses_a_missing_or_changed_shard(tmp_path):
    out = tmp_path / "out"
    spec = make_spec(tmp_path, rows_per_file=2)
    w = ShardWriter(spec, out)
    w.write(np.arange(4), [0, 1, 2, 3], make_rows(4, ragged=False))
    w.close()
    data = (out / "part-00001.y.npy").read_bytes()
    (out / "part-00001.y.npy").write_bytes(data[:-1] + bytes([data[-1] ^ 1]))
    with pytest.raises(OutputError, match=r"part-00001\.y\.npy differs .*--overwrite"):
        ShardWriter(spec, out, resume=read_journal(out))
    (out / "part-00000.ids.npy").unlink()
    with pytest.raises(OutputError, match=r"part-00000\.ids\.npy .* missing; rerun with "
                                          r"--overwrite"):
        ShardWriter(spec, out, resume=read_journal(out))


def test_fresh_writer_refuses_a_folder_with_a_run(tmp_path):
    out = tmp_path / "out"
    spec = make_spec(tmp_path)
    ShardWriter(spec, out).write(np.arange(3), [0, 1, 2], make_rows(3, ragged=False))
    with pytest.raises(OutputError, match="journal.jsonl"):
        ShardWriter(spec, out)


# --- the output folder ---

def test_prepare_creates_the_folder_and_records_the_fingerprint(tmp_path):
    out = tmp_path / "a" / "b"
    assert prepare_out_dir(out, resume=False, overwrite=False, fingerprint=FP) is None
    assert json.loads((out / "run.json").read_text()) == FP
    assert [p.name for p in out.iterdir()] == ["run.json"]


def test_prepare_refuses_an_existing_run_without_flags(tmp_path):
    prepare_out_dir(tmp_path / "out", resume=False, overwrite=False, fingerprint=FP)
    with pytest.raises(OutputError, match=r"exists and holds a run; pass --resume to continue "
                                          r"it or --overwrite to replace it"):
        prepare_out_dir(tmp_path / "out", resume=False, overwrite=False, fingerprint=FP)
    with pytest.raises(OutputError, match="exclude each other"):
        prepare_out_dir(tmp_path / "out", resume=True, overwrite=True, fingerprint=FP)
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "notes.txt").write_text("mine")
    with pytest.raises(OutputError, match=r"not empty \(notes.txt\)"):
        prepare_out_dir(tmp_path / "other", resume=False, overwrite=False, fingerprint=FP)


def test_resume_refuses_a_changed_fingerprint_naming_what_changed(tmp_path):
    prepare_out_dir(tmp_path / "out", resume=False, overwrite=False, fingerprint=FP)
    changed = {**FP, "input_sha256": "c" * 64}
    with pytest.raises(OutputError) as err:
        prepare_out_dir(tmp_path / "out", resume=True, overwrite=False, fingerprint=changed)
    assert "input_sha256 changed" in str(err.value) and "spec_sha256" not in str(err.value)
    assert "--overwrite" in str(err.value)
    (tmp_path / "bare").mkdir()
    (tmp_path / "bare" / "journal.jsonl").write_text("")
    with pytest.raises(OutputError, match="no run.json"):
        prepare_out_dir(tmp_path / "bare", resume=True, overwrite=False, fingerprint=FP)


def test_overwrite_removes_only_graphrun_files(tmp_path):
    out = tmp_path / "out"
    prepare_out_dir(out, resume=False, overwrite=False, fingerprint=FP)
    w = ShardWriter(make_spec(tmp_path, rows_per_file=2), out)
    w.reject(3, 3, "read", "bad")
    w.write(np.arange(3), [0, 1, 2], make_rows(3, ragged=False))
    w.close()
    for name in ("manifest.json", "latencies.jsonl", ".part-00007.y.npy.tmp"):
        (out / name).write_text("x")
    (out / "notes.txt").write_text("mine")
    (out / "plots").mkdir()
    before = sorted(p.name for p in out.iterdir())
    with pytest.raises(OutputError, match=r"did not write \(notes.txt, plots\)"):
        prepare_out_dir(out, resume=False, overwrite=True, fingerprint=FP)
    assert sorted(p.name for p in out.iterdir()) == before
    (out / "notes.txt").unlink()
    (out / "plots").rmdir()
    new = {**FP, "spec_sha256": "d" * 64}
    assert prepare_out_dir(out, resume=False, overwrite=True, fingerprint=new) is None
    assert [p.name for p in out.iterdir()] == ["run.json"]
    assert json.loads((out / "run.json").read_text()) == new


# --- what a format cannot hold ---

def test_npy_refuses_ragged_outputs_and_clashing_names(tmp_path):
    with pytest.raises(OutputError, match="npy cannot hold ragged"):
        ShardWriter(make_spec(tmp_path, outputs=RAGGED), tmp_path / "out")
    with pytest.raises(OutputError, match="'ids' cannot name an npy file"):
        ShardWriter(make_spec(tmp_path, outputs={"ids": {"shape": ["batch"]}}), tmp_path / "o")
    with pytest.raises(OutputError, match="'id' clashes"):
        ShardWriter(make_spec(tmp_path, "jsonl", outputs={"id": {"shape": ["batch"]}}),
                    tmp_path / "o")


def test_write_refuses_rows_out_of_order(tmp_path):
    w = ShardWriter(make_spec(tmp_path), tmp_path / "out")
    w.write(np.array([0, 1]), [0, 1], make_rows(2, ragged=False))
    with pytest.raises(ValueError, match="indices must increase past 1"):
        w.write(np.array([1, 2]), [1, 2], make_rows(2, ragged=False))
