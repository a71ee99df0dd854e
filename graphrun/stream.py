"""The stream step: read the input file chunk by chunk, check every record, and hand out batches
of data.batch_size valid records.

This module holds the entry point, the batching and the JSONL reader; formats.py reads .npy,
.npz and Parquet. Memory stays at about one chunk whatever the file's size: JSONL is read in
blocks of whole lines (~256 KiB), the other formats as formats.py says. The checks themselves
live in records.py.

JSONL parsing is the bottleneck: a block's lines are parsed by one call (see _parse_together;
orjson where installed, 2.7x faster than json for float-heavy records) and each input's values
converted by one np.asarray; a block with a bad line, or with records of different shapes,
falls back to one json.loads per line or one conversion per record. For a file of a MiB or
more, on a machine of 6 cores or more, blocks are parsed and checked in child processes
(parse_workers.py), off this process's GIL.
"""

from __future__ import annotations

import functools
import json
import os
import random
import threading
from collections import deque
from pathlib import Path
from typing import Iterator

import numpy as np

from graphrun.errors import InputError
from graphrun.formats import _npy_chunks, _npz_chunks, _parquet_chunks
from graphrun.jsonl_lines import encodable, lines_of, readable_id, repeated_keys
from graphrun.parse_workers import parse_blocks
try:  # optional: a faster JSON parser for the block parse (see _loads_block)
    import orjson as _orjson
except ImportError:  # pragma: no cover - depends on the environment
    _orjson = None

from graphrun.records import (Candidates, Prechecked, Reject, RecordBatch, RecordChecker,
                              concat_where, dense_if_uniform, field_from_values, numpy_dtype)
from graphrun.spec import PipelineSpec

__all__ = ["Reject", "RecordBatch", "ReadAhead", "read_batches", "FORMATS"]

FORMATS = (".jsonl", ".npy", ".npz", ".parquet")
JSONL_CHUNK_BYTES = 256 << 10  # JSONL lines parsed and converted together: about this many bytes
REJECTS_HELD = 4096  # a longer run of bad records is handed out without waiting for a full batch


def read_batches(spec: PipelineSpec, *, start: int = 0, stop: int | None = None
                 ) -> Iterator[RecordBatch]:
    """Batches of spec.data.batch_size valid records (the last may be smaller) from the records
    with ordinals in [start, stop). Each batch carries the rejects met before its last record, so
    records and rejects come out in file order; a batch may hold only rejects. With
    on_bad_record: error the first bad record raises InputError (after the full batches before
    it)."""
    if start < 0 or (stop is not None and stop < start):
        raise ValueError(f"need 0 <= start <= stop (got start={start}, stop={stop})")
    path = Path(spec.data.path)
    readers = {".jsonl": _jsonl_chunks, ".npy": _npy_chunks, ".npz": _npz_chunks,
               ".parquet": _parquet_chunks}
    reader = readers.get(path.suffix.lower())
    if reader is None:
        raise InputError(f"unknown input format {path.suffix or '(no suffix)'!r}; accepted: "
                         f"{', '.join(FORMATS)}", where=str(path))
    if not path.is_file():
        raise InputError("input file not found", where=str(path))
    checker = RecordChecker(spec)
    # a reader's chunk is Candidates, or Prechecked on another thread (Parquet's decoding pool):
    # this thread then only checks its ids for duplicates and cuts it into batches
    checked = (checker.check(c) for c in reader(path, spec, start, stop))
    yield from _regroup(checked, spec)


