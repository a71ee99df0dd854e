"""The stream step: reading JSONL, npy, npz and Parquet in chunks, checking every record."""

from __future__ import annotations

import json
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from graphrun.read import stream
from graphrun.read.formats import dense
from graphrun.read.formats import jsonl_parse
from graphrun.read.formats import parquet as parquet_in
from graphrun.read.formats.npz import npz_member
from graphrun.base.tuning import Tuning
from graphrun.base.errors import InputError
from graphrun.spec.keys import PipelineSpec
from graphrun.read.stream import read_batches

DECODER = {"tokens": {"shape": ["batch", 1], "dtype": "int64", "range": [0, 100]},
           "positions": {"shape": ["batch"], "dtype": "int64"}}
SEQ = {"tokens": {"shape": ["batch", "seq"], "dtype": "int64", "range": [0, 100]},
       "mask": {"shape": ["batch", "seq"], "dtype": "bool"}}
PAIRS = {"xy": {"shape": ["batch", "seq", 2], "dtype": "int64"}}
FLOATS = {"x": {"shape": ["batch", 3], "dtype": "float32", "finite": True}}
SMALL = {"v": {"shape": ["batch"], "dtype": "int8"}}
BUCKETS = {"batch": [1, 2, 4], "seq": [4]}


def make_spec(path: Path, inputs: dict, **data) -> PipelineSpec:
    buckets = BUCKETS if any("seq" in i["shape"] for i in inputs.values()) else {"batch": [1, 4]}
    return PipelineSpec.model_validate({
        "version": 1, "name": "t", "model": {"builtin": "mlp"}, "inputs": inputs,
        "outputs": {"y": {"shape": ["batch"]}}, "buckets": buckets,
        "data": {"path": str(path), **data}, "output": {"dir": str(path.parent / "out")},
    })


def write_jsonl(path: Path, records: list) -> Path:
    """records: dicts (dumped as JSON) or bytes/str (written as they are, one per line)."""
    with open(path, "wb") as f:
        for r in records:
            raw = r if isinstance(r, bytes) else r.encode() if isinstance(r, str) else \
                json.dumps(r).encode()
            f.write(raw + b"\n")
    return path


def decoder_records(n: int) -> list[dict]:
    return [{"id": f"r{i}", "tokens": [i % 100], "positions": i} for i in range(n)]


def everything(spec: PipelineSpec, **kw):  # kw: read_batches' (start, stop, tuning)
    """(valid ids in order, rejects in order, batches)."""
    batches = list(read_batches(spec, **kw))
    ids = [i for b in batches for i in b.ids]
    return ids, [r for b in batches for r in b.rejects], batches


# ---- values, order, ids, batches ------------------------------------------------------------

def test_jsonl_values_order_and_batches(tmp_path):
    path = write_jsonl(tmp_path / "data.jsonl", decoder_records(2) + [""] + decoder_records(5)[2:])
    batches = list(read_batches(make_spec(path, DECODER, id_field="id", batch_size=2)))

    assert [len(b) for b in batches] == [2, 2, 1]
    first = batches[0]
    assert first.ids == ["r0", "r1"]
    assert first.indices.tolist() == [0, 1] and first.indices.dtype == np.int64
    assert first.where == ["data.jsonl:1", "data.jsonl:2"]
    assert batches[1].where == ["data.jsonl:4", "data.jsonl:5"]  # the blank line 3 is no record
    assert batches[1].indices.tolist() == [2, 3]
    np.testing.assert_array_equal(first.fields["tokens"], [[0], [1]])
    assert first.fields["tokens"].dtype == np.int64
    np.testing.assert_array_equal(batches[2].fields["positions"], [4])
    assert first.lengths == {} and all(b.rejects == [] for b in batches)


def test_ids_default_to_ordinals(tmp_path):
    records = [{"tokens": [i], "positions": i} for i in range(3)]
    path = write_jsonl(tmp_path / "data.jsonl", [""] + records)
    ids, _, _ = everything(make_spec(path, DECODER))
    assert ids == [0, 1, 2]


def test_dtypes_bfloat16_as_float32_and_bool(tmp_path):
    inputs = {"h": {"shape": ["batch", 2], "dtype": "bfloat16"},
              "m": {"shape": ["batch", 2], "dtype": "bool"},
              "f": {"shape": ["batch"], "dtype": "float16"}}
    path = write_jsonl(tmp_path / "d.jsonl", [{"h": [1, 2.5], "m": [True, 0], "f": 3}])
    (batch,) = read_batches(make_spec(path, inputs))
    assert batch.fields["h"].dtype == np.float32
    np.testing.assert_array_equal(batch.fields["h"], [[1.0, 2.5]])
    assert batch.fields["m"].dtype == np.bool_ and batch.fields["m"].tolist() == [[True, False]]
    assert batch.fields["f"].dtype == np.float16


