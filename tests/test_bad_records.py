"""Bad records end to end (issue 6): every record of the input ends in exactly one place.

With on_bad_record: skip a bad record goes to rejects.jsonl (index, id, where, reason) and the
good ones to the outputs; with error the run stops at the first bad record with its file:line
and reason, after committing the records before it. JSONL, .npy and Parquet, through the CLI.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.dataset  # noqa: F401 - pa.dataset
import pyarrow.parquet as pq
import pytest
import yaml
from click.testing import CliRunner

from graphrun.cli.main import main

# y = 2x + k (so a record's output shows its own x and k), s = t + 0.5 cut to the record's seq.
MODEL = """\
import torch


class Model(torch.nn.Module):
    def forward(self, x, k, t):
        # x: [B, 4] float32; k: [B] int64; t: [B, S] int64
        return {"y": x * 2 + k[:, None].to(x.dtype), "s": t.to(torch.float32) + 0.5}


class One(torch.nn.Module):
    def forward(self, x):
        return x * 2


def build():
    return Model()


def build_one():
    return One()
"""


def mixed_spec(data: str, *, on_bad_record: str = "skip", fmt: str = "jsonl") -> dict:
    """Three inputs, so one file can hold every kind of bad record; seq is a non-batch axis."""
    return {
        "version": 1, "name": "bad-records", "device": "cpu",
        "model": {"target": "model.py:build"},
        "inputs": {"x": {"shape": ["batch", 4], "dtype": "float32", "finite": True},
                   "k": {"shape": ["batch"], "dtype": "int64", "range": [0, 10]},
                   "t": {"shape": ["batch", "seq"], "dtype": "int64", "range": [0, 100]}},
        "outputs": {"y": {"shape": ["batch", 4]}, "s": {"shape": ["batch", "seq"]}},
        "buckets": {"batch": [1, 2, 4], "seq": [4, 8]},
        "capture": {"warmup_iters": 1},
        "data": {"path": data, "id_field": "id", "batch_size": 4,
                 "on_bad_record": on_bad_record},
        "output": {"dir": "out", "format": fmt, "rows_per_file": 5},
    }


def one_input_spec(data: str, *, on_bad_record: str = "skip", dtype: str = "float32",
                   width: int = 4, range_=None) -> dict:
    """x [batch, width] -> 2x, for .npy (one array, no ids: a record's row is its id)."""
    x = {"shape": ["batch", width], "dtype": dtype}
    x.update({"finite": True} if dtype.startswith("float") else {"range": range_})
    return {
        "version": 1, "name": "bad-npy", "device": "cpu",
        "model": {"target": "model.py:build_one"},
        "inputs": {"x": x}, "outputs": {"y": {"shape": ["batch", width]}},
        "buckets": {"batch": [1, 2, 4]},
        "capture": {"warmup_iters": 1},
        "data": {"path": data, "batch_size": 4, "on_bad_record": on_bad_record},
        "output": {"dir": "out", "format": "npy", "rows_per_file": 5},
    }


def write_spec(tmp_path: Path, spec: dict) -> Path:
    (tmp_path / "model.py").write_text(MODEL)
    path = tmp_path / "pipeline.yaml"
    path.write_text(yaml.safe_dump(spec, sort_keys=False))
    return path


def cli(*args):
    return CliRunner().invoke(main, [str(a) for a in args])


def good(i: int) -> dict:
    return {"id": f"r{i}", "x": [i, 1, 2, 3], "k": i % 10, "t": [i % 100] * (1 + i % 8)}


def with_(i: int, **changes) -> bytes:
    record = good(i)
    record.update(changes)
    return json.dumps(record).encode()


def without(i: int, key: str) -> bytes:
    record = good(i)
    del record[key]
    return json.dumps(record).encode()


# Each kind of bad JSONL line of issue 6: (name, line, id in rejects.jsonl, reason pattern).
BAD_LINES = [
    ("missing field", without(1, "t"), "r1", r"missing field 't'"),
    ("unknown field", with_(2, z=1), "r2", r"unknown field 'z'"),
    ("wrong rank", with_(3, x=[[3, 1, 2, 3]]), "r3", r"x: expected rank 1 .*got rank 2"),
    ("wrong shape", with_(4, x=[4, 1, 2]), "r4", r"x: dimension 0 .* must be 4 .*got 3"),
    ("seq beyond largest bucket", with_(5, t=[1] * 9), "r5",
     r"t: seq length 9 exceeds the largest seq bucket 8"),
    ("non-numeric", with_(6, x=["a", 1, 2, 3]), "r6", r"x: non-numeric value 'a'"),
    ("float for int", with_(7, k=1.5), "r7", r"k: non-integral value 1.5 where int64"),
    ("above range", with_(8, k=10), "r8", r"k: value 10 is outside range \[0, 10\)"),
    ("below range", with_(9, t=[3, -1]), "r9", r"t: value -1 is outside range \[0, 100\)"),
    ("NaN", b'{"id": "r10", "x": [NaN, 1, 2, 3], "k": 1, "t": [1]}', "r10",
     r"x: value nan is NaN or Inf \(finite: true\)"),
    ("Inf", b'{"id": "r11", "x": [1, -Infinity, 2, 3], "k": 1, "t": [1]}', "r11",
     r"x: value -inf is NaN or Inf \(finite: true\)"),
    ("duplicate id", with_(12, id="r0"), "r0", r"duplicate id 'r0'"),
    ("invalid UTF-8", b'{"id": "r\xff13", "x": [13, 1, 2, 3], "k": 3, "t": [1]}', None,
     r"invalid UTF-8 \(byte 0xff"),
    ("two records joined at a lone CR", with_(14) + b"\r" + with_(15), None,
     r"records joined at a lone carriage return \(column \d+\): the file mixes line ends"),
]
TRUNCATED = (b'{"id": "r99", "x": [99, 1', None, r"truncated last line")


def mixed_jsonl(bad: list) -> tuple[bytes, list[str], list[tuple]]:
    """Good record r0, then each bad line followed by a good one, then a blank line and a
    truncated last line. Returns the file, the good ids in order, and the expected rejects
    (index, id, line, reason pattern)."""
    lines, ids, rejects = [with_(0)], ["r0"], []
    for k, (_, line, rid, reason) in enumerate(bad):
        rejects.append((len(lines), rid, len(lines) + 1, reason))
        lines.append(line)
        lines.append(with_(20 + k))
        ids.append(f"r{20 + k}")
    index = len(lines)  # the blank line below is no record: the ordinal does not advance
    lines += [b"   ", TRUNCATED[0]]
    rejects.append((index, None, len(lines), TRUNCATED[2]))
    return b"\n".join(lines), ids, rejects


def read_jsonl_outputs(out: Path) -> list[dict]:
    return [json.loads(line) for shard in sorted(out.glob("part-*.jsonl"))
            for line in shard.read_text().splitlines()]


def check_expected_values(rows: list[dict]) -> None:
    for row in rows:
        i = int(row["id"][1:])
        rec = good(i)
        assert row["y"] == [2 * v + rec["k"] for v in rec["x"]], row
        assert row["s"] == [v + 0.5 for v in rec["t"]], row


def manifest(out: Path) -> dict:
    return json.loads((out / "manifest.json").read_text())


def test_jsonl_skip_sends_every_bad_kind_to_rejects_and_the_rest_to_outputs(tmp_path):
    data, good_ids, expected = mixed_jsonl(BAD_LINES)
    (tmp_path / "data.jsonl").write_bytes(data)
    spec = write_spec(tmp_path, mixed_spec("data.jsonl"))
    result = cli("run", spec, "-q")
    assert result.exit_code == 0, result.output
    out = tmp_path / "out"

    rows = read_jsonl_outputs(out)
    assert [r["id"] for r in rows] == good_ids
    check_expected_values(rows)

    rejects = [json.loads(line) for line in (out / "rejects.jsonl").read_text().splitlines()]
    assert len(rejects) == len(expected)
    for got, (index, rid, line, reason) in zip(rejects, expected):
        assert (got["index"], got["id"], got["where"]) == (index, rid, f"data.jsonl:{line}"), got
        assert re.search(reason, got["reason"]), got

    m = manifest(out)
    t = m["totals"]
    assert m["status"] == "completed"
    assert (t["records_in"], t["records_out"], t["records_rejected"]) == (
        len(good_ids) + len(expected), len(good_ids), len(expected))
    assert m["rejects"]["count"] == len(expected)


@pytest.mark.parametrize("name,line,rid,reason", BAD_LINES + [("truncated", *TRUNCATED)],
                         ids=[b[0] for b in BAD_LINES] + ["truncated last line"])
def test_jsonl_error_stops_with_file_line_and_reason(tmp_path, name, line, rid, reason):
    # Six good records (one full batch of 4, two more), then the bad one, then more good ones.
    lines = [with_(i) for i in range(6)] + [line]
    if name != "truncated":
        lines += [with_(i) for i in range(30, 33)]
    (tmp_path / "data.jsonl").write_bytes(b"\n".join(lines) + b"\n" * (name != "truncated"))
    spec = write_spec(tmp_path, mixed_spec("data.jsonl", on_bad_record="error"))
    result = cli("run", spec, "-q")
    assert result.exit_code == 2, result.output
    head = "error: data.jsonl:7: " + (f"record {rid!r}: " if rid else "")
    assert result.output.startswith(head), result.output
    assert re.search(reason, result.output), result.output
    assert "Traceback" not in result.output and isinstance(result.exception, SystemExit)
    said = " ".join(result.output.split())
    assert "Fix that record and run again with --overwrite (the input changed, so --resume " \
        "cannot go on from them), or set data.on_bad_record: skip" in said
    m = manifest(tmp_path / "out")
    assert m["status"] == "failed"
    assert m["error"].startswith(head[len("error: "):]) and re.search(reason, m["error"])
    assert not (tmp_path / "out" / "rejects.jsonl").exists()


# The records held for a partial batch before the first bad record (here r4, r5) are run and
# written too, not only the full batches before it.
@pytest.mark.parametrize("before", [6, 4, 1])
def test_jsonl_error_commits_every_record_before_the_bad_one(tmp_path, before):
    lines = [with_(i) for i in range(before)] + [with_(50, k=11)] + [with_(60)]
    (tmp_path / "data.jsonl").write_bytes(b"\n".join(lines) + b"\n")
    spec = write_spec(tmp_path, mixed_spec("data.jsonl", on_bad_record="error"))
    result = cli("run", spec, "-q")
    assert result.exit_code == 2 and f"data.jsonl:{before + 1}: record 'r50'" in result.output
    out = tmp_path / "out"
    rows = read_jsonl_outputs(out)
    assert [r["id"] for r in rows] == [f"r{i}" for i in range(before)]
    check_expected_values(rows)
    t = manifest(out)["totals"]
    assert t["records_out"] == before == t["records_in"] and t["records_rejected"] == 0


# ---- .npy: one dense array; the row is the record's id -------------------------------------------

def npy_outputs(out: Path) -> tuple[list, np.ndarray]:
    ids = [i for f in sorted(out.glob("part-*.ids.npy")) for i in np.load(f).tolist()]
    ys = [np.load(f) for f in sorted(out.glob("part-*.y.npy"))]
    return ids, (np.concatenate(ys) if ys else np.empty((0, 4)))


@pytest.mark.parametrize("dtype,bad,reason", [
    ("float32", {3: np.nan, 7: np.inf, 8: -np.inf}, r"x: value -?(nan|inf) is NaN or Inf"),
    ("int64", {2: 10, 5: -3}, r"x: value -?\d+ is outside range \[0, 10\)"),
    ("int64", {4: 2.5}, r"x: non-integral value 2.5 where int64"),
], ids=["nan-inf-finite", "out-of-range", "float-for-int"])
def test_npy_skip_rejects_bad_rows_with_their_row(tmp_path, dtype, bad, reason):
    a = (np.arange(40) % 10).reshape(10, 4).astype(np.float64 if 2.5 in bad.values()
                                                   else dtype)
    for row, value in bad.items():
        a[row, 1] = value
    np.save(tmp_path / "data.npy", a)
    spec = write_spec(tmp_path, one_input_spec("data.npy", dtype=dtype, range_=[0, 10]))
    result = cli("run", spec, "-q")
    assert result.exit_code == 0, result.output
    out = tmp_path / "out"
    keep = [i for i in range(10) if i not in bad]
    ids, y = npy_outputs(out)
    assert ids == keep
    np.testing.assert_array_equal(y, 2 * a[keep].astype(y.dtype))
    rejects = [json.loads(line) for line in (out / "rejects.jsonl").read_text().splitlines()]
    assert [(r["index"], r["id"], r["where"]) for r in rejects] == [
        (i, i, f"data.npy[row {i}]") for i in sorted(bad)]
    assert all(re.search(reason, r["reason"]) for r in rejects), rejects
    t = manifest(out)["totals"]
    assert (t["records_in"], t["records_out"], t["records_rejected"]) == (10, len(keep), len(bad))


def test_npy_error_names_the_row_and_reason(tmp_path):
    a = np.ones((10, 4), np.float32)
    a[6, 2] = np.nan
    np.save(tmp_path / "data.npy", a)
    spec = write_spec(tmp_path, one_input_spec("data.npy", on_bad_record="error"))
    result = cli("run", spec, "-q")
    assert result.exit_code == 2
    assert result.output.startswith("error: data.npy[row 6]: record 6: x: value nan is NaN")
    assert manifest(tmp_path / "out")["status"] == "failed"


def test_npy_error_commits_the_rows_before_the_bad_one(tmp_path):
    a = np.ones((10, 4), np.float32)
    a[6, 2] = np.nan
    np.save(tmp_path / "data.npy", a)
    spec = write_spec(tmp_path, one_input_spec("data.npy", on_bad_record="error"))
    assert cli("run", spec, "-q").exit_code == 2
    assert npy_outputs(tmp_path / "out")[0] == [0, 1, 2, 3, 4, 5]


@pytest.mark.parametrize("array,reason", [
    (np.zeros((8, 5), np.float32), r"data.npy: x: dimension 0 of a record must be 4 .*got 5 "
     r"\(array shape \[8, 5\]\)"),
    (np.zeros((8,), np.float32), r"data.npy: x: expected rank 1 per record"),
    (np.array([["a"] * 4] * 8), r"data.npy: x: dtype <U1 is not numeric"),
], ids=["wrong-width", "wrong-rank", "strings"])
@pytest.mark.parametrize("on_bad_record", ["skip", "error"])
def test_npy_whole_file_problems_fail_even_with_skip(tmp_path, array, reason, on_bad_record):
    np.save(tmp_path / "data.npy", array)
    spec = write_spec(tmp_path, one_input_spec("data.npy", on_bad_record=on_bad_record))
    result = cli("run", spec, "-q")
    assert result.exit_code == 2 and "Traceback" not in result.output
    assert re.match("error: " + reason, result.output), result.output
    out = tmp_path / "out"
    assert not list(out.glob("part-*"))
    m = manifest(out)
    assert m["status"] == "failed" and re.match(reason, m["error"])
    assert m["totals"]["records_in"] == 0 == m["totals"]["records_out"]


# ---- Parquet ------------------------------------------------------------------------------------

def test_parquet_skip_rejects_nulls_and_bad_values_per_row(tmp_path):
    n = 14
    rows = [good(i) for i in range(n)]
    rows[1]["x"] = None  # null list
    rows[2]["x"] = [2.0, None, 1.0, 1.0]  # null element
    rows[3]["k"] = 10  # out of range
    rows[4]["k"] = 2.5  # non-integral where int64 is expected
    rows[5]["x"] = [float("nan"), 1.0, 2.0, 3.0]  # finite: true
    rows[6]["x"] = [6.0, 1.0, 2.0]  # wrong shape
    rows[7]["t"] = [1] * 9  # seq beyond the largest bucket
    rows[8]["id"] = None  # null id
    rows[9]["id"] = "r0"  # duplicate id
    rows[10]["t"] = [200]  # out of range
    table = pa.table({
        "id": pa.array([r["id"] for r in rows], pa.string()),
        "x": pa.array([r["x"] for r in rows], pa.list_(pa.float64())),
        "k": pa.array([float(r["k"]) for r in rows], pa.float64()),
        "t": pa.array([r["t"] for r in rows], pa.list_(pa.int64())),
    })
    pq.write_table(table, tmp_path / "data.parquet", row_group_size=5)
    spec = write_spec(tmp_path, mixed_spec("data.parquet", fmt="parquet"))
    result = cli("run", spec, "-q")
    assert result.exit_code == 0, result.output
    out = tmp_path / "out"
    expected = {1: r"x: null(,| value)", 2: r"x: null(,| value)", 3: r"k: value 10 is outside range",
                4: r"k: non-integral value 2.5", 5: r"x: value nan is NaN or Inf",
                6: r"x: dimension 0 .* must be 4", 7: r"t: seq length 9 exceeds",
                8: r"missing id: 'id' is null", 9: r"duplicate id 'r0'",
                10: r"t: value 200 is outside range"}
    rejects = [json.loads(line) for line in (out / "rejects.jsonl").read_text().splitlines()]
    assert [(r["index"], r["where"]) for r in rejects] == [
        (i, f"data.parquet[row {i}]") for i in sorted(expected)]
    for r in rejects:
        assert re.search(expected[r["index"]], r["reason"]), r
        assert r["id"] == rows[r["index"]]["id"]

    got = [row for f in sorted(out.glob("part-*.parquet")) for row in pq.read_table(f).to_pylist()]
    keep = [i for i in range(n) if i not in expected]
    assert [g["id"] for g in got] == [f"r{i}" for i in keep]
    check_expected_values(got)
    t = manifest(out)["totals"]
    assert (t["records_in"], t["records_out"], t["records_rejected"]) == (n, len(keep),
                                                                          len(expected))


def test_parquet_error_names_the_row(tmp_path):
    rows = [good(i) for i in range(8)]
    rows[5]["k"] = 10
    table = pa.table({"id": [r["id"] for r in rows], "x": [[float(v) for v in r["x"]]
                                                          for r in rows],
                      "k": [r["k"] for r in rows], "t": [r["t"] for r in rows]})
    pq.write_table(table, tmp_path / "data.parquet")
    spec = write_spec(tmp_path, mixed_spec("data.parquet", on_bad_record="error"))
    result = cli("run", spec, "-q")
    assert result.exit_code == 2
    assert result.output.startswith("error: data.parquet[row 5]: record 'r5': k: value 10 is "
                                    "outside range [0, 10)"), result.output
    assert manifest(tmp_path / "out")["status"] == "failed"


# ---- damaged files: one message, never a traceback -----------------------------------------------

def test_npy_with_a_damaged_header_is_an_input_error(tmp_path):
    np.save(tmp_path / "data.npy", np.ones((8, 4), np.float32))
    raw = (tmp_path / "data.npy").read_bytes()
    (tmp_path / "data.npy").write_bytes(raw.replace(b"}", b" ", 1))  # header dict never closed
    spec = write_spec(tmp_path, one_input_spec("data.npy"))
    result = cli("run", spec, "-q")
    assert result.exit_code == 2 and result.output.startswith("error: data.npy: ")


def test_parquet_with_a_damaged_page_is_an_input_error(tmp_path):
    rows = [good(i) for i in range(8)]
    table = pa.table({"id": [r["id"] for r in rows],
                      "x": [[float(v) for v in r["x"]] for r in rows],
                      "k": [r["k"] for r in rows], "t": [r["t"] for r in rows]})
    pq.write_table(table, tmp_path / "data.parquet")
    column = pq.ParquetFile(tmp_path / "data.parquet").metadata.row_group(0).column(1)
    at = column.dictionary_page_offset or column.data_page_offset
    raw = bytearray((tmp_path / "data.parquet").read_bytes())
    raw[at:at + 8] = b"\xff" * 8  # the page header of column x cannot be decoded
    (tmp_path / "data.parquet").write_bytes(bytes(raw))
    spec = write_spec(tmp_path, mixed_spec("data.parquet"))
    result = cli("run", spec, "-q")
    assert result.exit_code == 2 and result.output.startswith("error: data.parquet: ")
    assert manifest(tmp_path / "out")["status"] == "failed"


def test_ids_ending_in_nul_are_refused_for_npy_naming_the_record(tmp_path):
    """numpy's fixed-width strings drop trailing NULs: 'a' and 'a\\x00' would both be 'a'."""
    ids = ["a", "a\x00", "b", "b\x00\x00"]
    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps({**good(i), "id": rid}) + "\n"
                            for i, rid in enumerate(ids)))

    def spec(on_bad_record: str, fmt: str) -> Path:
        s = mixed_spec(str(data), on_bad_record=on_bad_record, fmt=fmt)
        del s["outputs"]["s"]  # npy holds no per-record axis
        return write_spec(tmp_path, s)

    result = cli("run", spec("error", "npy"))
    assert result.exit_code != 0
    assert "record 'a\\x00'" in result.output and "ends in NUL" in result.output
    assert cli("run", spec("skip", "npy"), "--overwrite").exit_code == 0
    written = np.concatenate([np.load(p) for p in sorted((tmp_path / "out").glob("*.ids.npy"))])
    assert written.tolist() == ["a", "b"]
    rejects = [json.loads(line) for line in (tmp_path / "out" / "rejects.jsonl").open()]
    assert [r["id"] for r in rejects] == ["a\x00", "b\x00\x00"]
    assert all("ends in NUL" in r["reason"] for r in rejects)
    assert cli("run", spec("error", "jsonl"), "--overwrite").exit_code == 0  # ids kept as is
    got = [json.loads(line)["id"] for p in sorted((tmp_path / "out").glob("part-*.jsonl"))
           for line in p.open()]
    assert got == ids