class ReadAhead:
    """Iterate `batches`, fetching the first batch on a thread started at once, so that the
    input's first chunk is read while the runner sets up (loads the model, captures, verifies):
    a Parquet row group decoded (65,536 records of 256 floats took 130 ms on the H200's host,
    a quarter of a 1M-record run), a JSONL block parsed, a mapped file's first pages read. The
    rest is read where it is asked for, as before; an error met on the way is raised by the
    first next(), in order, as the plain iterator raises it.

    close() waits for that thread, then closes the iterator (a Parquet reader's decoding pool
    stops)."""

    def __init__(self, batches: Iterator[RecordBatch]):
        self._it = iter(batches)
        self._first: tuple | None = None  # (True, batch or _END) or (False, the exception)
        # next() and close() one at a time: a consumer thread (replay's prefetch) may still be
        # in next() when the main thread, stopped by a signal, closes the reader
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = threading.Thread(
            target=self._fetch, name="graphrun-read-ahead", daemon=True)
        self._thread.start()

    def _fetch(self) -> None:
        try:
            self._first = (True, next(self._it, _END))
        except BaseException as exc:  # noqa: BLE001 - raised by the consumer's first next()
            self._first = (False, exc)

    def _join(self) -> None:
        if self._thread is not None:
            self._thread.join()  # a KeyboardInterrupt here leaves the (daemon) thread be
            self._thread = None

    def __iter__(self) -> "ReadAhead":
        return self

    def __next__(self) -> RecordBatch:
        with self._lock:
            if self._first is None and self._thread is None:
                return next(self._it)
            self._join()
            (ok, item), self._first = self._first, None
        if not ok:
            raise item
        if item is _END:
            raise StopIteration
        return item

    def close(self) -> None:
        with self._lock:
            self._join()
            self._first = None
            close = getattr(self._it, "close", None)
            if close is not None:
                close()


_END = object()


# ---- batching ----------------------------------------------------------------------------------

def _regroup(chunks: Iterator[RecordBatch], spec: PipelineSpec) -> Iterator[RecordBatch]:
    batch_size, stop_at_bad = spec.data.batch_size, spec.data.on_bad_record == "error"
    held = _Held(_empty_batch(spec))
    rejects: deque[Reject] = deque()  # rejects not yet handed out, in file order
    for chunk in chunks:
        bad = chunk.rejects[0] if stop_at_bad and chunk.rejects else None
        if bad is not None:  # keep the records before it, hand out the full batches, then raise
            chunk = _slice(chunk, 0, int(np.searchsorted(chunk.indices, bad.index)))
        rejects.extend(chunk.rejects)
        held.add(chunk)
        while len(held) >= batch_size:
            batch = held.pop(batch_size)
            last = batch.indices[-1]
            while rejects and rejects[0].index < last:
                batch.rejects.append(rejects.popleft())
            yield batch
        if len(rejects) >= REJECTS_HELD:
            yield _with_rejects(held.pop(len(held)), rejects)
        if bad is not None:  # the records before the bad one are still written
            if len(held) or rejects:
                yield _with_rejects(held.pop(len(held)), rejects)
            raise InputError(bad.reason, where=bad.where, record_id=bad.id)
    if len(held) or rejects:
        yield _with_rejects(held.pop(len(held)), rejects)


def _with_rejects(batch: RecordBatch, rejects: deque[Reject]) -> RecordBatch:
    batch.rejects.extend(rejects)
    rejects.clear()
    return batch


class _Held:
    """Valid records waiting for a full batch: checked chunks in file order, and how many
    records of the first were handed out already."""

    def __init__(self, empty: RecordBatch):
        self.empty = empty  # a batch of no records, each input and axis present
        self.chunks: deque[RecordBatch] = deque()
        self.cursor = 0
        self.count = 0

    def __len__(self) -> int:
        return self.count

    def add(self, chunk: RecordBatch) -> None:
        if len(chunk):
            self.chunks.append(chunk)
            self.count += len(chunk)

    def pop(self, k: int) -> RecordBatch:
        """The next k records as one batch (without rejects)."""
        parts = []
        self.count -= k
        while k > 0:
            chunk = self.chunks[0]
            step = min(k, len(chunk) - self.cursor)
            parts.append(_slice(chunk, self.cursor, self.cursor + step))
            self.cursor += step
            k -= step
            if self.cursor == len(chunk):
                self.chunks.popleft()
                self.cursor = 0
        if len(parts) <= 1:
            return parts[0] if parts else _slice(self.empty, 0, 0)
        return RecordBatch(
            indices=np.concatenate([p.indices for p in parts]),
            ids=_concat_ids([p.ids for p in parts]),
            where=concat_where([p.where for p in parts]),
            fields={name: _concat_records([p.fields[name] for p in parts])
                    for name in parts[0].fields},
            lengths={axis: np.concatenate([p.lengths[axis] for p in parts])
                     for axis in parts[0].lengths},
        )


