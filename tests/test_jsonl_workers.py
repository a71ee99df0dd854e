"""JSONL blocks parsed in child processes (inputs/jsonl_workers.py): the records, rejects and
locations read are those the reader's own thread gives, in order, whatever happens to the
children."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from graphrun.base.errors import InputError
from graphrun.read.formats import jsonl as jsonl_reader
from graphrun.read.formats import jsonl_workers
from graphrun.read.stream import read_batches
from graphrun.base.tuning import Tuning
from tests.test_stream import DECODER, SEQ, make_spec

# two children for any file, blocks of about 2 KiB; and the same blocks parsed here only
CHILDREN = Tuning(jsonl_workers=2, jsonl_workers_min_bytes=0, jsonl_chunk_bytes=2048)
HERE = Tuning(jsonl_workers=0, jsonl_chunk_bytes=2048)


def everything(spec, tuning: Tuning = CHILDREN, **kw):
    """(valid ids in order, rejects in order, batches)."""
    batches = list(read_batches(spec, tuning=tuning, **kw))
    return [i for b in batches for i in b.ids], [r for b in batches for r in b.rejects], batches

N = 600


def write_lines(path, n: int = N, seq: bool = False):
    """Decoder (or variable-length) records with ids, a blank line now and then, and bad
    records of several kinds."""
    lines = []
    for i in range(n):
        if seq:
            k = 1 + i % 4
            rec = {"id": f"r{i}", "tokens": [i % 100] * k, "mask": [True] * k}
        else:
            rec = {"id": f"r{i}", "tokens": [i % 100], "positions": i}
        line = json.dumps(rec)
        if i % 97 == 5:
            line = line[:-3]  # invalid JSON
        elif i % 89 == 7:
            rec["tokens"] = [500]  # out of range
            line = json.dumps(rec)
        elif i % 83 == 9:
            line = json.dumps({"id": f"r{i}"})  # fields missing
        lines.append(line)
        if i % 50 == 3:
            lines.append("")
    path.write_text("\n".join(lines) + "\n")
    return path


@pytest.fixture
def children(monkeypatch):
    """The blocks parsed in this process (read with CHILDREN)."""
    here = []
    parse = jsonl_reader.parse_block

    def parse_block(spec, block):
        here.append(block[3])
        return parse(spec, block)

    # a patch: a spy on the blocks parsed here, inside read_batches, with no caller
    monkeypatch.setattr(jsonl_reader, "parse_block", parse_block)
    return here


def here_only(spec, monkeypatch=None, **kw):
    return everything(spec, tuning=HERE, **kw)


def same(a, b) -> None:
    assert a[0] == b[0]
    assert [(r.index, r.id, r.where, r.reason) for r in a[1]] == [
        (r.index, r.id, r.where, r.reason) for r in b[1]]
    assert [w for x in a[2] for w in x.where] == [w for x in b[2] for w in x.where]
    for name in a[2][0].fields if a[2] else []:
        va = [np.asarray(v) for x in a[2] for v in x.fields[name]]
        vb = [np.asarray(v) for x in b[2] for v in x.fields[name]]
        assert len(va) == len(vb) and all(np.array_equal(p, q) for p, q in zip(va, vb))


@pytest.mark.parametrize("start,stop", [(0, None), (123, 456), (599, None)])
def test_children_read_what_this_process_reads(tmp_path, monkeypatch, children, start, stop):
    path = write_lines(tmp_path / "d.jsonl")
    spec = make_spec(path, DECODER, id_field="id", batch_size=7, on_bad_record="skip")
    got = everything(spec, start=start, stop=stop)
    assert children == []  # every block came back from a child
    assert len(got[0]) + len(got[1]) == len(range(N)[start:stop])
    assert got[1] or start == 599
    same(got, here_only(spec, monkeypatch, start=start, stop=stop))


def test_children_read_variable_length_records(tmp_path, monkeypatch, children):
    path = write_lines(tmp_path / "d.jsonl", seq=True)
    spec = make_spec(path, SEQ, id_field="id", batch_size=4, on_bad_record="skip")
    got = everything(spec)
    assert children == [] and len(got[0]) > N // 2
    same(got, here_only(spec, monkeypatch))


def started_workers(monkeypatch, then=lambda workers: None) -> list:
    """The children of each ParseWorkers made from now on (a list each), after then(it)."""
    made, workers = [], jsonl_workers.ParseWorkers

    class Noted(workers):
        def __init__(self, *a, **kw):
            super().__init__(*a, **kw)
            made.append(list(self.procs))
            then(self)

    # a patch: the child processes are started inside read_batches, with no caller
    monkeypatch.setattr(jsonl_workers, "ParseWorkers", Noted)
    return made


def test_a_child_that_dies_leaves_its_blocks_to_this_process(tmp_path, monkeypatch, children):
    path = write_lines(tmp_path / "d.jsonl")
    spec = make_spec(path, DECODER, id_field="id", batch_size=7, on_bad_record="skip")
    # the second child killed before it has parsed anything
    made = started_workers(monkeypatch, then=lambda workers: workers.procs[1].kill())
    got = everything(spec)
    assert len(made) == 1 and children  # some blocks were parsed here
    same(got, here_only(spec, monkeypatch))


def test_the_children_end_with_the_reading(tmp_path, children, monkeypatch):
    """Stopping after two batches, or reading to the end: no child outlives the reader."""
    path = write_lines(tmp_path / "d.jsonl")
    spec = make_spec(path, DECODER, id_field="id", batch_size=7, on_bad_record="skip")
    made = started_workers(monkeypatch)
    batches = read_batches(spec, tuning=CHILDREN)
    next(batches), next(batches)
    batches.close()
    list(read_batches(spec, tuning=CHILDREN))
    assert len(made) == 2 and all(p.poll() is not None for procs in made for p in procs)


def test_the_first_bad_record_stops_the_run_as_before(tmp_path, monkeypatch, children):
    path = write_lines(tmp_path / "d.jsonl")
    spec = make_spec(path, DECODER, id_field="id", batch_size=7, on_bad_record="error")

    def ids_until_error(tuning):
        ids = []
        with pytest.raises(InputError) as e:
            for batch in read_batches(spec, tuning=tuning):
                ids += list(batch.ids)
        return ids, str(e.value)

    got = ids_until_error(CHILDREN)
    assert got == ids_until_error(HERE)
    assert got[1].startswith("d.jsonl:7: invalid JSON") and got[0] == ["r0", "r1", "r2", "r3", "r4"]


def test_small_files_and_small_machines_parse_here(tmp_path, monkeypatch):
    """No child for a file under jsonl_workers_min_bytes, nor with jsonl_workers 0."""
    made = []
    # a patch: the child processes are started inside read_batches, with no caller
    monkeypatch.setattr(jsonl_workers, "ParseWorkers",
                        lambda *a: made.append(a) or pytest.fail("a child was started"))
    path = write_lines(tmp_path / "d.jsonl")
    spec = make_spec(path, DECODER, id_field="id", batch_size=7, on_bad_record="skip")
    assert everything(spec, Tuning(jsonl_workers=2,
                                   jsonl_workers_min_bytes=path.stat().st_size + 1))[0]
    assert everything(spec, Tuning(jsonl_workers=0, jsonl_workers_min_bytes=0))[0]
    assert made == []


def test_values_round_trip_through_a_child(tmp_path, monkeypatch, children):
    """Floats, NaN rejected with finite: true, and integers beyond float precision."""
    path = tmp_path / "f.jsonl"
    rows = [[0.1 * i, -1e-30, 3.4e38] for i in range(300)]
    text = [json.dumps({"x": r}) for r in rows]
    text[17] = '{"x": [NaN, 1, 2]}'
    path.write_text("\n".join(text) + "\n")
    spec = make_spec(path, {"x": {"shape": ["batch", 3], "dtype": "float32", "finite": True}},
                     batch_size=16, on_bad_record="skip")
    got = everything(spec)
    assert children == [] and [r.index for r in got[1]] == [17]
    values = np.concatenate([b.fields["x"] for b in got[2]])
    want = np.array([r for i, r in enumerate(rows) if i != 17], np.float32)
    assert np.array_equal(values, want) and not any(math.isnan(v) for v in values.ravel())