@pytest.mark.parametrize("ids, kind, rejected", [
    ([0, 1, 2, 3, 4, 5, "s6", 7, 8, "s9", 10, 11], pa.int64(), ["s6", "s9"]),
    (["s0", 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11], pa.string(), []),
])
def test_parquet_shards_hold_ids_of_one_type(tmp_path, ids, kind, rejected):
    """Shards of 5 rows: the first all integers was an int64 column and the next a string
    one, and pyarrow.dataset could not read them as one table."""
    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps({**good(i), "id": rid}) + "\n"
                            for i, rid in enumerate(ids)))
    spec = mixed_spec(str(data), on_bad_record="skip", fmt="parquet")
    result = cli("run", write_spec(tmp_path, spec))
    assert result.exit_code == 0, result.output
    shards = sorted((tmp_path / "out").glob("part-*.parquet"))
    assert len(shards) == 2 + (not rejected)
    assert [pq.read_schema(p).field("id").type for p in shards] == [kind] * len(shards)
    table = pa.dataset.dataset([str(p) for p in shards], format="parquet").to_table()
    kept = [rid for rid in ids if rid not in rejected]
    assert table.column("id").to_pylist() == (kept if kind == pa.int64() else
                                              [str(rid) for rid in kept])
    rejects = [json.loads(line) for line in (tmp_path / "out" / "rejects.jsonl").open()
               ] if rejected else []
    assert [r["id"] for r in rejects] == rejected
    assert all("writes its ids to Parquet as integers (the input's first id, 0, is one)"
               in r["reason"] for r in rejects)