def _empty_batch(spec: PipelineSpec) -> RecordBatch:
    """No records: each input [0, ...] in its dtype, named axes 0 long."""
    fields = {name: np.empty([0] + [d if isinstance(d, int) else 0 for d in inp.shape[1:]],
                             numpy_dtype(inp.dtype)) for name, inp in spec.inputs.items()}
    axes = {d for inp in spec.inputs.values() for d in inp.shape[1:] if isinstance(d, str)}
    return RecordBatch(np.empty(0, np.int64), np.empty(0, np.int64), [], fields,
                       {axis: np.empty(0, np.int64) for axis in spec.axes[1:] if axis in axes})


def _slice(batch: RecordBatch, lo: int, hi: int) -> RecordBatch:
    """Records [lo, hi) of a batch, without its rejects; dense where their shapes agree."""
    return RecordBatch(batch.indices[lo:hi], batch.ids[lo:hi], batch.where[lo:hi],
                       {name: r[lo:hi] if isinstance(r, np.ndarray) else dense_if_uniform(r[lo:hi])
                        for name, r in batch.fields.items()},
                       {axis: n[lo:hi] for axis, n in batch.lengths.items()})


def _concat_ids(parts: list) -> np.ndarray | list:
    if all(isinstance(p, np.ndarray) for p in parts):
        return np.concatenate(parts)
    return [i for p in parts for i in (p.tolist() if isinstance(p, np.ndarray) else p)]


def _concat_records(parts: list) -> np.ndarray | list:
    if all(isinstance(p, np.ndarray) for p in parts) and len({p.shape[1:] for p in parts}) == 1:
        return np.concatenate(parts)
    return dense_if_uniform([a for p in parts for a in p])


# ---- JSONL -------------------------------------------------------------------------------------

def _jsonl_chunks(path: Path, spec: PipelineSpec, start: int, stop: int | None
                  ) -> Iterator[Candidates | Prechecked]:
    """Each block's records: parsed here, or in child processes for a big file
    (parse_workers.py)."""
    with _open(path) as f:
        size = os.fstat(f.fileno()).st_size
        yield from parse_blocks(spec, size, _jsonl_blocks(f, path.name, start, stop),
                                functools.partial(_parse_block, spec))


def _jsonl_blocks(f, file: str, start: int, stop: int | None) -> Iterator[tuple]:
    """(file, lines, their line numbers, the first's ordinal) of consecutive records, about
    JSONL_CHUNK_BYTES of whole lines at a time. A UTF-8 byte order mark opening the file is
    skipped; a file whose lines end in CR alone (old Mac) is read as if they ended in LF."""
    lineno, index = 1, 0  # line number of the block's first line, ordinal of its first record
    f = lines_of(f)
    while lines := f.readlines(JSONL_CHUNK_BYTES):  # whole lines, about this many bytes
        rows = [i for i, line in enumerate(lines) if not line.isspace()]  # blank: no record
        lo = max(start - index, 0)  # records before start are counted, not parsed
        hi = len(rows) if stop is None else min(stop - index, len(rows))
        if hi > lo:
            yield (file, [lines[i] for i in rows[lo:hi]], [lineno + i for i in rows[lo:hi]],
                   index + lo)
        index += len(rows)
        lineno += len(lines)
        if stop is not None and index >= stop:
            break


def _parse_block(spec: PipelineSpec, block: tuple) -> Candidates:
    return _jsonl_candidates(spec, *block)


def _open(path: Path):
    try:
        return open(path, "rb")
    except OSError as e:
        raise InputError(f"cannot read the input file: {e.strerror}", where=str(path)) from e


