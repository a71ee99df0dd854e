"""Duplicate ids decided for a whole file before its records are spread over processes that
each see part of it (issue 28, a --ray run's actors): stream.job_duplicates gives exactly the
records, reasons included, that one process reading the whole file rejects as duplicates; an
earlier copy that is itself rejected does not make a later one a duplicate."""

from __future__ import annotations

import json
from dataclasses import replace

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from graphrun.base.tuning import Tuning
from graphrun.read.checks import RecordChecker
from graphrun.read.stream import job_duplicates, read_batches
from graphrun.spec.load import load_spec
from tests.spec_text import mlp_spec

N = 300
# ordinal -> the earlier ordinal whose id it repeats; 40's first copy (7) is bad, so 40 is
# kept, and 41 repeats 40; 290 repeats 5, 291 repeats 290's id too
REPEATS = {3: 1, 40: 7, 41: 40, 120: 2, 290: 5, 291: 5}
BAD = {7, 150}  # a short x


def write(tmp_path, fmt: str, ids: list) -> object:
    rows = [[float(i), 1.0] if i not in BAD else [1.0] for i in range(len(ids))]
    if fmt == "jsonl":
        lines = [json.dumps({"id": rid, "x": x}) for rid, x in zip(ids, rows)]
        lines[200] = lines[200][:-4]  # malformed: no id
        (tmp_path / "data.jsonl").write_text("\n".join(lines) + "\n")
    else:
        pq.write_table(pa.table({"id": ids, "x": rows}), tmp_path / "data.parquet",
                       row_group_size=32)
    (tmp_path / "p.yaml").write_text(mlp_spec("dups", path=f"data.{fmt}", id_field="id",
                                              batch_size=4, on_bad_record="skip"))
    return load_spec(tmp_path / "p.yaml")


def one_process_duplicates(spec, tuning) -> dict[int, str]:
    return {r.index: r.reason for b in read_batches(spec, tuning=tuning) for r in b.rejects
            if r.reason.startswith("duplicate id")}


def ids_with_repeats(kind=str) -> list:
    ids = [f"r{i}" if kind is str else 1000 + i for i in range(N)]
    for later, earlier in REPEATS.items():
        ids[later] = ids[earlier]
    return ids


@pytest.mark.parametrize("fmt", ["jsonl", "parquet"])
@pytest.mark.parametrize("kind", [str, int])
def test_job_duplicates_are_one_process_duplicates(tmp_path, fmt, kind):
    spec = write(tmp_path, fmt, ids_with_repeats(kind))
    tuning = replace(Tuning(), jsonl_chunk_bytes=512, array_chunk_rows=16)  # many chunks
    want = one_process_duplicates(spec, tuning)
    assert sorted(want) == [3, 41, 120, 290, 291]  # not 40: its earlier copy was rejected
    assert job_duplicates(spec, tuning) == want


def test_ids_mixing_ints_and_their_text(tmp_path):
    """5 and "5" are one id (read/ids.py); "05" is another."""
    ids = ids_with_repeats(str)
    ids[10], ids[60], ids[61], ids[250] = 5, "5", "05", 5
    spec = write(tmp_path, "jsonl", ids)
    tuning = replace(Tuning(), jsonl_chunk_bytes=512)
    want = one_process_duplicates(spec, tuning)
    assert {60, 250} <= set(want) and 61 not in want
    assert job_duplicates(spec, tuning) == want


def test_no_repeat_reads_the_ids_only(tmp_path):
    spec = write(tmp_path, "parquet", [f"r{i}" for i in range(N)])
    from graphrun.read.formats.parquet import ParquetReader

    class IdsOnly(ParquetReader):
        def chunks(self, start, stop):
            raise AssertionError("a file without repeated ids is not read whole")

    assert job_duplicates(spec, reader=IdsOnly(spec.data.path, spec, Tuning())) == {}


def test_a_checker_given_the_job_duplicates_rejects_them_in_any_order(tmp_path):
    """An actor's checker sees its chunks in no set order and remembers no ids: the decided
    records get their reasons, whatever it saw before."""
    spec = write(tmp_path, "parquet", ids_with_repeats(str))
    decided = job_duplicates(spec)
    chunks = list(read_batches(spec, tuning=replace(Tuning(), array_chunk_rows=16)))
    want = [(r.index, r.reason) for b in chunks for r in b.rejects]
    from graphrun.read.formats import reader_for

    checker = RecordChecker(spec, decided)
    raw = list(reader_for(spec, replace(Tuning(), array_chunk_rows=16)).chunks(0, None))
    got = [(r.index, r.reason) for c in reversed(raw) for r in checker.check(c).rejects]
    assert sorted(got) == sorted(want)
    assert len(checker.seen_ids) == 0


def test_seen_ids_find_the_repeats_a_set_finds():
    from graphrun.read.ids import SeenIds, id_texts

    rng = np.random.default_rng(0)
    seen, plain = SeenIds(), set()
    for _ in range(300):  # chunks of ids, a fifth of them seen before, merged as they grow
        chunk = [f"r{x}" if x % 3 else int(x) for x in rng.integers(0, 20000, 64)]
        texts = id_texts(chunk)
        want = []
        for t in texts:
            want.append(t in plain)
            plain.add(t)
        assert seen.add(texts).tolist() == want
    assert len(seen) == len(plain)


def test_ids_sharing_a_first_hash_half_are_told_apart():
    from graphrun.read.ids import _held

    held_hi = np.array([1, 5, 5, 5, 9], np.uint64)
    held_lo = np.array([0, 7, 8, 9, 0], np.uint64)
    got = _held(held_hi, held_lo, np.array([5, 5, 5, 9, 10], np.uint64),
                np.array([9, 6, 7, 1, 0], np.uint64))
    assert got.tolist() == [True, False, True, False, False]


def test_the_seen_ids_take_a_fixed_size_each_whatever_their_length():
    """The checker keeps no id itself: the chunks' id strings are freed once checked."""
    import tracemalloc

    from graphrun.read.ids import SeenIds, check_duplicate_ids

    seen = SeenIds()  # what a RecordChecker holds of the ids

    n, size = 200_000, 2000
    tracemalloc.start()
    try:
        for start in range(0, n, size):
            ids = [f"a-rather-long-request-id-{i:020d}" for i in range(start, start + size)]
            check_duplicate_ids(ids, np.arange(size), seen, {})
            del ids
        held, _ = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert len(seen) == n
    assert held < 24 * n, held / n  # 16 bytes an id, and a little