def test_parquet_shards_hold_int64_ids_when_an_integer_id_is_past_int64(tmp_path):
    """An integer id past int64 (2**63) in a run of integer ids made its shard's id column
    text, the others int64, so pyarrow.dataset could not read them as one table; it is a bad
    record now. A first id past int64 makes the run's ids text."""
    data = tmp_path / "data.jsonl"
    ids = [0, 1, 2, 3, 4, 5, 2**63, 7, 8, 9, 10, -2**63 - 1]
    data.write_text("".join(json.dumps({**good(i), "id": rid}) + "\n"
                            for i, rid in enumerate(ids)))
    result = cli("run", write_spec(tmp_path, mixed_spec(str(data), fmt="parquet")))
    assert result.exit_code == 0, result.output
    shards = sorted((tmp_path / "out").glob("part-*.parquet"))
    assert [pq.read_schema(p).field("id").type for p in shards] == [pa.int64()] * 2
    table = pa.dataset.dataset([str(p) for p in shards], format="parquet").to_table()
    assert table.column("id").to_pylist() == [0, 1, 2, 3, 4, 5, 7, 8, 9, 10]
    rejects = [json.loads(line) for line in (tmp_path / "out" / "rejects.jsonl").open()]
    assert [(r["index"], r["id"]) for r in rejects] == [(6, 2**63), (11, -2**63 - 1)]
    assert rejects[0]["reason"].startswith(
        "id 9223372036854775808 does not fit the Parquet id column's int64 (the input's first "
        "id, 0, is an integer)")

    ids = [2**64, 1, 2, "x"]
    data.write_text("".join(json.dumps({**good(i), "id": rid}) + "\n"
                            for i, rid in enumerate(ids)))
    result = cli("run", write_spec(tmp_path, mixed_spec(str(data), fmt="parquet")),
                 "--overwrite")
    assert result.exit_code == 0, result.output
    table = pq.read_table(tmp_path / "out" / "part-00000.parquet")
    assert table.column("id").to_pylist() == [str(2**64), "1", "2", "x"]