def _jsonl_candidates(spec: PipelineSpec, file: str, lines: list[bytes], linenos: list[int],
                      first: int) -> Candidates:
    """lines [n]: consecutive records, the first with ordinal `first`."""
    id_field = spec.data.id_field
    expected = set(spec.inputs) | ({id_field} if id_field else set())
    records = _parse_together(lines)
    reasons = [""] * len(lines)
    if records is None:  # some line is bad: parse line by line for its reason
        records, reasons = zip(*map(_parse_line, lines))
    reasons = repeated_keys(lines, expected, list(reasons))
    good, rejects = [], []
    for p, record in enumerate(records):
        if (not reasons[p] and type(record) is dict and record.keys() == expected
                and (id_field is None or type(record[id_field]) is int
                     or (type(record[id_field]) is str and encodable(record[id_field])))):
            good.append(p)
            continue
        rid, reason = ((readable_id(record, id_field), reasons[p]) if reasons[p]
                       else _record_problem(spec, record))
        rejects.append(Reject(first + p, rid if id_field else first + p,
                              f"{file}:{linenos[p]}", reason))
    records = [records[p] for p in good]
    # numpy reads a bool among numbers as 0/1 without a trace: note the lines that may hold one
    suspects = [k for k, p in enumerate(good) if b"true" in lines[p] or b"false" in lines[p]]
    fields, problems = {}, {}
    for name, inp in spec.inputs.items():
        fields[name], found = field_from_values(name, inp, [r[name] for r in records], suspects)
        for k, reason in found.items():
            problems.setdefault(k, reason)
    return Candidates(
        indices=np.array(good, np.int64) + first,
        ids=[r[id_field] for r in records] if id_field else None,
        where=[f"{file}:{linenos[p]}" for p in good],
        fields=fields, problems=problems, rejects=rejects)


def _record_problem(spec: PipelineSpec, record) -> tuple[object, str]:
    """(id if readable, reason) for a parsed line that is not a good record."""
    id_field = spec.data.id_field
    expected = sorted(set(spec.inputs) | ({id_field} if id_field else set()))
    fields = ", ".join(expected)
    if not isinstance(record, dict):
        return None, f"the record is {_json_kind(record)}; expected an object with fields {fields}"
    rid = None
    if id_field:
        rid = record.get(id_field)
        if rid is None:
            return None, f"missing id: field {id_field!r} is absent or null"
        if type(rid) not in (str, int):
            return None, (f"id field {id_field!r} must be a string or an integer, got "
                          f"{_json_kind(rid)}")
        if type(rid) is str and not encodable(rid):
            return rid, (f"id field {id_field!r} is not valid Unicode (it holds a lone "
                         "surrogate escape such as \\ud800), so no output format can store it")
    missing = [k for k in spec.inputs if k not in record]
    if missing:
        return rid, f"missing field {missing[0]!r} (expected fields: {fields})"
    unknown = [k for k in record if k not in expected]
    return rid, f"unknown field {unknown[0]!r} (expected fields: {fields})"


def _parse_together(lines: list[bytes]) -> list | None:
    """All lines parsed by one json.loads (several times faster than one call per line), or
    None if any line is bad. Each line is wrapped as [marker, line] with a random marker per
    line, so that a line that is not exactly one JSON value cannot pass: a line holding two
    values or ending mid-value adds, shifts or swallows markers."""
    base = random.getrandbits(48)
    text = b"[" + b",".join([b"[%d,%b]" % (base + k, line) for k, line in enumerate(lines)]) + b"]"
    try:
        parsed = _loads_block(text)
    except (ValueError, RecursionError):  # also UnicodeDecodeError, orjson's JSONDecodeError
        return None
    if len(parsed) != len(lines) or sum(map(len, parsed)) != 2 * len(parsed):
        return None
    if [e[0] for e in parsed] != list(range(base, base + len(lines))):
        return None
    return [e[1] for e in parsed]


def _loads_block(text: bytes):
    """orjson where it is installed (it parses numbers several times faster), else json. A
    block orjson refuses (NaN or Infinity literals, integers past 64 bits) falls back to one
    json.loads per line, which reads those and gives each bad line its own reason."""
    if _orjson is not None:
        return _orjson.loads(text)
    return json.loads(text.decode("utf-8"))


def _parse_line(line: bytes) -> tuple[object, str]:
    """(value, "") or (None, reason)."""
    truncated = "truncated last line (the file ends mid-record)"
    last = not line.endswith(b"\n")  # only the file's last line can lack one
    try:
        return json.loads(line.decode("utf-8")), ""
    except RecursionError:
        return None, "nested too deeply to parse (thousands of brackets): not a record"
    except UnicodeDecodeError as e:
        return None, truncated if last else (
            f"invalid UTF-8 (byte 0x{line[e.start]:02x} at byte {e.start + 1} of the line)")
    except ValueError as e:
        return None, truncated if last else f"invalid JSON: {e.msg} (column {e.colno})"


def _json_kind(value) -> str:
    if isinstance(value, bool):
        return "a boolean"
    if value is None:
        return "null"
    return {dict: "an object", list: "an array", str: "a string"}.get(type(value), "a number")