def test_integral_floats_are_integers(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", [{"tokens": [3.0], "positions": 1e1}])
    (batch,) = read_batches(make_spec(path, DECODER))
    assert batch.fields["tokens"].tolist() == [[3]] and batch.fields["positions"].tolist() == [10]


def test_variable_length_records_give_lengths_and_lists(tmp_path):
    records = [{"tokens": [1, 2, 3], "mask": [1, 1, 0]}, {"tokens": [4], "mask": [True]},
               {"tokens": [5, 6], "mask": [1, 1]}, {"tokens": [7, 8], "mask": [0, 1]}]
    path = write_jsonl(tmp_path / "d.jsonl", records)
    first, second = read_batches(make_spec(path, SEQ, batch_size=2))

    assert first.lengths["seq"].tolist() == [3, 1] and first.lengths["seq"].dtype == np.int64
    assert isinstance(first.fields["tokens"], list)  # shapes differ: one array per record
    assert [a.tolist() for a in first.fields["tokens"]] == [[1, 2, 3], [4]]
    assert first.fields["mask"][0].dtype == np.bool_
    assert second.lengths["seq"].tolist() == [2, 2]
    np.testing.assert_array_equal(second.fields["tokens"], [[5, 6], [7, 8]])  # same shape: dense


@pytest.mark.parametrize("chunk_bytes", [1, 60, 1 << 20])
def test_batches_do_not_depend_on_chunks(tmp_path, monkeypatch, chunk_bytes):
    tuning = Tuning(jsonl_chunk_bytes=chunk_bytes)
    records = [{"tokens": list(range(1 + i % 4)), "mask": [1] * (1 + i % 4)} for i in range(11)]
    path = write_jsonl(tmp_path / "d.jsonl", records)
    batches = list(read_batches(make_spec(path, SEQ, batch_size=4), tuning=tuning))
    assert [len(b) for b in batches] == [4, 4, 3]
    tokens = [a.tolist() for b in batches for a in b.fields["tokens"]]
    assert tokens == [r["tokens"] for r in records]
    assert [n for b in batches for n in b.lengths["seq"].tolist()] == [1, 2, 3, 4] * 2 + [1, 2, 3]


def test_empty_file_gives_no_batches(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", ["", "  "])
    assert list(read_batches(make_spec(path, DECODER))) == []


def test_unknown_suffix_names_accepted_formats(tmp_path):
    path = tmp_path / "data.csv"
    path.write_text("a,b\n")
    with pytest.raises(InputError, match=r"'\.csv'.*\.jsonl, \.npy, \.npz, \.parquet"):
        list(read_batches(make_spec(path, DECODER)))


def test_missing_file(tmp_path):
    with pytest.raises(InputError, match="not found"):
        list(read_batches(make_spec(tmp_path / "nope.jsonl", DECODER)))


# ---- ReadAhead: the first batch read while the runner sets up --------------------------------

def test_read_ahead_reads_the_first_batch_before_it_is_asked_for_then_one_ahead():
    import threading

    started, asked, closed = threading.Event(), [], []

    def source():
        started.set()
        try:
            for i in range(1, 6):
                asked.append(i)
                yield i
        finally:
            closed.append(True)

    batches = stream.ReadAhead(source())  # no byte budget: the next item only
    assert started.wait(5)  # no next() called: the thread is reading
    assert next(batches) == 1
    assert next(batches) == 2
    deadline = time.monotonic() + 5
    while len(asked) < 3 and time.monotonic() < deadline:
        time.sleep(0.01)
    time.sleep(0.1)
    assert asked == [1, 2, 3]  # one ahead of the consumer, never more
    assert list(batches) == [3, 4, 5]
    batches.close()
    assert closed == [True]


def test_read_ahead_reads_on_within_its_byte_budget_and_waits_at_it():
    def source(n):
        for i in range(n):
            yield stream.RecordBatch(indices=np.full(128, i, np.int64), ids=[], where=[],
                                     fields={"x": np.zeros((128, 8), np.float32)}, lengths={})

    per = 128 * 8 + 128 * 8 * 4  # indices + the field: 5,120 bytes a batch
    batches = stream.ReadAhead(source(50), ahead=2, hold_bytes=10 * per)
    deadline = time.monotonic() + 5
    while batches._read < 10 and time.monotonic() < deadline:
        time.sleep(0.01)
    time.sleep(0.2)
    assert batches._read == 10  # the budget, then it waits
    held, ends = batches.peek()  # all it holds, the first two and on to its budget
    assert [int(b.indices[0]) for b in held] == list(range(10)) and not ends
    got = [int(b.indices[0]) for b in batches]
    assert got == list(range(50)) and batches._held == 0
    batches.close()


def test_read_ahead_close_stops_the_thread_at_its_budget_and_closes_the_source():
    closed = []

    def source():
        try:
            while True:
                yield 1
        finally:
            closed.append(True)

    batches = stream.ReadAhead(source(), ahead=3)
    assert batches.peek()[0][:3] == [1, 1, 1]
    batches.close()
    assert closed == [True] and list(batches) == []


def test_read_ahead_raises_a_bad_file_at_the_first_next_and_closes_early(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", ["{not json"])
    spec = make_spec(path, DECODER, on_bad_record="error")
    batches = stream.ReadAhead(read_batches(spec))
    with pytest.raises(InputError, match="d.jsonl:1"):
        next(batches)
    assert list(batches) == []

    records = write_jsonl(tmp_path / "ok.jsonl", decoder_records(10))
    unread = stream.ReadAhead(read_batches(make_spec(records, DECODER)))
    unread.close()  # before any next(): waits for the thread, then closes the reader
    assert list(unread) == []


def test_a_signal_while_setup_waits_for_the_read_ahead_then_close_waits_for_it_too():
    """SIGTERM in setup (StopSignals raises KeyboardInterrupt) while the main thread waits
    for the first batch, still being read: the run then closes the reader. Python 3.11's
    Thread.join, cut short so, marks the reading thread as ended although it is still in the
    generator; closing on that word raised "ValueError: generator already executing" in a
    --gpus worker stopped in setup instead of exiting 143."""
    import os
    import signal
    import sys
    import threading

    from graphrun.job.signals import StopSignals

    inside, release, closed = threading.Event(), threading.Event(), []

    def source():
        try:
            inside.set()
            release.wait(30)  # the first batch's read, still going when the signal comes
            yield 1
            yield 2
        finally:
            closed.append(True)

    main = threading.main_thread().ident

    def waiting_in_peek() -> bool:
        frame = sys._current_frames().get(main)
        names = set()
        while frame is not None:
            names.add(frame.f_code.co_name)
            frame = frame.f_back
        return "peek" in names and bool(names & {"wait", "join", "_wait_for_tstate_lock"})

    def signal_while_waiting():
        assert inside.wait(30)
        while not waiting_in_peek():
            threading.Event().wait(0.005)
        os.kill(os.getpid(), signal.SIGTERM)

    with StopSignals() as stop:
        batches = stream.ReadAhead(source())
        sender = threading.Thread(target=signal_while_waiting)
        sender.start()
        with pytest.raises(KeyboardInterrupt):
            batches.peek()  # data_needs' look at the first batches, in setup
        sender.join(30)
        stop.hold()  # as the run does before it closes what it opened
        assert stop.signum == signal.SIGTERM and not release.is_set()
        threading.Timer(0.2, release.set).start()  # the read ends a little later
        batches.close()  # was: ValueError: generator already executing
    assert closed == [True] and release.is_set()


# ---- start / stop ---------------------------------------------------------------------------

def write_decoder_file(tmp_path: Path, fmt: str, n: int) -> Path:
    tokens = np.arange(n, dtype=np.int64).reshape(n, 1) % 100
    positions = np.arange(n, dtype=np.int64)
    ids = np.array([f"r{i}" for i in range(n)])
    path = tmp_path / f"data.{fmt}"
    if fmt == "jsonl":
        write_jsonl(path, decoder_records(n))
    elif fmt == "npz":
        np.savez(path, tokens=tokens, positions=positions, id=ids)
    elif fmt == "parquet":
        table = pa.table({"id": ids, "tokens": tokens.tolist(), "positions": positions})
        pq.write_table(table, path, row_group_size=3)  # several row groups to seek across
    return path


@pytest.mark.parametrize("fmt", ["jsonl", "npz", "parquet"])
@pytest.mark.parametrize("start,stop", [(0, None), (4, None), (4, 7), (0, 3), (9, 10), (10, 10),
                                        (12, None)])
def test_start_stop_select_ordinals(tmp_path, fmt, start, stop):
    path = write_decoder_file(tmp_path, fmt, 10)
    spec = make_spec(path, DECODER, id_field="id", batch_size=2)
    batches = list(read_batches(spec, start=start, stop=stop))
    expected = list(range(10))[start:stop]
    assert [i for b in batches for i in b.indices.tolist()] == expected
    assert [i for b in batches for i in b.ids] == [f"r{i}" for i in expected]
    assert [p for b in batches for p in b.fields["positions"].tolist()] == expected
    assert all(len(b) == 2 for b in batches[:-1])


def test_npy_start_stop(tmp_path):
    np.save(tmp_path / "x.npy", np.arange(30, dtype=np.float32).reshape(10, 3))
    spec = make_spec(tmp_path / "x.npy", FLOATS, batch_size=4)
    batches = list(read_batches(spec, start=3, stop=8))
    assert [b.indices.tolist() for b in batches] == [[3, 4, 5, 6], [7]]
    assert batches[1].where == ["x.npy[row 7]"] and batches[1].ids.tolist() == [7]
    np.testing.assert_array_equal(batches[1].fields["x"], [[21, 22, 23]])


def test_records_before_start_are_not_parsed(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", ["not json"] + decoder_records(3)[1:])
    ids, rejects, _ = everything(make_spec(path, DECODER, id_field="id"), start=1)
    assert ids == ["r1", "r2"] and rejects == []


# ---- bad JSONL records ----------------------------------------------------------------------

def good(inputs: dict, i: int) -> dict:
    if inputs is DECODER:
        return {"id": f"r{i}", "tokens": [i], "positions": i}
    if inputs is SEQ:
        return {"id": f"r{i}", "tokens": [i, i], "mask": [1, 0]}
    if inputs is PAIRS:
        return {"id": f"r{i}", "xy": [[i, i]]}
    if inputs is SMALL:
        return {"id": f"r{i}", "v": i}
    return {"id": f"r{i}", "x": [i, i, i]}


BAD_JSONL = [  # (inputs, line 3 of 5, the record id a reject carries, reason)
    (DECODER, b'{"id": "r2", "tokens": ["\xff"], "positions": 2}', None, "invalid UTF-8"),
    (DECODER, '{"id": "r2", "tokens": [2,}', None, "invalid JSON: Expecting value (column 27)"),
    (DECODER, '{"id": "r2", "tokens": [2', None,  # cut short: Python's column, not line 2's
     "invalid JSON: Expecting ',' delimiter (column 26)"),
    (DECODER, '{"id": "r2", "tokens": [2], "positions": 2} {"id": "r9"}', None, "invalid JSON"),
    (DECODER, '{"id": "r2", "tokens": [2], "positions": 2, "note": "not closed', None,
     "invalid JSON: the string opened at column 53 is not closed (no closing quote before "
     "the line ends)"),
    (DECODER, '{"id": "r2", "tokens": [2], "positions": 2, "note": "a\tb"}', None,
     "invalid JSON: Invalid control character (column 55)"),
    (DECODER, '{"id": "r2", "tokens": [2], "positions": 2}, {"id": "r9", "tokens": [9], '
              '"positions": 9}', None, "invalid JSON: Extra data"),
    (DECODER, "[1, 2]", None, "the record is an array; expected an object"),
    (DECODER, "7", None, "the record is a number; expected an object"),
    (DECODER, {"id": "r2", "tokens": [2]}, "r2", "missing field 'positions'"),
    (DECODER, {"id": "r2", "token": [2], "positions": 2}, "r2",
     "missing field 'tokens' (expected fields: id, positions, tokens); the record has "
     "'token', which may be it"),
    (DECODER, {"id": "r2", "tokens": [2], "positions": 2, "extra": 1}, "r2",
     "unknown field 'extra'"),
    (DECODER, {"tokens": [2], "positions": 2}, None, "missing id: field 'id' is absent"),
    (DECODER, {"id": None, "tokens": [2], "positions": 2}, None, "missing id"),
    (DECODER, {"id": ["r2"], "tokens": [2], "positions": 2}, None,
     "id field 'id' must be a string or an integer, got an array ([\"r2\"])"),
    (DECODER, '{"id": NaN, "tokens": [2], "positions": 2}', None,
     "id field 'id' must be a string or an integer, got a number (NaN)"),
    (DECODER, '{"id": 1e400, "tokens": [2], "positions": 2}', None,
     "id field 'id' must be a string or an integer, got a number (Infinity)"),
    (DECODER, {"id": 1.5, "tokens": [2], "positions": 2}, None,
     "id field 'id' must be a string or an integer, got a number (1.5)"),
    (DECODER, {"id": "r1", "tokens": [2], "positions": 2}, "r1", "duplicate id 'r1'"),
    (DECODER, {"id": "r2", "tokens": [[2]], "positions": 2}, "r2",
     "tokens: expected rank 1 per record (shape [1]"),
    (DECODER, {"id": "r2", "tokens": 2, "positions": 2}, "r2", "tokens: expected rank 1"),
    (DECODER, {"id": "r2", "tokens": [2, 3], "positions": 2}, "r2",
     "tokens: dimension 0 of a record must be 1 (shape [1]), got 2"),
    (DECODER, {"id": "r2", "tokens": ["a"], "positions": 2}, "r2",
     "tokens: non-numeric value 'a' (a string)"),
    (DECODER, {"id": "r2", "tokens": [None], "positions": 2}, "r2", "tokens: null value"),
    (DECODER, {"id": "r2", "tokens": [{"a": 1}], "positions": 2}, "r2", "a JSON object"),
    (DECODER, {"id": "r2", "tokens": [2.5], "positions": 2}, "r2",
     "tokens: non-integral value 2.5 where int64 is expected"),
    (DECODER, {"id": "r2", "tokens": [2], "positions": True}, "r2",
     "positions: boolean value where int64 numbers are expected"),
    (DECODER, {"id": "r2", "tokens": [100], "positions": 2}, "r2",
     "tokens: value 100 is outside range [0, 100) (lo <= x < hi)"),
    (DECODER, {"id": "r2", "tokens": [-1], "positions": 2}, "r2", "value -1 is outside range"),
    # json reads 2**70 as an int ("does not fit in 64 bits"), orjson as a float ("... int64")
    (DECODER, {"id": "r2", "tokens": [2], "positions": 2**70}, "r2", "does not fit"),
    (SMALL, {"id": "r2", "v": 300}, "r2", "v: value 300 does not fit int8 (-128..127)"),
    # a whole float past any integer dtype is shown as written, not as its 301 digits
    (SMALL, {"id": "r2", "v": 1e300}, "r2", "v: value 1e+300 does not fit int8 (-128..127)"),
    (SMALL, {"id": "r2", "v": 3e9}, "r2", "v: value 3000000000 does not fit int8"),
    (FLOATS, '{"id": "r2", "x": [1, NaN, 2]}', "r2", "x: value nan is NaN or Inf (finite: true)"),
    (FLOATS, '{"id": "r2", "x": [1, -Infinity, 2]}', "r2", "x: value -inf is NaN or Inf"),
    (FLOATS, {"id": "r2", "x": [1, False, 2]}, "r2", "boolean value where float32"),
    (SEQ, {"id": "r2", "tokens": [], "mask": []}, "r2", "tokens: seq length is 0"),
    (SEQ, {"id": "r2", "tokens": [1] * 5, "mask": [1] * 5}, "r2",
     "tokens: seq length 5 exceeds the largest seq bucket 4: add a bucket of at least 5 to "
     "buckets.seq or shorten the record"),
    (SEQ, {"id": "r2", "tokens": [1, 2, 3], "mask": [1, 1]}, "r2",
     "inputs tokens and mask disagree on the seq length: 3 vs 2"),
    (SEQ, {"id": "r2", "tokens": [1, 2], "mask": [1, 2]}, "r2",
     "mask: value 2 where a boolean (true/false or 0/1) is expected"),
    (PAIRS, {"id": "r2", "xy": [[1, 2], [3]]}, "r2", "xy: ragged nested lists"),
    (PAIRS, {"id": "r2", "xy": [[1, 2], 3]}, "r2", "xy: ragged nested lists"),
]


@pytest.mark.parametrize("inputs,bad,rid,reason", BAD_JSONL)
def test_bad_jsonl_record_is_skipped_with_reason(tmp_path, inputs, bad, rid, reason):
    records = [good(inputs, i) for i in range(5)]
    records[2] = bad
    path = write_jsonl(tmp_path / "data.jsonl", records)
    spec = make_spec(path, inputs, id_field="id", batch_size=2, on_bad_record="skip")
    ids, rejects, batches = everything(spec)

    assert ids == ["r0", "r1", "r3", "r4"]
    (reject,) = rejects
    assert (reject.index, reject.id, reject.where) == (2, rid, "data.jsonl:3")
    assert reason in reject.reason
    assert sum(len(b) + len(b.rejects) for b in batches) == 5


@pytest.mark.parametrize("inputs,bad,rid,reason", BAD_JSONL)
def test_bad_jsonl_record_stops_the_run(tmp_path, inputs, bad, rid, reason):
    records = [good(inputs, i) for i in range(5)]
    records[2] = bad
    path = write_jsonl(tmp_path / "data.jsonl", records)
    spec = make_spec(path, inputs, id_field="id", batch_size=2, on_bad_record="error")
    batches = []
    with pytest.raises(InputError) as err:
        for b in read_batches(spec):
            batches.append(b)
    assert str(err.value).startswith("data.jsonl:3: ")
    assert reason in str(err.value)
    assert err.value.where == "data.jsonl:3" and err.value.record_id == rid
    assert [b.ids for b in batches] == [["r0", "r1"]]  # the full batch before it came out


def test_truncated_last_line(tmp_path):
    path = tmp_path / "data.jsonl"
    write_jsonl(path, decoder_records(2))
    with open(path, "ab") as f:
        f.write(b'{"id": "r2", "tokens": [')
    spec = make_spec(path, DECODER, id_field="id", on_bad_record="skip")
    ids, (reject,), _ = everything(spec)
    assert ids == ["r0", "r1"]
    assert (reject.index, reject.where) == (2, "data.jsonl:3")
    assert reject.reason == "truncated last line (the file ends mid-record)"


def test_last_line_without_newline_is_fine_when_whole(tmp_path):
    path = tmp_path / "data.jsonl"
    path.write_text(json.dumps(decoder_records(1)[0]))
    assert everything(make_spec(path, DECODER, id_field="id"))[0] == ["r0"]


def test_record_split_over_two_lines_is_rejected_twice(tmp_path):
    records = decoder_records(4)
    lines = [json.dumps(r) for r in records]
    half = len(lines[1]) // 2
    lines[1:2] = [lines[1][:half], lines[1][half:]]  # the two halves parse only when joined
    path = write_jsonl(tmp_path / "d.jsonl", lines)
    ids, rejects, _ = everything(make_spec(path, DECODER, id_field="id", on_bad_record="skip"))
    assert ids == ["r0", "r2", "r3"]
    assert [(r.where, r.reason.split(":")[0]) for r in rejects] == [
        ("d.jsonl:2", "invalid JSON"), ("d.jsonl:3", "invalid JSON")]


def test_bool_input_takes_true_false_and_0_1(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", [{"tokens": [1, 2], "mask": [True, 0]}])
    (batch,) = read_batches(make_spec(path, SEQ))
    assert batch.fields["mask"].tolist() == [[True, False]]


def test_id_in_text_true_does_not_make_a_bool(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", [{"id": "true", "tokens": [1], "positions": 2}])
    assert everything(make_spec(path, DECODER, id_field="id"))[0] == ["true"]


def test_skip_counts_add_up_and_rejects_keep_file_order(tmp_path):
    records = decoder_records(12)
    for i in (0, 3, 4, 5, 11):
        records[i] = {**records[i], "tokens": [1000]}
    path = write_jsonl(tmp_path / "d.jsonl", records)
    spec = make_spec(path, DECODER, id_field="id", batch_size=3, on_bad_record="skip")
    batches = list(read_batches(spec))

    assert [b.indices.tolist() for b in batches] == [[1, 2, 6], [7, 8, 9], [10]]
    assert [[r.index for r in b.rejects] for b in batches] == [[0, 3, 4, 5], [], [11]]
    assert sum(len(b) + len(b.rejects) for b in batches) == 12


def test_all_bad_gives_a_batch_of_rejects_only(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", ["nope", "[]"])
    (batch,) = read_batches(make_spec(path, SEQ, on_bad_record="skip"))
    assert len(batch) == 0 and [r.index for r in batch.rejects] == [0, 1]
    assert batch.fields["tokens"].shape == (0, 0) and batch.fields["mask"].dtype == np.bool_
    assert batch.lengths["seq"].tolist() == []


def test_long_run_of_bad_records_is_handed_out_early(tmp_path, monkeypatch):
    tuning = Tuning(rejects_held=3, jsonl_chunk_bytes=1)
    records = decoder_records(10)
    for i in range(1, 8):
        records[i] = "bad"
    path = write_jsonl(tmp_path / "d.jsonl", records)
    spec = make_spec(path, DECODER, id_field="id", batch_size=4, on_bad_record="skip")
    batches = list(read_batches(spec, tuning=tuning))
    assert [b.indices.tolist() for b in batches] == [[0], [], [8, 9]]
    assert [[r.index for r in b.rejects] for b in batches] == [[1, 2, 3], [4, 5, 6], [7]]


# ---- npy -------------------------------------------------------------------------------------

def test_npy_dense_values(tmp_path):
    data = np.arange(15, dtype=np.float64).reshape(5, 3)
    np.save(tmp_path / "x.npy", data)
    batches = list(read_batches(make_spec(tmp_path / "x.npy", FLOATS, batch_size=2)))
    assert [b.ids.tolist() for b in batches] == [[0, 1], [2, 3], [4]]
    # ordinal ids stay one int64 array per batch: no Python int per record
    assert all(b.ids.dtype == np.int64 for b in batches)
    assert all(isinstance(b.fields["x"], np.ndarray) for b in batches)
    assert batches[0].fields["x"].dtype == np.float32
    np.testing.assert_array_equal(np.concatenate([b.fields["x"] for b in batches]), data)


@pytest.mark.parametrize("chunk_bytes", [1, 40, 1 << 20])
def test_npy_checks_values_across_chunks(tmp_path, monkeypatch, chunk_bytes):
    tuning = Tuning(array_chunk_bytes=chunk_bytes)
    data = np.ones((7, 3), np.float32)
    data[1, 2], data[5, 0] = np.nan, np.inf
    np.save(tmp_path / "x.npy", data)
    spec = make_spec(tmp_path / "x.npy", FLOATS, batch_size=2, on_bad_record="skip")
    ids, rejects, batches = everything(spec, tuning=tuning)
    assert ids == [0, 2, 3, 4, 6]
    assert [(r.index, r.id, r.where) for r in rejects] == [(1, 1, "x.npy[row 1]"),
                                                          (5, 5, "x.npy[row 5]")]
    assert "NaN or Inf" in rejects[0].reason
    assert [len(b) for b in batches] == [2, 2, 1]


def test_npy_range_error_names_the_row(tmp_path):
    np.save(tmp_path / "t.npy", np.array([[1], [2], [500]]))
    spec = make_spec(tmp_path / "t.npy", {"tokens": DECODER["tokens"]})
    with pytest.raises(InputError, match=r"^t\.npy\[row 2\]: record 2: tokens: value 500 is "
                                         r"outside range \[0, 100\)"):
        list(read_batches(spec))


def test_npy_float_to_int_checks_integral(tmp_path):
    np.save(tmp_path / "t.npy", np.array([[1.0], [2.5]]))
    spec = make_spec(tmp_path / "t.npy", {"tokens": DECODER["tokens"]}, on_bad_record="skip")
    ids, (reject,), batches = everything(spec)
    assert ids == [0] and batches[0].fields["tokens"].dtype == np.int64
    assert "non-integral value 2.5" in reject.reason


@pytest.mark.parametrize("array,message", [
    (np.zeros((4, 2), np.float32), r"dimension 0 of a record must be 3 .*array shape \[4, 2\]"),
    (np.zeros((4,), np.float32), "expected rank 1"),
    (np.array([["a", "b", "c"]]), "not numeric"),
    (np.zeros((2, 3), bool), "booleans where float32"),
])
def test_npy_whole_file_problems_raise_even_when_skipping(tmp_path, array, message):
    np.save(tmp_path / "x.npy", array)
    with pytest.raises(InputError, match=message):
        list(read_batches(make_spec(tmp_path / "x.npy", FLOATS, on_bad_record="skip")))


def test_npy_cut_short_or_not_npy_says_so(tmp_path):
    """A .npy cut short was "cannot read the .npy file: mmap length is greater than file
    size"; a file that is no .npy was numpy's "contains pickled (object) data ... load it
    unsafely using allow_pickle", advice graphrun cannot take and the user should not."""
    np.save(tmp_path / "x.npy", np.zeros((4, 3), np.float32))
    raw = (tmp_path / "x.npy").read_bytes()
    (tmp_path / "x.npy").write_bytes(raw[:-10])
    with pytest.raises(InputError) as err:
        list(read_batches(make_spec(tmp_path / "x.npy", FLOATS)))
    assert str(err.value) == (
        "x.npy: its header says [4, 3] float32 (48 bytes) but the file holds 38 bytes after "
        "it: the file is truncated (a copy or download cut short?); write it again")
    (tmp_path / "x.npy").write_bytes(b"id,x\n1,2\n")
    with pytest.raises(InputError) as err:
        list(read_batches(make_spec(tmp_path / "x.npy", FLOATS)))
    assert str(err.value).startswith("x.npy: not a valid .npy array: the magic string is not "
                                      "correct")
    assert "pickle" not in str(err.value)


def test_npy_needs_a_single_input_and_no_id_field(tmp_path):
    np.save(tmp_path / "x.npy", np.zeros((2, 1)))
    with pytest.raises(InputError, match="use .npz"):
        list(read_batches(make_spec(tmp_path / "x.npy", DECODER)))
    with pytest.raises(InputError, match="holds no ids"):
        list(read_batches(make_spec(tmp_path / "x.npy", FLOATS, id_field="id")))


def test_npy_seq_axis_lengths_and_bucket_limit(tmp_path):
    np.save(tmp_path / "t.npy", np.ones((3, 4), np.int64))
    (batch,) = read_batches(make_spec(tmp_path / "t.npy", {"tokens": SEQ["tokens"]}))
    assert batch.lengths["seq"].tolist() == [4, 4, 4]
    np.save(tmp_path / "t.npy", np.ones((3, 5), np.int64))
    with pytest.raises(InputError, match="exceeds the largest seq bucket 4"):
        list(read_batches(make_spec(tmp_path / "t.npy", {"tokens": SEQ["tokens"]})))


# ---- npz -------------------------------------------------------------------------------------

@pytest.mark.parametrize("save", [np.savez, np.savez_compressed])
def test_npz_values_ids_and_duplicates(tmp_path, save, monkeypatch):
    tuning = Tuning(array_chunk_bytes=50)
    n = 9
    ids = np.array([10, 11, 12, 11, 14, 15, 16, 17, 18])
    tokens = (np.arange(n) * 7 % 100).reshape(n, 1)
    tokens[6, 0] = 100  # out of range
    save(tmp_path / "d.npz", tokens=tokens, positions=np.arange(n), key=ids)
    spec = make_spec(tmp_path / "d.npz", DECODER, id_field="key", batch_size=4,
                     on_bad_record="skip")
    got, rejects, batches = everything(spec, tuning=tuning)
    assert got == [10, 11, 12, 14, 15, 17, 18]
    assert [(r.index, r.id, r.where) for r in rejects] == [(3, 11, "d.npz[row 3]"),
                                                          (6, 16, "d.npz[row 6]")]
    assert "duplicate id 11" in rejects[0].reason and "outside range" in rejects[1].reason
    np.testing.assert_array_equal(np.concatenate([b.fields["positions"] for b in batches]),
                                  [0, 1, 2, 4, 5, 7, 8])
    assert list(read_batches(spec, start=7, tuning=tuning))[0].ids.tolist() == [17, 18]
    assert all(b.ids.dtype == np.int64 for b in batches)  # integer ids stay int64 arrays
    assert all(type(r.id) is int for r in rejects)  # a reject's id is a plain int


def test_integer_ids_are_int64_arrays_and_duplicates_across_chunks_are_found(tmp_path,
                                                                              monkeypatch):
    tuning = Tuning(array_chunk_rows=3)
    ids = np.array([4, 9, 2, 7, 9, 1, 2, 8], np.int32)  # 9 again in chunk 2, 2 in chunk 3
    n = len(ids)
    for path in (tmp_path / "d.npz", tmp_path / "d.parquet"):
        if path.suffix == ".npz":
            np.savez(path, tokens=np.ones((n, 1), np.int64), positions=np.arange(n), key=ids)
        else:
            pq.write_table(pa.table({"key": pa.array(ids), "tokens": [[1]] * n,
                                     "positions": list(range(n))}), path, row_group_size=4)
        spec = make_spec(path, DECODER, id_field="key", batch_size=4, on_bad_record="skip")
        got, rejects, batches = everything(spec, tuning=tuning)
        assert got == [4, 9, 2, 7, 1, 8], path.name
        assert all(isinstance(b.ids, np.ndarray) and b.ids.dtype == np.int64 for b in batches)
        assert [(r.index, r.id, r.reason) for r in rejects] == [
            (4, 9, "duplicate id 9: an earlier record has the same id"),
            (6, 2, "duplicate id 2: an earlier record has the same id")], path.name
        assert all(type(r.id) is int for r in rejects)


def test_uint64_ids_past_int64_stay_python_ints(tmp_path):
    ids = np.array([2**63 + 5, 3], np.uint64)
    np.savez(tmp_path / "d.npz", tokens=np.ones((2, 1), np.int64), positions=np.arange(2),
             key=ids)
    got, _, _ = everything(make_spec(tmp_path / "d.npz", DECODER, id_field="key"))
    assert got == [2**63 + 5, 3] and all(type(i) is int for i in got)


@pytest.mark.parametrize("save", [np.savez, np.savez_compressed])
def test_npz_bytes_ids_are_read_as_utf8_and_one_that_is_not_is_a_bad_record(tmp_path, save):
    """A bytes (S) id array holding a non-ASCII id (b'\\xc3\\xa9', b'\\xff') stopped the run
    with numpy's UnicodeDecodeError and a traceback."""
    ids = np.array([b"a", "\u00e9".encode(), b"\xff\xfe", b"d"])
    save(tmp_path / "d.npz", tokens=np.ones((4, 1), np.int64), positions=np.arange(4), key=ids)
    spec = make_spec(tmp_path / "d.npz", DECODER, id_field="key", on_bad_record="skip")
    got, rejects, _ = everything(spec)
    assert got == ["a", "\u00e9", "d"]
    assert [(r.index, r.id, r.where, r.reason) for r in rejects] == [
        (2, None, "d.npz[row 2]", "id b'\\xff\\xfe' is not valid UTF-8 (byte 0xff at byte 0): "
         "store the ids as text (a numpy str array) or integers")]
    spec = make_spec(tmp_path / "d.npz", DECODER, id_field="key", on_bad_record="error")
    with pytest.raises(InputError, match=r"^d\.npz\[row 2\]: id b'\\xff\\xfe' is not valid"):
        everything(spec)


def test_parquet_integer_ids_with_a_null_are_read_as_values(tmp_path):
    pq.write_table(pa.table({"key": pa.array([5, None, 6], pa.int64()),
                             "tokens": [[1], [2], [3]], "positions": [0, 1, 2]}),
                   tmp_path / "d.parquet")
    spec = make_spec(tmp_path / "d.parquet", DECODER, id_field="key", on_bad_record="skip")
    got, rejects, _ = everything(spec)
    assert got == [5, 6]
    assert [(r.index, r.id, r.reason) for r in rejects] == [
        (1, None, "missing id: 'key' is null")]


def test_npz_stored_member_shorter_than_its_header_is_an_error(tmp_path):
    """A stored member cut short (its .npy header whole): the memory map read the last rows
    from the zip's directory after it, and the run completed with those values."""
    import io
    import zipfile

    buf = io.BytesIO()
    np.save(buf, np.arange(12, dtype=np.float32).reshape(4, 3))
    with zipfile.ZipFile(tmp_path / "d.npz", "w") as zf:  # stored, not deflated
        zf.writestr("x.npy", buf.getvalue()[:-8])
    spec = make_spec(tmp_path / "d.npz", {"x": {"shape": ["batch", 3], "dtype": "float32"}})
    with pytest.raises(InputError) as err:
        everything(spec)
    assert str(err.value) == (
        "d.npz: x.npy: its header says [4, 3] float32 (48 bytes) but the member holds 40 "
        "bytes after it: the file is truncated or damaged; write it again")


def test_npz_stored_members_are_memory_mapped(tmp_path):
    np.savez(tmp_path / "d.npz", x=np.arange(12, dtype=np.float32).reshape(4, 3))
    import zipfile
    with zipfile.ZipFile(tmp_path / "d.npz") as zf:
        member = npz_member(tmp_path / "d.npz", zf, "x.npy")
    assert isinstance(member, np.memmap)
    np.testing.assert_array_equal(member[2], [6, 7, 8])


@pytest.mark.parametrize("arrays,message", [
    ({"tokens": np.zeros((3, 1)), "positions": np.zeros(2)}, "same number of records"),
    ({"tokens": np.zeros((3, 1))}, "array 'positions' is missing"),
    ({"tokens": np.zeros((3, 1)), "positions": np.zeros(3), "id": np.zeros((3, 2))},
     "one scalar per record"),
])
def test_npz_whole_file_problems(tmp_path, arrays, message):
    np.savez(tmp_path / "d.npz", **arrays)
    spec = make_spec(tmp_path / "d.npz", DECODER, id_field="id" if "id" in arrays else None,
                     on_bad_record="skip")
    with pytest.raises(InputError, match=message):
        list(read_batches(spec))


def test_npz_string_ids(tmp_path):
    np.savez(tmp_path / "d.npz", x=np.zeros((2, 3)), id=np.array([b"a", b"b"]))
    ids, _, _ = everything(make_spec(tmp_path / "d.npz", FLOATS, id_field="id"))
    assert ids == ["a", "b"]


# ---- Parquet ---------------------------------------------------------------------------------

def test_parquet_variable_lengths_stay_columnar(tmp_path):
    table = pa.table({"id": ["a", "b", "c"], "tokens": [[1, 2, 3], [4], [5, 6]],
                      "mask": [[True, True, False], [True], [True, True]]})
    pq.write_table(table, tmp_path / "d.parquet")
    first, second = read_batches(make_spec(tmp_path / "d.parquet", SEQ, id_field="id",
                                           batch_size=2))
    assert first.ids == ["a", "b"] and first.where == ["d.parquet[row 0]", "d.parquet[row 1]"]
    assert [a.tolist() for a in first.fields["tokens"]] == [[1, 2, 3], [4]]
    assert first.lengths["seq"].tolist() == [3, 1]
    assert second.fields["mask"].tolist() == [[True, True]]


def test_parquet_fixed_size_lists_are_dense(tmp_path):
    x = pa.FixedSizeListArray.from_arrays(pa.array(np.arange(12, dtype=np.float32)), 3)
    pq.write_table(pa.table({"x": x}), tmp_path / "d.parquet")
    (batch,) = read_batches(make_spec(tmp_path / "d.parquet", FLOATS))
    np.testing.assert_array_equal(batch.fields["x"], np.arange(12).reshape(4, 3))


def test_parquet_nested_lists(tmp_path):
    table = pa.table({"xy": [[[1, 2], [3, 4]], [[5, 6]], [[7, 8], [9]]]})
    pq.write_table(table, tmp_path / "d.parquet")
    spec = make_spec(tmp_path / "d.parquet", PAIRS, on_bad_record="skip")
    ids, (reject,), batches = everything(spec)
    assert ids == [0, 1] and [a.shape for a in batches[0].fields["xy"]] == [(2, 2), (1, 2)]
    assert reject.index == 2 and "ragged nested lists" in reject.reason


def test_parquet_nulls_and_checks(tmp_path):
    table = pa.table({"id": ["a", None, "c", "d", "e", "c", "a"],
                      "tokens": [[1], [2], None, [None], [300], [6], [7]],
                      "positions": [0, 1, 2, 3, 4, 5, 6]})
    pq.write_table(table, tmp_path / "d.parquet")
    spec = make_spec(tmp_path / "d.parquet", DECODER, id_field="id", on_bad_record="skip")
    ids, rejects, _ = everything(spec)
    assert ids == ["a", "c"]  # the first "c" was rejected, so its id was not taken
    assert [(r.index, r.id, r.where) for r in rejects] == [
        (1, None, "d.parquet[row 1]"), (2, "c", "d.parquet[row 2]"), (3, "d", "d.parquet[row 3]"),
        (4, "e", "d.parquet[row 4]"), (6, "a", "d.parquet[row 6]")]
    reasons = [r.reason for r in rejects]
    assert "missing id" in reasons[0] and "tokens: null, where" in reasons[1]
    assert "null value" in reasons[2] and "value 300 is outside range" in reasons[3]
    assert "duplicate id 'a'" in reasons[4]


def test_parquet_bad_record_error_names_the_row(tmp_path):
    table = pa.table({"tokens": [[1], [2, 3]], "positions": [0, 1]})
    pq.write_table(table, tmp_path / "d.parquet")
    with pytest.raises(InputError, match=r"^d\.parquet\[row 1\]: record 1: tokens: dimension 0"):
        list(read_batches(make_spec(tmp_path / "d.parquet", DECODER)))


@pytest.mark.parametrize("columns,message", [
    ({"tokens": [[1]]}, "column 'positions' is missing"),
    ({"tokens": [["a"]], "positions": [1]}, "column 'tokens' holds string"),
    ({"tokens": [1], "positions": [1]}, "column 'tokens' nests lists 0 deep"),
    ({"tokens": [[True]], "positions": [1]}, "holds bool"),
    ({"tokens": [[1]], "positions": [1], "id": [[1]]}, "one scalar per record"),
])
def test_parquet_whole_file_problems(tmp_path, columns, message):
    pq.write_table(pa.table(columns), tmp_path / "d.parquet")
    spec = make_spec(tmp_path / "d.parquet", DECODER, id_field="id" if "id" in columns else None,
                     on_bad_record="skip")
    with pytest.raises(InputError, match=message):
        list(read_batches(spec))


def write_row_groups(path: Path, n: int, group_rows: int) -> Path:
    """n decoder records, id "r<i>", in row groups of group_rows rows; a null id at row 13 and an
    out-of-range token at row 22, to be rejected."""
    ids = [None if i == 13 else f"r{i}" for i in range(n)]
    tokens = [[100 if i == 22 else i % 100] for i in range(n)]
    pq.write_table(pa.table({"id": ids, "tokens": tokens, "positions": list(range(n))}), path,
                   row_group_size=group_rows)
    return path


# threads, bytes decoded ahead, largest row group decoded whole (else streamed), chunk bytes
PARQUET_READS = [(1, 1 << 30, 1 << 30, 1 << 20), (4, 1 << 30, 1 << 30, 1 << 20),
                 (4, 1, 1 << 30, 1 << 20), (4, 1 << 30, 1, 1 << 20), (3, 1 << 30, 1 << 30, 40)]


@pytest.mark.parametrize("threads,ahead,whole,chunk_bytes", PARQUET_READS)
@pytest.mark.parametrize("start,stop", [(0, None), (5, 31), (7, 14), (21, 22), (35, None)])
def test_parquet_row_groups_decoded_ahead_keep_file_order(tmp_path, monkeypatch, threads, ahead,
                                                          whole, chunk_bytes, start, stop):
    """However many row groups are decoded at once, or streamed, and wherever start and stop cut
    them: the same records, rejects and locations, in file order."""
    tuning = Tuning(parquet_threads=threads, parquet_ahead_bytes=ahead,
                    parquet_group_bytes=whole, array_chunk_bytes=chunk_bytes)
    path = write_row_groups(tmp_path / "d.parquet", 40, group_rows=7)
    spec = make_spec(path, DECODER, id_field="id", batch_size=3, on_bad_record="skip")
    ids, rejects, batches = everything(spec, start=start, stop=stop, tuning=tuning)
    rows = range(40)[start:stop]
    assert ids == [f"r{i}" for i in rows if i not in (13, 22)]
    assert [p for b in batches for p in b.fields["positions"].tolist()] == [
        i for i in rows if i not in (13, 22)]
    assert [w for b in batches for w in b.where] == [
        f"d.parquet[row {i}]" for i in rows if i not in (13, 22)]
    assert [(r.index, r.id, r.where) for r in rejects] == [
        (i, None if i == 13 else f"r{i}", f"d.parquet[row {i}]") for i in (13, 22) if i in rows]


@pytest.mark.parametrize("threads,ahead,most", [(4, 1 << 30, 4), (2, 1 << 30, 2), (4, 1, 1)])
def test_parquet_decodes_a_few_row_groups_ahead_at_most(tmp_path, monkeypatch, threads, ahead,
                                                        most):
    """Row groups are decoded ahead of the reader by at most PARQUET_THREADS of them, and by
    one only where PARQUET_AHEAD_BYTES holds less than two: never the whole file."""
    tuning = Tuning(parquet_threads=threads, parquet_ahead_bytes=ahead)
    started = []
    decode = parquet_in.decode_group
    # a patch: a spy on the decoding pool's step, inside read_batches, with no caller
    monkeypatch.setattr(parquet_in, "decode_group", lambda path, tuning, meta, group, *a: (
        started.append(group), decode(path, tuning, meta, group, *a))[1])
    path = write_row_groups(tmp_path / "d.parquet", 40, group_rows=4)
    spec = make_spec(path, DECODER, id_field="id", batch_size=1, on_bad_record="skip")
    for batch in read_batches(spec, tuning=tuning):
        if len(batch):  # held while its row group is read: the next `most` may be decoded
            assert max(started) <= batch.indices[0] // 4 + most
    # each group decoded once; the pool's threads may start two of them in either order
    assert sorted(started) == list(range(10))


def test_parquet_row_groups_too_big_to_decode_whole_are_streamed(tmp_path, monkeypatch):
    """Row groups of 4, 4, 20, 4 and 8 rows, those of 20 and 8 over PARQUET_GROUP_BYTES: they
    are streamed in their turn, the others decoded ahead, all read in file order."""
    path = tmp_path / "d.parquet"
    ids = np.array([f"r{i}" for i in range(40)])
    table = pa.table({"id": ids, "tokens": (np.arange(40) % 100).reshape(40, 1).tolist(),
                      "positions": np.arange(40)})
    with pq.ParquetWriter(path, table.schema) as w:
        for lo, hi, rows in [(0, 8, 4), (8, 28, 20), (28, 32, 4), (32, 40, 8)]:
            w.write_table(table.slice(lo, hi - lo), row_group_size=rows)
    meta = pq.ParquetFile(path).metadata
    spec = make_spec(path, DECODER, id_field="id", batch_size=3)
    tuning = Tuning(parquet_group_bytes=max(
        parquet_in.decoded_bytes(meta.row_group(g), spec) for g in (0, 1, 3)))
    started = []
    decode = parquet_in.decode_group
    # a patch: a spy on the decoding pool's step, inside read_batches, with no caller
    monkeypatch.setattr(parquet_in, "decode_group", lambda path, tuning, meta, group, *a: (
        started.append(group), decode(path, tuning, meta, group, *a))[1])
    ids, rejects, _ = everything(spec, start=2, tuning=tuning)
    assert ids == [f"r{i}" for i in range(2, 40)] and rejects == []
    assert [meta.row_group(g).num_rows for g in range(5)] == [4, 4, 20, 4, 8]
    assert sorted(started) == [0, 1, 3]


def test_parquet_damaged_row_group_in_the_middle(tmp_path, monkeypatch):
    """The row groups before the damaged one are read (those after it may be decoded already),
    then the damage is an InputError naming the file, the row group and its rows (it named the
    file alone: which records were lost was not said)."""
    tuning = Tuning(parquet_threads=4)
    path = write_row_groups(tmp_path / "d.parquet", 40, group_rows=8)
    column = pq.ParquetFile(path).metadata.row_group(2).column(1)  # tokens of rows 16..23
    at = column.dictionary_page_offset or column.data_page_offset
    raw = bytearray(path.read_bytes())
    raw[at:at + 8] = b"\xff" * 8  # its page header cannot be decoded
    path.write_bytes(bytes(raw))
    spec = make_spec(path, DECODER, id_field="id", batch_size=1, on_bad_record="skip")
    read = []
    with pytest.raises(InputError, match=r"(?s)^d\.parquet: cannot decode row group 2 \(rows 16 "
                       r"to 23\) of the Parquet file: .*; the file is damaged there: write it "
                       r"again$"):
        for batch in read_batches(spec, tuning=tuning):
            read.extend(batch.indices.tolist())
    assert read == [i for i in range(16) if i != 13]


def write_mixed_row_groups(path: Path) -> Path:
    """30 records in row groups of 8: ids "r<i>" with "r3" again at row 20 (a duplicate in a
    later row group), an int32 column `v` read as int64 with range [0, 100) (150 at row 9), a
    float64 column `x` read as float32 with finite: true (NaN at row 17, 1e300 at row 26, Inf
    once float32), and a null `x` at row 12 (its row group's chunk read as Python values)."""
    n = 30
    ids = [f"r{3 if i == 20 else i}" for i in range(n)]
    v = pa.array([[150 if i == 9 else i] for i in range(n)], pa.list_(pa.int32()))
    x = [None if i == 12 else [float("nan") if i == 17 else 1e300 if i == 26 else i / 2, -i]
         for i in range(n)]
    pq.write_table(pa.table({"id": ids, "v": v, "x": pa.array(x, pa.list_(pa.float64()))}),
                   path, row_group_size=8)
    return path


MIXED = {"v": {"shape": ["batch", 1], "dtype": "int64", "range": [0, 100]},
         "x": {"shape": ["batch", 2], "dtype": "float32", "finite": True}}
MIXED_BAD = {9: "v: value 150 is outside range [0, 100) (lo <= x < hi)",
             12: "x: null, where the record's value (an array of numbers, or a number) is expected",
             17: "x: value nan is NaN or Inf (finite: true)",
             20: "duplicate id 'r3': an earlier record has the same id",
             26: "x: value 1e+300 is too large for float32 (finite: true)"}


@pytest.mark.parametrize("start,stop", [(0, None), (3, 21), (12, 13), (13, 30)])
def test_parquet_chunks_checked_on_the_pool_read_as_on_the_readers_thread(
        tmp_path, monkeypatch, start, stop):
    """Row groups decoded ahead are converted and checked (all but duplicate ids) on the pool
    threads; a chunk with nulls is left to the reader's thread. Either way, and streamed on the
    reader's thread, the same values, dtypes, ids, rejects and reasons, in file order."""
    import threading

    from graphrun.read import checks

    path = write_mixed_row_groups(tmp_path / "d.parquet")
    spec = make_spec(path, MIXED, id_field="id", batch_size=3, on_bad_record="skip")
    where = []  # (thread, first row) of each chunk prechecked
    precheck = checks.precheck

    def recorded(spec, c):
        where.append((threading.current_thread().name.split("_")[0], int(c.indices[0])))
        return precheck(spec, c)

    # patches: spies on the checks' threads, inside read_batches, with no caller
    monkeypatch.setattr(parquet_in, "precheck", recorded)  # on the pool threads
    monkeypatch.setattr(checks, "precheck", recorded)  # by RecordChecker.check

    def read(tuning):
        ids, rejects, batches = everything(spec, start=start, stop=stop, tuning=tuning)
        return (ids, [(r.index, r.id, r.where, r.reason) for r in rejects],
                [len(b) for b in batches],
                np.concatenate([b.fields["v"] for b in batches]),
                np.concatenate([b.fields["x"] for b in batches]))

    ahead = read(Tuning())
    pooled = sorted(where)
    where.clear()
    streamed = read(Tuning(parquet_group_bytes=1))  # every row group streamed
    assert {name for name, _ in where} == {"MainThread"}
    end = 30 if stop is None else stop
    chunks = [(max(lo, start), min(lo + 8, end)) for lo in range(0, 30, 8)
              if lo + 8 > start and lo < end]  # one per row group, cut by start and stop
    assert pooled == sorted(("MainThread" if lo <= 12 < hi else "parquet", lo)
                            for lo, hi in chunks)
    rows = range(30)[start:stop]
    bad = {i: reason for i, reason in MIXED_BAD.items() if i in rows and (i != 20 or 3 in rows)}
    good = [i for i in rows if i not in bad]
    for got in (ahead, streamed):
        ids, rejects, sizes, v, x = got
        assert ids == [f"r{3 if i == 20 else i}" for i in good]
        assert rejects == [(i, f"r{3 if i == 20 else i}", f"d.parquet[row {i}]", reason)
                           for i, reason in bad.items()]
        assert v.dtype == np.int64 and v[:, 0].tolist() == good
        assert x.dtype == np.float32 and x.tolist() == [[i / 2, -i] for i in good]
    assert ahead[2] == streamed[2]


def test_parquet_chunks_hold_whole_batches(tmp_path, monkeypatch):
    """A chunk of a row group is cut to whole batches where it can (a batch across a chunk edge
    is a copy): chunks of 10 rows become 8 with batches of 4."""
    tuning = Tuning(array_chunk_rows=10)
    path = write_row_groups(tmp_path / "d.parquet", 40, group_rows=20)
    spec = make_spec(path, DECODER, id_field="id", batch_size=4, on_bad_record="skip")
    chunks = list(parquet_in.ParquetReader(path, spec, tuning).chunks(0, None))
    assert [len(c.indices) for c in chunks] == [8, 8, 4, 8, 8, 4]
    assert [int(c.indices[0]) for c in chunks] == [0, 8, 16, 20, 28, 36]
    ids, rejects, batches = everything(spec, tuning=tuning)
    assert ids == [f"r{i}" for i in range(40) if i not in (13, 22)]
    assert [r.index for r in rejects] == [13, 22]


@pytest.mark.parametrize("inputs,per_record", [
    (SMALL, 4 + 8),  # int32 values read as int8: counted at their 4 bytes, and an ordinal
    ({"v": {"shape": ["batch"], "dtype": "int64"}}, 8 + 8),  # converted to 8 bytes
])
def test_parquet_decoded_bytes_count_values_as_held(tmp_path, inputs, per_record):
    """Row groups are decoded ahead as far as their bytes once decoded and converted fit in
    PARQUET_AHEAD_BYTES: each value at the wider of the file's and the input's width."""
    pq.write_table(pa.table({"v": pa.array(range(100), pa.int32())}), tmp_path / "d.parquet")
    meta = pq.ParquetFile(tmp_path / "d.parquet").metadata
    spec = make_spec(tmp_path / "d.parquet", inputs)
    assert parquet_in.decoded_bytes(meta.row_group(0), spec) == 100 * per_record


def test_jsonl_reads_the_same_without_orjson(tmp_path, monkeypatch):
    """orjson is optional: without it the block parse falls back to the json module."""
    lines = [json.dumps({"id": f"r{i}", "tokens": [i], "positions": i}) for i in range(50)]
    lines[7] = '{"id": "r7", "tokens": [NaN], "positions": 7}'
    (tmp_path / "data.jsonl").write_text("\n".join(lines) + "\n")
    spec = PipelineSpec.model_validate({
        "version": 1, "name": "t", "model": {"builtin": "decoder"},
        "inputs": {"tokens": {"shape": ["batch", 1], "dtype": "int64", "range": [0, 100]},
                   "positions": {"shape": ["batch"], "dtype": "int64"}},
        "outputs": {"logits": {"shape": ["batch", 1, 512]}}, "buckets": {"batch": [8]},
        "data": {"path": str(tmp_path / "data.jsonl"), "id_field": "id", "batch_size": 8,
                 "on_bad_record": "skip"},
        "output": {"dir": str(tmp_path / "o")}})

    def read():
        batches = list(stream.read_batches(spec))
        return ([i for b in batches for i in b.ids],
                [(r.index, r.where, r.reason) for b in batches for r in b.rejects])

    with_orjson = read()
    # a patch: orjson missing is the environment's (an optional package)
    monkeypatch.setattr(jsonl_parse, "_orjson", None)
    assert read() == with_orjson
    ids, rejects = with_orjson
    assert len(ids) == 49 and rejects[0][:2] == (7, "data.jsonl:8")


@pytest.mark.parametrize("madvise", ["missing", "failing"])
def test_npy_pages_released_without_libc_madvise_read_the_same(tmp_path, monkeypatch, madvise):
    """Mapped pages are released through libc's madvise (ctypes, without the GIL); where that
    is missing or fails, mmap.madvise does it, and the rows read are the same either way."""
    tuning = Tuning(array_chunk_rows=1024)
    data = np.arange(8192 * 1024, dtype=np.float32).reshape(8192, 1024)
    np.save(tmp_path / "x.npy", data)
    calls = []
    fake = None if madvise == "missing" else (lambda *a: calls.append(a) or -1)
    # a patch: libc's madvise missing or failing is the environment's
    monkeypatch.setattr(dense, "_libc_madvise", lambda: fake)
    spec = make_spec(tmp_path / "x.npy", {"x": {"shape": ["batch", 1024]}}, batch_size=1000)
    got = np.concatenate([b.fields["x"] for b in read_batches(spec, tuning=tuning)])
    np.testing.assert_array_equal(got, data)
    assert len(calls) == (0 if madvise == "missing" else 7)  # every chunk but the last


def test_ragged_records_are_padded_to_their_batchs_longest_as_they_are_read():
    """Text's tokens: one array per batch, each record at the left of its row, the rest the
    input's pad value; records ragged in a later axis too stay as they are; closing the padded
    stream closes the reader under it."""
    from types import SimpleNamespace

    from graphrun.read.records import RecordBatch

    spec = SimpleNamespace(inputs={"ids": SimpleNamespace(pad=7),
                                   "grid": SimpleNamespace(pad=0)})
    tokens = [np.array([1, 2], np.int64), np.array([3], np.int64), np.array([4, 5, 6], np.int64)]
    grids = [np.ones((1, 2)), np.ones((2, 1))]
    closed = []

    def source():
        try:
            yield RecordBatch(indices=np.arange(3), ids=[0, 1, 2], where=["a"] * 3,
                              fields={"ids": tokens, "grid": grids + grids[:1]},
                              lengths={"seq": np.array([2, 1, 3])})
            yield RecordBatch(indices=np.arange(3, 5), ids=[3, 4], where=["b"] * 2,
                              fields={"ids": tokens[:2], "grid": grids}, lengths={})
        finally:
            closed.append(True)

    padded = stream.padded_batches(source(), spec)
    first = next(padded)
    assert first.fields["ids"].tolist() == [[1, 2, 7], [3, 7, 7], [4, 5, 6]]
    assert first.fields["ids"].dtype == np.int64 and first.lengths["seq"].tolist() == [2, 1, 3]
    assert isinstance(first.fields["grid"], list)  # ragged in both axes: as read
    padded.close()
    assert closed == [True]