@pytest.mark.parametrize("fmt", ["parquet", "npz", "parquet without statistics"])
def test_parquet_shards_hold_text_ids_from_a_uint64_column_past_int64(tmp_path, fmt):
    """A uint64 id column with ids past int64 (64-bit hashes) wrote int64 ids in the shards
    without one and text in the others, which pyarrow.dataset cannot read as one table."""
    ids = np.arange(12, dtype=np.uint64)
    ids[9:] += np.uint64(2**63)
    x = np.stack([np.arange(12), np.ones(12), np.ones(12), np.ones(12)], 1).astype(np.float32)
    k, t = np.arange(12) % 10, np.ones((12, 2), np.int64)
    if fmt == "npz":
        np.savez(tmp_path / "data.npz", id=ids, x=x, k=k, t=t)
    else:
        pq.write_table(pa.table({"id": pa.array(ids), "x": list(x), "k": k, "t": list(t)}),
                       tmp_path / "data.parquet", write_statistics=fmt == "parquet")
    data = tmp_path / ("data.npz" if fmt == "npz" else "data.parquet")
    result = cli("run", write_spec(tmp_path, mixed_spec(str(data), fmt="parquet")))
    assert result.exit_code == 0, result.output
    shards = sorted((tmp_path / "out").glob("part-*.parquet"))
    assert [pq.read_schema(p).field("id").type for p in shards] == [pa.string()] * 3
    table = pa.dataset.dataset([str(p) for p in shards], format="parquet").to_table()
    assert table.column("id").to_pylist() == [str(i) for i in ids.tolist()]


