"""A --ray run's JSONL input without Ray (issue 28): the driver's spans and the read tasks'
lines give the one-process reader's lines, line numbers and ordinals, and a Ray batch of line
rows is parsed and rejected as one process rejects those lines (file:line, the file's ordinal),
never as "[row 7]" or a parser's traceback."""

from __future__ import annotations

import json

import pyarrow as pa
import pytest

from graphrun.read.checks import RecordChecker
from graphrun.read.formats.jsonl import _blocks
from graphrun.read.formats.jsonl_lines import lines_of
from graphrun.scale.ray.columns import LINE_NO, LINE_TEXT, ORDINAL
from graphrun.scale.ray.jsonl import line_candidates, line_spans, span_lines
from graphrun.spec.load import load_spec
from tests.spec_text import mlp_spec


def one_process_lines(path) -> list[tuple]:
    """(line, line number, ordinal) of every record, as JsonlReader cuts them."""
    with open(path, "rb") as f:
        return [row for _, lines, linenos, first in _blocks(f, path.name, 0, None, 64)
                for row in zip(lines, linenos, range(first, first + len(lines)))]


def ray_lines(path, span_bytes: int) -> list[tuple]:
    spans = line_spans(path, span_bytes)
    rows = [row for s in spans for lines, linenos, ordinals in span_lines(path, s)
            for row in zip(lines, linenos, ordinals)]
    assert sum(s.records for s in spans) == len(rows)
    return rows


@pytest.mark.parametrize("content", [
    b"".join(b'{"x": [%d, 1]}\n' % i + (b"\n  \n" if i % 3 == 0 else b"") for i in range(40)),
    b"\xef\xbb\xbf" + b"".join(b'{"x": [%d]}\n' % i for i in range(20)) + b'{"x": [9',
    b"".join(b'{"x": [%d]}\r' % i + (b"\r" if i == 4 else b"") for i in range(12)),
], ids=["blank-lines", "bom-truncated-last", "cr-only"])
def test_spans_give_the_one_process_lines(tmp_path, content):
    path = tmp_path / "data.jsonl"
    path.write_bytes(content)
    want = one_process_lines(path)
    assert want
    for span_bytes in (1, 50, 1 << 20):  # many spans, a few, one
        assert ray_lines(path, span_bytes) == want


def line_table(path, rows: slice) -> pa.Table:
    """A Ray batch: the line rows of records rows (a slice of the file's records)."""
    lines, linenos, ordinals = zip(*one_process_lines(path)[rows])
    return pa.table({ORDINAL: pa.array(ordinals, pa.int64()), LINE_NO: list(linenos),
                     LINE_TEXT: pa.array(lines, pa.binary())})


@pytest.mark.parametrize("id_field", [None, "id"])
def test_a_batch_of_bad_lines_is_rejected_as_one_process(tmp_path, id_field):
    records = [{"id": f"r{i}", "x": [i, 1.5]} for i in range(12)]
    lines = [json.dumps(r if id_field else {"x": r["x"]}) for r in records]
    lines[6] = lines[6][:-3]  # malformed JSON
    lines[7] = json.dumps({"id": "r7"} if id_field else {})  # missing field
    lines[8] = lines[8].replace("[8, 1.5]", '["a", "b"]')  # strings in a numeric field
    lines[9] = lines[9].replace("[9, 1.5]", "[9]")  # wrong shape
    path = tmp_path / "data.jsonl"
    path.write_text("\n\n".join(lines) + "\n")  # a blank line after each: line = 2 * ordinal + 1
    spec = load_spec(_spec(tmp_path, id_field))

    got = RecordChecker(spec).check(line_candidates(spec, "data.jsonl", line_table(path,
                                                                                   slice(5, 11))))
    assert got.indices.tolist() == [5, 10]
    assert list(got.where) == ["data.jsonl:11", "data.jsonl:21"]
    assert list(got.ids) == (["r5", "r10"] if id_field else [5, 10])
    assert [(r.index, r.where) for r in got.rejects] == [
        (k, f"data.jsonl:{2 * k + 1}") for k in (6, 7, 8, 9)]
    assert [r.id for r in got.rejects] == ([None, "r7", "r8", "r9"] if id_field else [6, 7, 8, 9])
    reasons = [r.reason for r in got.rejects]
    assert reasons[0].startswith("invalid JSON") and "missing field 'x'" in reasons[1]
    assert "non-numeric value 'a'" in reasons[2] and "dimension 0" in reasons[3]

    # the same lines through the one-process reader give the same rejects
    whole = RecordChecker(spec).check(line_candidates(spec, "data.jsonl", line_table(
        path, slice(None))))
    assert [(r.index, r.id, r.where, r.reason) for r in whole.rejects] == [
        (r.index, r.id, r.where, r.reason) for r in got.rejects]


def _spec(tmp_path, id_field):
    path = tmp_path / "pipeline.yaml"
    ids = {"id_field": id_field} if id_field else {}
    path.write_text(mlp_spec("lines", path="data.jsonl", batch_size=4, on_bad_record="skip",
                             **ids))
    return path
