"""The write step: shards, rejects, journal, resume, and the output folder's guards."""

from __future__ import annotations

import json
import os
import threading
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from graphrun.base.errors import OutputError
from graphrun.spec.keys import PipelineSpec
from graphrun.write.sinks import npy as npy_sink
from graphrun.base.tuning import Tuning
from graphrun.write.journal import append_journal, fsync_path
from graphrun.write.shards import (DiskSteps, ShardWriter, prepare_out_dir, read_journal,
                                   sha256_file)

FP = {"spec_sha256": "a" * 64, "input_sha256": "b" * 64,
      "shards": ["ids.npy", "y.npy", "jsonl", "parquet"]}  # the file names of make_spec's runs


def make_spec(tmp_path: Path, fmt: str = "npy", rows_per_file: int = 3,
              outputs: dict | None = None, commit_interval_s: float = 10.0) -> PipelineSpec:
    return PipelineSpec.model_validate({
        "version": 1, "name": "t", "model": {"builtin": "mlp"},
        "inputs": {"x": {"shape": ["batch", 4]}},
        "outputs": outputs or {"y": {"shape": ["batch", 2]}},
        "buckets": {"batch": [1, 2, 4], "seq": [2, 4]},
        "data": {"path": str(tmp_path / "in.jsonl")},
        "output": {"dir": str(tmp_path / "out"), "format": fmt, "rows_per_file": rows_per_file,
                   "commit_interval_s": commit_interval_s},
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


def whole_and_crashed(tmp_path: Path, spec: PipelineSpec, rows: dict, ids: list, batch: int,
                      rejected: set[int], stop_after: int, tuning: Tuning | None = None
                      ) -> tuple[list, Path]:
    """An uninterrupted run's files, and the folder of a run that gave up after stop_after
    batches, its commits done (what a crash leaves)."""
    whole = tmp_path / "whole"
    prepare_out_dir(whole, resume=False, overwrite=False, fingerprint=FP)
    w = ShardWriter(spec, whole, tuning=tuning)
    feed(w, rows, ids, 0, batch, rejected)
    whole_files = w.close()

    crashed = tmp_path / "crashed"
    prepare_out_dir(crashed, resume=False, overwrite=False, fingerprint=FP)
    dead = ShardWriter(spec, crashed, tuning=tuning)
    feed(dead, rows, ids, 0, batch, rejected, stop_after=stop_after)
    dead.wait_for_commits()
    return whole_files, crashed


# --- shards and formats ---

@pytest.mark.parametrize("pool", [False, True], ids=["caller", "row-pool"])
def test_full_npy_shards_are_hashed_as_they_are_written(tmp_path, pool):
    """A full shard's output file is hashed (and flushed) in steps while rows arrive; the commit
    then only finishes that digest. The short last shard, whose header changes, and the ids
    files are hashed whole. Either way the journal holds each file's real sha256, on both the
    caller's and the row pool's write paths, and no descriptor is left open."""
    import hashlib

    whole = []
    fds = len(os.listdir("/proc/self/fd")) if os.path.isdir("/proc/self/fd") else None
    out = tmp_path / "out"
    spec = make_spec(tmp_path, rows_per_file=40, outputs={"y": {"shape": ["batch", 64]}})
    w = ShardWriter(spec, out, tuning=Tuning(row_pool_bytes=2048 if pool else 1 << 30,
                                             row_writers=2,
                                             hash_step_bytes=512),  # 2 rows of 64 float32
                    disk=DiskSteps(sha256=lambda p: whole.append(p.name) or sha256_file(p)))
    rng = np.random.default_rng(0)
    y = rng.standard_normal((100, 64)).astype(np.float32)
    start = 0
    for n in (1, 17, 3, 9, 30, 2, 11, 27):  # 9 rows and more go to the row pool
        idx = np.arange(start, start + n)
        w.write(idx, idx + 1000, {"y": y[idx]})
        start += n
    files = w.close()

    assert [(f.path, f.rows) for f in files] == [
        ("part-00000.ids.npy", 40), ("part-00000.y.npy", 40),
        ("part-00001.ids.npy", 40), ("part-00001.y.npy", 40),
        ("part-00002.ids.npy", 20), ("part-00002.y.npy", 20)]
    for f in files:
        assert f.sha256 == hashlib.sha256((out / f.path).read_bytes()).hexdigest()
    if not pool:  # a pool thread's rows count once written, which timing decides
        assert sorted(whole) == [".part-00000.ids.npy.tmp", ".part-00001.ids.npy.tmp",
                                 ".part-00002.ids.npy.tmp", ".part-00002.y.npy.tmp"]
    got = np.concatenate([np.load(out / f"part-0000{k}.y.npy") for k in range(3)])
    assert np.array_equal(got, y)
    if fds is not None:
        assert len(os.listdir("/proc/self/fd")) == fds


def test_an_interrupted_writer_commits_its_open_shard_and_closes_its_digests(tmp_path):
    """partial=False (an interrupted run): the open shard, hashed in steps so far, is
    committed by an open line on its temp files, its digests and descriptors closed; the
    complete shard is committed as ever."""
    fds = len(os.listdir("/proc/self/fd")) if os.path.isdir("/proc/self/fd") else None
    out = tmp_path / "out"
    spec = make_spec(tmp_path, rows_per_file=40, outputs={"y": {"shape": ["batch", 64]}})
    w = ShardWriter(spec, out, tuning=Tuning(row_pool_bytes=2048, row_writers=2,
                                             hash_step_bytes=512))
    y = np.ones((70, 64), np.float32)
    w.write(np.arange(70), np.arange(70), {"y": y})
    files = w.close(partial=False)

    assert [f.path for f in files] == ["part-00000.ids.npy", "part-00000.y.npy"]
    last = journal_lines(out)[-1]
    assert (last["shard"], last["open"], last["rows"]) == (1, True, 70)
    assert sorted(p.name for p in out.glob(".*.tmp")) == sorted(f["path"] for f in last["files"])
    assert w.rows_written == 70
    if fds is not None:
        assert len(os.listdir("/proc/self/fd")) == fds


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


def test_parquet_string_ids_and_row_groups_cut_by_bytes(tmp_path):
    w = ShardWriter(make_spec(tmp_path, "parquet", rows_per_file=12), tmp_path / "out",
                    tuning=Tuning(parquet_row_group_bytes=40))  # 5 rows of y (8 B)
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
    w.wait_for_commits()  # shard 0 is committed in the background
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
    w.wait_for_commits()
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
    w.wait_for_commits()
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
def test_resume_after_a_crash_equals_an_uninterrupted_run(tmp_path, fmt):
    tuning = Tuning(parquet_row_group_bytes=48)
    spec = make_spec(tmp_path, fmt, rows_per_file=4, outputs=None if fmt == "npy" else RAGGED)
    n, rejected = 22, {2, 7, 8, 15, 20, 21}
    rows, ids = make_rows(n, ragged=fmt != "npy"), [f"id{i}" for i in range(n)]
    # records 0..9: shard 0 = rows 0, 1, 3, 4 committed; rows 5, 6, 9 in temp files
    whole_files, crashed = whole_and_crashed(tmp_path, spec, rows, ids, 5, rejected,
                                             stop_after=2, tuning=tuning)
    assert list(crashed.glob(".*.tmp"))
    # What else a crash can leave: a shard renamed before its journal line, a torn journal
    # line, a reject past the last commit, a temp file of a later shard.
    suffix = {"npy": "y.npy", "jsonl": "jsonl", "parquet": "parquet"}[fmt]
    (crashed / f"part-00001.{suffix}").write_bytes(b"half a shard")
    with open(crashed / "journal.jsonl", "ab") as f:
        f.write(b'{"shard": 1, "files": [{"pa')
    with open(crashed / "rejects.jsonl", "ab") as f:
        f.write(b'{"index": 7}\n')
    (crashed / f".part-00009.{suffix}.tmp").write_bytes(b"junk")
    (crashed / f"part-00099.{suffix}").write_bytes(b"no journal line lists this shard")

    point = prepare_out_dir(crashed, resume=True, overwrite=False, fingerprint=FP)
    assert (point.next_index, point.shard, point.rows, point.rejects) == (5, 1, 4, 1)
    # Reading restarts at the start of the batch that held the last committed row; the rows
    # and rejects of it that were committed already are dropped by the writer.
    assert point.start == 0
    w = ShardWriter(spec, crashed, resume=point, tuning=tuning)
    feed(w, rows, ids, point.start, 5, rejected)
    files = w.close()

    assert files == whole_files
    assert w.rows_written == n - len(rejected) and w.rejects_written == len(rejected)
    assert dir_bytes(crashed) == dir_bytes(tmp_path / "whole")
    reject_index = [json.loads(line)["index"]
                    for line in (crashed / "rejects.jsonl").read_text().splitlines()]
    assert reject_index == sorted(rejected)


@pytest.mark.parametrize("pool", [False, True], ids=["caller", "row-pool"])
@pytest.mark.parametrize("fmt", ["npy", "jsonl", "parquet"])
def test_a_shard_committed_open_by_time_resumes_to_the_same_files(tmp_path, fmt, pool):
    """With the commit interval passed after every batch, each batch commits the open shard
    (an open line); a crash then loses nothing committed, and --resume writes on into the
    same files as an uninterrupted run."""
    tuning = Tuning(parquet_row_group_bytes=48, row_pool_bytes=1 if pool else 1 << 30)
    spec = make_spec(tmp_path, fmt, rows_per_file=8, commit_interval_s=1e-6,
                     outputs=None if fmt == "npy" else RAGGED)
    n, rejected = 29, {2, 7, 8, 15, 20}
    rows = make_rows(n, ragged=fmt != "npy")
    ids = [f"id{i}" if i % 3 else i for i in range(n)]  # ints and strings: as the sinks keep them
    # records 0..14: shard 0 whole, shard 1 open
    whole_files, crashed = whole_and_crashed(tmp_path, spec, rows, ids, 3, rejected,
                                             stop_after=5, tuning=tuning)
    for tmp in crashed.glob(".*.tmp"):  # bytes written after the last commit
        with open(tmp, "ab") as f:
            f.write(b"rows of a batch after the commit")

    point = prepare_out_dir(crashed, resume=True, overwrite=False, fingerprint=FP)
    assert (point.shard, point.next_index, point.rows, point.rejects) == (1, 15, 12, 3)
    assert point.open.rows == 4 and point.start == 12
    w = ShardWriter(spec, crashed, resume=point, tuning=tuning)
    feed(w, rows, ids, point.start, 3, rejected)
    files = w.close()

    assert files == whole_files
    assert dir_bytes(crashed) == dir_bytes(tmp_path / "whole")  # no temp file left either


def test_an_open_shard_whose_temp_files_changed_restarts_at_its_first_row(tmp_path):
    """A crash while an open shard was completed (its temp files renamed or rewritten) leaves
    its open lines pointing at bytes that are gone: resume starts that shard over."""
    spec = make_spec(tmp_path, rows_per_file=8, commit_interval_s=1e-6)
    n = 20
    rows, ids = make_rows(n, ragged=False), list(range(n))
    # shard 0 whole, shard 1 open at 4 rows
    whole_files, crashed = whole_and_crashed(tmp_path, spec, rows, ids, 3, set(), stop_after=4)
    (crashed / ".part-00001.y.npy.tmp").write_bytes(b"rewritten")

    point = prepare_out_dir(crashed, resume=True, overwrite=False, fingerprint=FP)
    assert (point.shard, point.next_index, point.open, point.start) == (1, 8, None, 6)
    w = ShardWriter(spec, crashed, resume=point)
    assert [j.get("open", False) for j in journal_lines(crashed)] == [True, True, False]
    feed(w, rows, ids, point.start, 3, set())
    assert w.close() == whole_files
    assert dir_bytes(crashed) == dir_bytes(tmp_path / "whole")


def test_an_open_line_names_the_bytes_of_its_commit_though_the_short_shard_is_finished_first(
        tmp_path):
    """The journal thread lags (a slow fsync) while the last, short npy shard is finished, which
    rewrites its header: its open line still holds the sha256 of its files' first bytes as they
    stood when it was committed (the header of a full shard, then its rows)."""
    import hashlib

    spec = make_spec(tmp_path, rows_per_file=8, commit_interval_s=1e-6)
    rows, ids = make_rows(4, ragged=False), list(range(4))
    out = tmp_path / "out"
    prepare_out_dir(out, resume=False, overwrite=False, fingerprint=FP)
    w = ShardWriter(spec, out, disk=DiskSteps(fsync=lambda p: time.sleep(0.05) or fsync_path(p)))
    feed(w, rows, ids, 0, 2, set())
    w.close()
    first = journal_lines(out)[0]
    assert first["open"] and first["rows"] == 2
    y = next(f for f in first["files"] if f["path"].endswith(".y.npy.tmp"))
    full = npy_sink.npy_header(np.dtype(np.float32), (8, 2))
    committed = full + np.ascontiguousarray(rows["y"][:2], dtype=np.float32).tobytes()
    assert y["bytes"] == len(committed)
    assert y["sha256"] == hashlib.sha256(committed).hexdigest()
    assert np.load(out / "part-00000.y.npy").shape == (4, 2)  # the finished header: 4 rows


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
    w = ShardWriter(spec, out)
    w.write(np.arange(3), [0, 1, 2], make_rows(3, ragged=False))
    w.wait_for_commits()
    with pytest.raises(OutputError, match="journal.jsonl"):
        ShardWriter(spec, out)


# --- commits in the background ---

def shard_of(path: Path) -> int | None:
    """.part-00002.y.npy.tmp -> 2; None for other paths (the folder, rejects.jsonl)"""
    return int(path.name[6:11]) if path.name.startswith(".part-") else None


def failing_for(shard: int, real, error: BaseException):
    """`real` (sha256_file or fsync_path), raising `error` for the files of one shard."""
    def call(path):
        if shard_of(path) == shard:
            raise error
        return real(path)
    return call


def test_journal_keeps_shard_order_when_later_shards_hash_first(tmp_path):
    out = tmp_path / "out"
    sha256, fsync, append = sha256_file, fsync_path, append_journal
    shard_2_hashed, hashed, journaled, events = threading.Event(), [], [], []

    def slow_first_shard(path):
        if shard_of(path) == 0:  # held until shard 2 is hashed on other threads
            assert shard_2_hashed.wait(10)
        digest = sha256(path)
        hashed.append(path.name)
        if {".part-00002.ids.npy.tmp", ".part-00002.y.npy.tmp"} <= set(hashed):
            shard_2_hashed.set()
        return digest

    def checked_append(out_dir, shard, files, rows, next_index, rejects_bytes, *rest, **kw):
        # What the line promises must be on disk before it is written.
        in_place = all((out_dir / f.path).is_file() for f in files)
        temps = sorted(p.name for p in out_dir.glob(f".part-{shard:05d}.*.tmp"))
        size = (out_dir / "rejects.jsonl").stat().st_size
        journaled.append((shard, in_place, temps, size >= rejects_bytes))
        events.append(("line", shard))
        return append(out_dir, shard, files, rows, next_index, rejects_bytes, *rest, **kw)

    disk = DiskSteps(sha256=slow_first_shard,
                     fsync=lambda path: events.append(("fsync", path.name)) or fsync(path),
                     append_journal=checked_append)
    w = ShardWriter(make_spec(tmp_path, rows_per_file=2), out, disk=disk)
    rows, ids = make_rows(9, ragged=False), list(range(9))
    feed(w, rows, ids, 0, 3, rejected={1, 5, 8})  # shards: rows 0 2 | 3 4 | 6 7
    files = w.close()

    assert hashed.index(".part-00002.y.npy.tmp") < hashed.index(".part-00000.ids.npy.tmp")
    assert journaled == [(k, True, [], True) for k in range(3)]
    lines_at = [i for i, e in enumerate(events) if e[0] == "line"]
    for k, (at, before) in enumerate(zip(lines_at, [-1] + lines_at)):
        synced = {name for _, name in events[:at]}
        assert {f".part-{k:05d}.ids.npy.tmp", f".part-{k:05d}.y.npy.tmp"} <= synced
        # the folder (renames) and the rejects below next_index, since the line before
        assert {"out", "rejects.jsonl"} <= {name for _, name in events[before + 1:at]}
    lines = journal_lines(out)
    assert [(j["shard"], j["rows"], j["next_index"], j["rejects"]) for j in lines] == [
        (0, 2, 3, 1), (1, 4, 5, 1), (2, 6, 8, 2)]
    assert [f.path for f in files] == [f"part-0000{k}.{n}.npy" for k in range(3)
                                       for n in ("ids", "y")]
    for f in files:
        assert f.sha256 == sha256_file(out / f.path)


def test_the_writer_waits_while_in_flight_commits_are_all_taken(tmp_path):
    out = tmp_path / "out"
    release = threading.Event()
    w = ShardWriter(make_spec(tmp_path, rows_per_file=1), out, tuning=Tuning(in_flight=2),
                    disk=DiskSteps(fsync=lambda path: release.wait(10) and fsync_path(path)))
    rows = make_rows(4, ragged=False)
    writing = threading.Thread(target=lambda: [
        w.write(np.array([i]), [i], take(rows, [i])) for i in range(4)])
    writing.start()
    writing.join(0.3)
    assert writing.is_alive()  # shards 0 and 1 in flight: handing over shard 2 waits
    assert not (out / "journal.jsonl").exists()
    release.set()
    writing.join(10)
    assert not writing.is_alive()
    assert len(w.close()) == 8
    assert [j["shard"] for j in journal_lines(out)] == [0, 1, 2, 3]


@pytest.mark.parametrize("partial", [True, False])
def test_close_waits_for_every_commit(tmp_path, partial):
    out = tmp_path / "out"
    w = ShardWriter(make_spec(tmp_path, rows_per_file=2), out,
                    disk=DiskSteps(fsync=lambda path: time.sleep(0.05) or fsync_path(path)))
    rows, ids = make_rows(9, ragged=False), list(range(9))
    feed(w, rows, ids, 0, 3, rejected={4})  # shards 0 1 | 2 3 | 5 6 | 7 8, rejects 4
    w.write(np.array([9]), [9], make_rows(1, ragged=False, seed=1))  # a partial shard
    files = w.close(partial=partial)
    # partial=False: the last shard is committed open, on its temp files
    assert [j["shard"] for j in journal_lines(out)] == list(range(5))
    assert [j.get("open", False) for j in journal_lines(out)][-1] is not partial
    assert len(files) == 2 * (4 + partial)
    assert bool(list(out.glob(".*.tmp"))) is not partial
    assert w.rows_written == 9
    assert w.rejects_written == 1 == len((out / "rejects.jsonl").read_text().splitlines())


def test_close_without_the_partial_shard_commits_it_open_with_its_rejects(tmp_path):
    out = tmp_path / "out"
    w = ShardWriter(make_spec(tmp_path, rows_per_file=4), out)
    # one batch of 0..7, rejects 1 and 6: shard 0 = rows 0 2 3 4; rows 5 7 and reject 6 are
    # past it, committed with the open shard 1 that holds them
    feed(w, make_rows(8, ragged=False), list(range(8)), 0, 8, rejected={1, 6})
    w.close(partial=False)
    assert (w.rows_written, w.rejects_written) == (6, 2)
    assert [json.loads(x)["index"] for x in (out / "rejects.jsonl").read_text().splitlines()] \
        == [1, 6]
    point = read_journal(out)
    assert (point.next_index, point.rows, point.rejects, point.shard) == (8, 6, 2, 1)
    assert point.open.rows == 2
    assert [f.path for f in point.files] == ["part-00000.ids.npy", "part-00000.y.npy"]


def test_a_failed_commit_is_an_output_error_and_stops_the_journal(tmp_path):
    out = tmp_path / "out"
    w = ShardWriter(make_spec(tmp_path, rows_per_file=2), out, disk=DiskSteps(
        fsync=failing_for(1, fsync_path, OSError(28, "No space left on device"))))
    rows = make_rows(8, ragged=False)
    w.write(np.arange(6), list(range(6)), take(rows, list(range(6))))  # shards 0, 1, 2
    with pytest.raises(OutputError, match=r"No space left on device \(the filesystem holding "
                                          r"it, .* mounted at .*\); committed shards are "
                                          r"intact.*--resume"):
        w.wait_for_commits()
    # Every later call says so too: nothing after a failed commit can be journaled.
    with pytest.raises(OutputError, match="No space left"):
        w.write(np.array([6]), [6], take(rows, [6]))
    with pytest.raises(OutputError, match="No space left"):
        w.reject(7, 7, "read", "bad")
    files = w.close()  # already reported: closes, so that the run can write its manifest
    assert [f.path for f in files] == ["part-00000.ids.npy", "part-00000.y.npy"]
    assert [j["shard"] for j in journal_lines(out)] == [0]
    assert not list(out.glob("part-0000[12].*"))  # shard 2 hashed, but never renamed
    assert (w.rows_written, w.rejects_written) == (2, 0)
    assert w.close() == files
    point = read_journal(out)
    assert (point.shard, point.next_index) == (1, 2)
    ShardWriter(make_spec(tmp_path, rows_per_file=2), out, resume=point).close()
    assert sorted(p.name for p in out.glob("part-*")) == [f.path for f in files]


@pytest.mark.parametrize("error, raised", [(OSError(5, "Input/output error"), OutputError),
                                           (RuntimeError("a bug"), RuntimeError)])
def test_a_commit_error_that_only_close_sees_is_raised_there(tmp_path, error, raised):
    out = tmp_path / "out"
    w = ShardWriter(make_spec(tmp_path, rows_per_file=10), out,
                    disk=DiskSteps(sha256=failing_for(0, sha256_file, error)))
    w.reject(0, 0, "read", "bad")
    w.write(np.array([1, 2]), [1, 2], make_rows(2, ragged=False))
    with pytest.raises(raised, match=str(error.args[-1])):
        w.close()
    assert w.close() == [] and not (out / "journal.jsonl").exists()
    assert (w.rows_written, w.rejects_written) == (0, 0)


def test_a_crash_while_a_later_shard_is_done_before_an_earlier_one(tmp_path):
    """Shard 2 is hashed and fsynced while shard 1 still hashes: it is neither renamed nor
    journaled before shard 1, so a crash then leaves shard 0 journaled and shard 2 as temp
    files; the resume deletes them and writes the same shards as an uninterrupted run."""
    spec = make_spec(tmp_path, rows_per_file=3)
    n, rejected = 14, {4, 10}
    rows, ids = make_rows(n, ragged=False), [f"id{i}" for i in range(n)]
    whole = tmp_path / "whole"
    prepare_out_dir(whole, resume=False, overwrite=False, fingerprint=FP)
    w = ShardWriter(spec, whole)
    feed(w, rows, ids, 0, 4, rejected)
    w.close()

    crashed = tmp_path / "crashed"
    prepare_out_dir(crashed, resume=False, overwrite=False, fingerprint=FP)
    sha256, held, shard_2_hashed = sha256_file, threading.Event(), threading.Event()

    def stuck_on_shard_1(path):
        if shard_of(path) == 1:
            held.wait(10)
            raise OSError("the process is gone")  # never touches the folder again
        digest = sha256(path)
        if path.name == ".part-00002.y.npy.tmp":
            shard_2_hashed.set()
        return digest

    dead = ShardWriter(spec, crashed, disk=DiskSteps(sha256=stuck_on_shard_1))
    try:
        feed(dead, rows, ids, 0, 4, rejected, stop_after=3)  # records 0..11: shards 0, 1, 2
        assert shard_2_hashed.wait(10)
        time.sleep(0.05)  # shard 2's rename and line, were they not waiting, would be done
        assert [j["shard"] for j in journal_lines(crashed)] == [0]
        assert not list(crashed.glob("part-0000[12].*"))
        assert (crashed / ".part-00002.y.npy.tmp").exists()

        point = prepare_out_dir(crashed, resume=True, overwrite=False, fingerprint=FP)
        assert (point.shard, point.next_index) == (1, 3)
        resumed = ShardWriter(spec, crashed, resume=point)
        feed(resumed, rows, ids, point.start, 4, rejected)
        resumed.close()
    finally:
        held.set()
    assert dir_bytes(crashed) == dir_bytes(whole)


def test_bfloat16_rounding_matches_the_reference_and_leaves_the_rows_alone(tmp_path):
    rng = np.random.default_rng(5)
    bits = rng.integers(0, 2 ** 32, 4096, dtype=np.uint64).astype(np.uint32)
    bits[:4] = [0x7F800001, 0xFFFFFFFF, 0x7F7FFFFF, 0x3F808000]  # NaNs, max, a tie
    a = bits.view(np.float32).reshape(64, 64)
    before = a.copy()
    # the formula as first written: a full pass per step
    ref = ((bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000).view(np.float32).reshape(64, 64)
    ref = np.where(np.isnan(a), a, ref)
    spec = make_spec(tmp_path, rows_per_file=64,
                     outputs={"bf": {"shape": ["batch", 64], "dtype": "bfloat16"}})
    w = ShardWriter(spec, tmp_path / "out")
    w.write(np.arange(64), list(range(64)), {"bf": a[:, :]})
    w.close()
    got = np.load(tmp_path / "out" / "part-00000.bf.npy")
    assert got.view(np.uint32).tobytes() == ref.view(np.uint32).tobytes()
    assert a.tobytes() == before.tobytes()


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
        prepare_out_dir(tmp_path / "out", resume=True, overwrite=False, fingerprint=changed,
                        input_path=tmp_path / "data.jsonl")
    assert "input_sha256 changed" in str(err.value) and "spec_sha256" not in str(err.value)
    assert f"the input file {tmp_path / 'data.jsonl'} is not the file the run read" in str(
        err.value)
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


def test_npy_ids_are_int64_when_every_id_is_an_integer_else_strings():
    from graphrun.write.sinks.ids import id_array as _id_array

    assert _id_array([3, 1, 2]).dtype == np.int64
    assert _id_array([]).dtype == np.int64 and len(_id_array([])) == 0
    assert _id_array([1, "a"]).tolist() == ["1", "a"]
    assert _id_array([True, False]).dtype.kind == "U"  # bools are not integer ids
    assert _id_array([2**64 - 1, 1]).tolist() == [str(2**64 - 1), "1"]  # too big for int64


def run_writer(tmp_path: Path, name: str, n: int = 50, tuning: Tuning | None = None
               ) -> dict[str, bytes]:
    spec = make_spec(tmp_path / name, rows_per_file=7)
    (tmp_path / name).mkdir()
    w = ShardWriter(spec, tmp_path / name / "out", tuning=tuning)
    feed(w, make_rows(n, False), list(range(n)), 0, 4, rejected={5, 23})
    w.close()
    return dir_bytes(tmp_path / name / "out")


def test_npy_rows_written_by_the_row_pool_give_the_same_files(tmp_path):
    inline = run_writer(tmp_path, "inline")
    # every batch through the pool, and the bound on pending writes reached
    pooled = run_writer(tmp_path, "pooled", tuning=Tuning(row_writers=4, row_pool_bytes=1,
                                                          row_pool_pending=2))
    assert len(inline) > 10 and pooled == inline


def test_a_row_pool_write_error_is_raised_and_nothing_is_committed_after_it(tmp_path):
    calls = []

    def pwrite(fd, data, offset):
        calls.append(threading.current_thread().name)
        if len(calls) == 12:
            raise OSError(28, "No space left on device")
        return npy_sink.pwrite_all(fd, data, offset)

    spec = make_spec(tmp_path, rows_per_file=7)
    w = ShardWriter(spec, tmp_path / "out", tuning=Tuning(row_writers=4, row_pool_bytes=1),
                    disk=DiskSteps(pwrite=pwrite))
    with pytest.raises(OSError, match="No space left"):
        feed(w, make_rows(60, False), list(range(60)), 0, 4, rejected=set())
        w.close()
    assert any(name.startswith("graphrun-rows") for name in calls)
    w.close()  # after the error: the shard with a hole is not committed, no temp file left
    out = tmp_path / "out"
    committed = read_journal(out)
    assert committed is not None and committed.rows < 60
    want = make_rows(60, False)["y"]
    for ids_file in sorted(out.glob("part-*.ids.npy")):
        ids = np.load(ids_file)
        y = np.load(out / ids_file.name.replace(".ids.", ".y."))
        np.testing.assert_array_equal(y, want[ids])  # every committed row is whole
    assert sum(len(np.load(f)) for f in out.glob("part-*.ids.npy")) == committed.rows
    assert not list(out.glob(".*.tmp"))


def _write_all(tmp_path: Path, name: str, fmt: str, batches: list) -> dict[str, bytes]:
    """Write batches of (ids, first index) of 3 rows each; the output folder's files."""
    out = tmp_path / name
    w = ShardWriter(make_spec(tmp_path, fmt, rows_per_file=4), out)
    rows = make_rows(3 * len(batches), ragged=False)
    for k, (ids, first) in enumerate(batches):
        w.write(np.arange(first, first + 3), ids, {"y": rows["y"][3 * k:3 * k + 3]})
    w.close()
    return {n: b for n, b in dir_bytes(out).items() if n != "journal.jsonl"}


@pytest.mark.parametrize("fmt", ["npy", "jsonl", "parquet"])
def test_int64_id_arrays_give_the_files_of_id_lists(tmp_path, fmt):
    """The reader hands out ordinals and integer ids as int64 arrays: written as one array
    (no Python int per row), the files are those of the same ids as a list."""
    arrays = _write_all(tmp_path, "arrays", fmt,
                        [(np.arange(k, k + 3, dtype=np.int64) * 5, k) for k in (0, 3, 6)])
    lists = _write_all(tmp_path, "lists", fmt, [([5 * i for i in range(k, k + 3)], k)
                                                for k in (0, 3, 6)])
    assert len(arrays) >= 3 and arrays == lists
    if fmt == "npy":
        ids = np.concatenate([np.load(tmp_path / "arrays" / f"part-0000{s}.ids.npy")
                              for s in (0, 1, 2)])
        assert ids.dtype == np.int64 and ids.tolist() == [5 * i for i in range(9)]


@pytest.mark.parametrize("fmt", ["npy", "jsonl"])
def test_id_arrays_mixed_with_strings_or_other_dtypes_are_written_as_before(tmp_path, fmt):
    mixed = [(np.array([1, 2, 3], np.int64), 0), (["a", "b", "c"], 3),
             (np.array([7, 8, 9], np.int32), 6)]
    as_lists = [([1, 2, 3], 0), (["a", "b", "c"], 3), ([7, 8, 9], 6)]
    assert _write_all(tmp_path, "mixed", fmt, mixed) == _write_all(tmp_path, "lists", fmt,
                                                                    as_lists)
    if fmt == "npy":  # the shard holding 3 (int) and "a": strings, as for a list
        assert np.load(tmp_path / "mixed" / "part-00000.ids.npy").tolist() == [
            "1", "2", "3", "a"]


def test_the_writer_keeps_no_reference_to_the_callers_id_array(tmp_path):
    w = ShardWriter(make_spec(tmp_path, rows_per_file=4), tmp_path / "out")
    ids = np.array([10, 11], np.int64)
    w.write(np.array([0, 1]), ids, make_rows(2, ragged=False))
    ids[:] = -1  # a caller reusing its buffer
    w.close()
    assert np.load(tmp_path / "out" / "part-00000.ids.npy").tolist() == [10, 11]


def test_write_refuses_indices_that_do_not_increase_within_a_batch(tmp_path):
    w = ShardWriter(make_spec(tmp_path, rows_per_file=4), tmp_path / "out")
    for bad in ([0, 2, 1], [3, 3, 4], [5, 6, 6]):
        with pytest.raises(ValueError, match="indices must increase"):
            w.write(np.array(bad), np.array(bad), make_rows(3, ragged=False))
    w.write(np.array([0, 1, 5]), np.array([0, 1, 5]), make_rows(3, ragged=False))  # gaps: fine
    w.write(np.array([7]), np.array([7]), make_rows(1, ragged=False))
    w.close()
    assert np.load(tmp_path / "out" / "part-00000.ids.npy").tolist() == [0, 1, 5, 7]


def test_the_input_hash_is_the_files_sha256_and_its_errors_name_the_file(tmp_path):
    from graphrun.base.errors import InputError
    from graphrun.write.journal import InputHash

    f = tmp_path / "in.bin"
    f.write_bytes(os.urandom(3 << 20) + b"tail")
    assert InputHash(f).result() == sha256_file(f)
    with pytest.raises(InputError, match="cannot read the input file to hash it") as e:
        InputHash(tmp_path / "missing.jsonl").result()
    assert "missing.jsonl" in str(e.value)


def test_stopping_the_input_hash_ends_its_child_at_once(tmp_path):
    import time

    from graphrun.write.journal import InputHash

    fifo = tmp_path / "never-written"
    os.mkfifo(fifo)  # opening it for reading blocks until a writer comes: never
    h = InputHash(fifo)
    time.sleep(0.3)  # the child is started and blocked
    t0 = time.perf_counter()
    assert h.stop() is None and h.done()
    assert time.perf_counter() - t0 < 5


class WholeBatch(np.ndarray):
    """A batch of outputs that refuses to be taken apart into a Python object per row."""

    def __iter__(self):
        raise AssertionError("the batch was split into a Python object per row")


def test_parquet_keeps_a_dense_batch_whole_and_writes_the_file_records_would(tmp_path):
    spec = make_spec(tmp_path, "parquet", rows_per_file=40,
                     outputs={"y": {"shape": ["batch", 3, 2]}, "s": {"shape": ["batch"]}})
    rng = np.random.default_rng(0)
    y = rng.standard_normal((40, 3, 2)).astype(np.float32)
    s = np.arange(40, dtype=np.int64) * 3
    tuning = Tuning(parquet_row_group_bytes=150)  # 32 B a row: cut inside the batches of 7
    files = {}
    for how in ("arrays", "records"):
        out = tmp_path / how
        w = ShardWriter(spec, out, tuning=tuning)
        for b in range(0, 40, 7):
            i = np.arange(b, min(b + 7, 40))
            outputs = ({"y": y[i].view(WholeBatch), "s": s[i].view(WholeBatch)}
                       if how == "arrays" else {"y": list(y[i]), "s": list(s[i])})
            w.write(i, i, outputs)
        (info,) = w.close()
        files[how] = (out / info.path).read_bytes()
        meta = pq.ParquetFile(out / info.path).metadata
        assert [meta.row_group(g).num_rows for g in range(meta.num_row_groups)] == [5] * 8
    assert files["arrays"] == files["records"]
    table = pq.read_table(tmp_path / "arrays" / info.path)
    assert table.column("y").to_pylist() == y.tolist()
    assert table.column("s").to_pylist() == s.tolist()