def test_a_null_among_a_prompts_token_ids_is_a_bad_record_not_a_crash(tmp_path):
    """A token-id prompt holding null (JSONL, or a Parquet list with a null item) is rejected
    with its place in the list, as any other non-id; a per-record stop list holding null is
    named as JSON writes it."""
    from graphrun.read.prompts import given_ids

    assert given_ids([1, None, 3], "prompt") == (
        "prompt: expected a string or a list of token ids (whole numbers >= 0), got null at "
        "place 1 in the list")
    assert "got null at place 0" in given_ids([None], "prompt")
    assert "got 2.5 at place 1" in given_ids([1, 2.5], "prompt")
    from graphrun.read.requests import stop_strings

    assert stop_strings("stop", [None]) == (
        "stop: [null] is not a string or a list of up to 4 non-empty strings")


def test_a_generation_run_rejects_a_token_id_prompt_holding_null(tmp_path):
    from tests.test_generate_job import write_spec

    spec = write_spec(tmp_path, n=2, data__on_bad_record="skip")
    data = tmp_path / "prompts.jsonl"
    with open(data, "a") as f:
        f.write(json.dumps({"id": "ids-null", "prompt": [5, None, 7]}) + "\n")
    result = CliRunner().invoke(main, ["run", str(spec), "-q"])
    assert result.exit_code == 0 and "Traceback" not in result.output, result.output
    rejects = [json.loads(x) for x in (tmp_path / "out" / "rejects.jsonl").read_text().splitlines()]
    assert [(r["id"], r["reason"]) for r in rejects] == [(
        "ids-null", "prompt: expected a string or a list of token ids (whole numbers >= 0), "
        "got null at place 1 in the list")]


def test_a_prompt_record_whose_id_is_no_string_or_integer_has_a_null_id_in_rejects(tmp_path):
    """As data.md says and the tensor reader does: NaN read back as the id "NaN" would be
    another record's id."""
    from tests.test_generate_job import write_spec

    spec = write_spec(tmp_path, n=2, data__on_bad_record="skip")
    with open(tmp_path / "prompts.jsonl", "a") as f:
        f.write('{"id": NaN, "prompt": "a"}\n{"id": 1.5, "prompt": "b"}\n'
                '{"id": ["x"], "prompt": "c"}\n{"id": true, "prompt": "d"}\n')
    result = CliRunner().invoke(main, ["run", str(spec), "-q"])
    assert result.exit_code == 0, result.output
    lines = (tmp_path / "out" / "rejects.jsonl").read_text().splitlines()
    rejects = [json.loads(x) for x in lines]
    assert [r["id"] for r in rejects] == [None] * 4
    assert [r["reason"].rsplit("(", 1)[1] for r in rejects] == ["NaN)", "1.5)", '["x"])', "true)"]
