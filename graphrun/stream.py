"""The stream step: read the input file chunk by chunk, check every record, and hand out batches
of data.batch_size valid records.

Memory stays at about one chunk whatever the file's size: JSONL is read in blocks of whole
lines (~256 KiB), .npy is memory-mapped, .npz members are memory-mapped when stored and
decompressed front to back when deflated, Parquet is read with iter_batches. A mapped chunk's
pages are released once it is read (see _release_rows), and a dense chunk is capped in records
too, as each record also costs Python objects (its `where`, its id). The checks themselves live
in records.py.

JSONL parsing is the bottleneck: a block's lines are parsed by one json.loads call (see
_parse_together) and each input's values converted by one np.asarray; a block with a bad line,
or with records of different shapes, falls back to one call per line or per record.
"""

from __future__ import annotations

import json
import mmap
import random
import struct
import zipfile
from collections import deque
from pathlib import Path
from typing import Iterator

import numpy as np

from graphrun.errors import InputError
from graphrun.records import (Candidates, Field, Reject, RecordBatch, RecordChecker,
                              dense_if_uniform, field_from_arrow, field_from_values, numpy_dtype,
                              shape_problem)
from graphrun.spec import PipelineSpec

__all__ = ["Reject", "RecordBatch", "read_batches", "FORMATS"]

FORMATS = (".jsonl", ".npy", ".npz", ".parquet")
JSONL_CHUNK_BYTES = 256 << 10  # JSONL lines parsed and converted together: about this many bytes
ARRAY_CHUNK_BYTES = 16 << 20  # npy/npz/parquet rows read at once: about this many bytes
# ... and at most this many: each record also costs ~150 bytes of Python objects (its `where`
# string, its id) whatever its array bytes, so a 16 MiB chunk of narrow records (4 floats) would
# be 1M records and ~150 MB, all read at once from a file of up to that many records.
ARRAY_CHUNK_ROWS = 16384
PARQUET_CHUNK_ROWS = 4096
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
    checked = (checker.check(c) for c in reader(path, spec, start, stop))
    yield from _regroup(checked, spec)


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
            ids=[i for p in parts for i in p.ids],
            where=[w for p in parts for w in p.where],
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
    return RecordBatch(np.empty(0, np.int64), [], [], fields,
                       {axis: np.empty(0, np.int64) for axis in spec.axes[1:] if axis in axes})


def _slice(batch: RecordBatch, lo: int, hi: int) -> RecordBatch:
    """Records [lo, hi) of a batch, without its rejects; dense where their shapes agree."""
    return RecordBatch(batch.indices[lo:hi], batch.ids[lo:hi], batch.where[lo:hi],
                       {name: r[lo:hi] if isinstance(r, np.ndarray) else dense_if_uniform(r[lo:hi])
                        for name, r in batch.fields.items()},
                       {axis: n[lo:hi] for axis, n in batch.lengths.items()})


def _concat_records(parts: list) -> np.ndarray | list:
    if all(isinstance(p, np.ndarray) for p in parts) and len({p.shape[1:] for p in parts}) == 1:
        return np.concatenate(parts)
    return dense_if_uniform([a for p in parts for a in p])


# ---- JSONL -------------------------------------------------------------------------------------

def _jsonl_chunks(path: Path, spec: PipelineSpec, start: int, stop: int | None
                  ) -> Iterator[Candidates]:
    lineno, index = 1, 0  # line number of the block's first line, ordinal of its first record
    with _open(path) as f:
        while lines := f.readlines(JSONL_CHUNK_BYTES):  # whole lines, about this many bytes
            rows = [i for i, line in enumerate(lines) if not line.isspace()]  # blank: no record
            lo = max(start - index, 0)  # records before start are counted, not parsed
            hi = len(rows) if stop is None else min(stop - index, len(rows))
            if hi > lo:
                yield _jsonl_candidates(spec, path.name, [lines[i] for i in rows[lo:hi]],
                                        [lineno + i for i in rows[lo:hi]], index + lo)
            index += len(rows)
            lineno += len(lines)
            if stop is not None and index >= stop:
                break


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
    good, rejects = [], []
    for p, record in enumerate(records):
        if (not reasons[p] and type(record) is dict and record.keys() == expected
                and (id_field is None or type(record[id_field]) in (str, int))):
            good.append(p)
            continue
        rid, reason = (None, reasons[p]) if reasons[p] else _record_problem(spec, record)
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
        parsed = json.loads(text.decode("utf-8"))
    except ValueError:  # also UnicodeDecodeError
        return None
    if len(parsed) != len(lines) or sum(map(len, parsed)) != 2 * len(parsed):
        return None
    if [e[0] for e in parsed] != list(range(base, base + len(lines))):
        return None
    return [e[1] for e in parsed]


def _parse_line(line: bytes) -> tuple[object, str]:
    """(value, "") or (None, reason)."""
    truncated = "truncated last line (the file ends mid-record)"
    last = not line.endswith(b"\n")  # only the file's last line can lack one
    try:
        return json.loads(line.decode("utf-8")), ""
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


# ---- .npy and .npz: dense arrays, one per input -------------------------------------------------

def _npy_chunks(path: Path, spec: PipelineSpec, start: int, stop: int | None
                ) -> Iterator[Candidates]:
    if len(spec.inputs) != 1:
        raise InputError(f"a .npy file holds one array but the spec has inputs "
                         f"{', '.join(spec.inputs)}; use .npz with one array per input",
                         where=path.name)
    if spec.data.id_field:
        raise InputError(f"a .npy file holds no ids but data.id_field is "
                         f"{spec.data.id_field!r}; use .npz with an id array or drop id_field",
                         where=path.name)
    try:
        array = np.load(path, mmap_mode="r", allow_pickle=False)
    except Exception as e:  # noqa: BLE001 - a damaged header raises all sorts (TokenError, ...)
        raise InputError(f"cannot read the .npy file: {e}", where=path.name) from e
    name = next(iter(spec.inputs))
    _check_array(spec, name, array, f"{path.name}")
    yield from _dense_chunks(spec, path.name, {name: array}, None, len(array), start, stop)


def _npz_chunks(path: Path, spec: PipelineSpec, start: int, stop: int | None
                ) -> Iterator[Candidates]:
    id_field = spec.data.id_field
    try:
        zf = zipfile.ZipFile(path)
    except (OSError, zipfile.BadZipFile) as e:
        raise InputError(f"cannot read the .npz file: {e}", where=path.name) from e
    with zf:
        members = {n[:-4]: n for n in zf.namelist() if n.endswith(".npy")}
        wanted = list(spec.inputs) + ([id_field] if id_field else [])
        missing = [n for n in wanted if n not in members]
        if missing:
            raise InputError(f"array {missing[0]!r} is missing (arrays in the file: "
                             f"{', '.join(members) or 'none'})", where=path.name)
        arrays = {n: _npz_member(path, zf, members[n]) for n in wanted}
        counts = {n: a.shape[0] if a.shape else None for n, a in arrays.items()}
        if len(set(counts.values())) != 1 or None in counts.values():
            raise InputError(f"arrays must all have the same number of records (first "
                             f"dimension): {counts}", where=path.name)
        for name in spec.inputs:
            _check_array(spec, name, arrays[name], f"{path.name}[{name}]")
        ids = arrays.pop(id_field) if id_field else None
        if ids is not None and (ids.ndim != 1 or ids.dtype.kind not in "iuUS"):
            raise InputError(f"ids {id_field!r} must be a 1-d array of integers or strings "
                             f"(one scalar per record), got {ids.dtype} of shape {ids.shape}",
                             where=path.name)
        yield from _dense_chunks(spec, path.name, arrays, ids, counts[wanted[0]], start, stop)


def _npz_member(path: Path, zf: zipfile.ZipFile, member: str):
    """A stored member as a memory map; a deflated one as rows read front to back."""
    info = zf.getinfo(member)
    if info.compress_type != zipfile.ZIP_STORED:
        return _DeflatedRows(zf.open(member), f"{path.name}[{member}]")
    with open(path, "rb") as f:
        f.seek(info.header_offset)
        header = f.read(30)  # zip local file header; the data follow its name and extra field
        if header[:4] != b"PK\x03\x04":
            raise InputError(f"corrupt .npz member {member!r}", where=path.name)
        name_len, extra_len = struct.unpack("<HH", header[26:30])
        f.seek(info.header_offset + 30 + name_len + extra_len)
        shape, fortran, dtype = _read_npy_header(f, f"{path.name}[{member}]")
        offset = f.tell()
    if dtype.hasobject:
        raise InputError(f"{member}: object arrays are not supported", where=path.name)
    if int(np.prod(shape)) == 0:
        return np.empty(shape, dtype)
    return np.memmap(path, dtype=dtype, mode="r", offset=offset, shape=shape,
                     order="F" if fortran else "C")


def _read_npy_header(f, where: str) -> tuple[tuple, bool, np.dtype]:
    try:
        version = np.lib.format.read_magic(f)
        if version == (1, 0):
            return np.lib.format.read_array_header_1_0(f)
        if version == (2, 0):
            return np.lib.format.read_array_header_2_0(f)
    except ValueError as e:
        raise InputError(f"not a valid .npy array: {e}", where=where) from e
    raise InputError(f".npy format version {version} is not supported (1.0 and 2.0 are)",
                     where=where)


class _DeflatedRows:
    """Rows of a compressed .npz member, decompressed front to back: one chunk in memory."""

    def __init__(self, file, where: str):
        self.file, self.where = file, where
        self.shape, fortran, self.dtype = _read_npy_header(file, where)
        if fortran and len(self.shape) > 1:
            raise InputError("a compressed Fortran-ordered array cannot be read row by row; "
                             "save it C-ordered or with np.savez (uncompressed)", where=where)
        if self.dtype.hasobject:
            raise InputError("object arrays are not supported", where=where)
        self.ndim = len(self.shape)
        self.row_bytes = self.dtype.itemsize * int(np.prod(self.shape[1:]))
        self.row = 0  # next row the file will give

    def __getitem__(self, rows: slice) -> np.ndarray:
        assert rows.start >= self.row, "compressed rows are read front to back"
        while self.row < rows.start:  # skip in bounded steps
            step = min(rows.start - self.row, max(1, ARRAY_CHUNK_BYTES // max(self.row_bytes, 1)))
            self.file.read(step * self.row_bytes)
            self.row += step
        n = rows.stop - rows.start
        data = self.file.read(n * self.row_bytes)
        if len(data) != n * self.row_bytes:
            raise InputError("the compressed array ends early (the file is truncated)",
                             where=self.where)
        self.row = rows.stop
        return np.frombuffer(data, self.dtype).reshape((n,) + tuple(self.shape[1:]))


def _check_array(spec: PipelineSpec, name: str, array, where: str) -> None:
    """Whole-file problems of a dense array: every record would fail, so they are errors even
    with on_bad_record: skip."""
    inp = spec.inputs[name]
    if array.dtype.kind not in "biuf":
        raise InputError(f"{name}: dtype {array.dtype} is not numeric", where=where)
    if array.dtype.kind == "b" and inp.dtype != "bool":
        raise InputError(f"{name}: booleans where {inp.dtype} numbers are expected", where=where)
    if array.ndim == 0:
        raise InputError(f"{name}: a 0-d array has no records; expected [N, ...]", where=where)
    reason, _ = shape_problem(name, inp, tuple(array.shape[1:]), spec)
    if reason:
        raise InputError(f"{reason} (array shape {list(array.shape)})", where=where)


def _dense_chunks(spec: PipelineSpec, file: str, arrays: dict, ids, n_rows: int, start: int,
                  stop: int | None) -> Iterator[Candidates]:
    """Chunks of rows [start, stop) of arrays that all have n_rows rows."""
    stop = n_rows if stop is None else min(stop, n_rows)
    row_bytes = sum(a.dtype.itemsize * int(np.prod(a.shape[1:])) for a in arrays.values())
    step = min(ARRAY_CHUNK_ROWS, max(1, ARRAY_CHUNK_BYTES // max(row_bytes, 1)))
    mapped = [a for a in [*arrays.values(), ids] if isinstance(a, np.memmap)]
    for lo in range(start, stop, step):
        hi = min(lo + step, stop)
        yield Candidates(
            indices=np.arange(lo, hi, dtype=np.int64),
            ids=_ids(ids[lo:hi]) if ids is not None else None,
            where=[f"{file}[row {i}]" for i in range(lo, hi)],
            fields={name: Field(dense=np.asarray(a[lo:hi])) for name, a in arrays.items()},
        )
        for a in mapped:  # the chunk was checked, so converted to fresh arrays, by now
            _release_rows(a, lo, hi)


def _release_rows(array: np.memmap, lo: int, hi: int) -> None:
    """Unmap the pages of rows [lo, hi) of a memory-mapped array from this process.

    A mapped page that was read stays in the process (and in its RSS) until it is unmapped, so
    one pass over a memory-mapped file grows RSS to the file's size. MADV_DONTNEED on a
    read-only shared file mapping only drops the pages from this process: the data stay in the
    page cache, and reading them again maps them again (the same bytes). Rows of a Fortran-
    ordered array are not contiguous: those are left mapped."""
    mm = getattr(array, "_mmap", None)  # numpy's mmap.mmap under a np.memmap
    if mm is None or not hasattr(mm, "madvise") or not hasattr(mmap, "MADV_DONTNEED"):
        return
    if array.ndim > 1 and not array.flags.c_contiguous:
        return
    row_bytes = array.dtype.itemsize * int(np.prod(array.shape[1:]))
    # np.memmap maps from `offset` rounded down to the allocation granularity
    first = array.offset % mmap.ALLOCATIONGRANULARITY + lo * row_bytes
    end = array.offset % mmap.ALLOCATIONGRANULARITY + hi * row_bytes
    if end > len(mm):  # not the layout assumed above: leave it
        return
    first -= first % mmap.PAGESIZE  # madvise works on whole pages; the page straddling
    end -= end % mmap.PAGESIZE  # `end` is released with the next chunk
    if end > first:
        mm.madvise(mmap.MADV_DONTNEED, first, end - first)


def _ids(ids: np.ndarray) -> list:
    return ids.astype(str).tolist() if ids.dtype.kind == "S" else ids.tolist()


# ---- Parquet ------------------------------------------------------------------------------------

def _parquet_chunks(path: Path, spec: PipelineSpec, start: int, stop: int | None
                    ) -> Iterator[Candidates]:
    import pyarrow.parquet as pq

    try:
        pf = pq.ParquetFile(path)
    except Exception as e:  # pyarrow raises ArrowInvalid, OSError, ... for unreadable files
        raise InputError(f"cannot read the Parquet file: {e}", where=path.name) from e
    id_field = spec.data.id_field
    columns = list(spec.inputs) + ([id_field] if id_field else [])
    _check_parquet_schema(spec, pf.schema_arrow, path.name)
    meta = pf.metadata
    stop = meta.num_rows if stop is None else min(stop, meta.num_rows)
    groups, first_row, row = [], None, 0  # the row groups holding rows [start, stop)
    for g in range(meta.num_row_groups):
        n = meta.row_group(g).num_rows
        if row + n > start and row < stop:
            groups.append(g)
            first_row = row if first_row is None else first_row
        row += n
    if not groups or start >= stop:
        return
    row = first_row
    for rb in _parquet_batches(pf, path.name, groups, columns):
        lo, hi = max(start - row, 0), min(stop - row, rb.num_rows)
        if hi > lo:
            yield _parquet_candidates(spec, path.name, rb.slice(lo, hi - lo), row + lo)
        row += rb.num_rows
        if row >= stop:
            break


def _parquet_batches(pf, file: str, groups: list[int], columns: list[str]) -> Iterator:
    """pyarrow's record batches; a damaged page becomes an InputError naming the file."""
    batches = pf.iter_batches(batch_size=PARQUET_CHUNK_ROWS, row_groups=groups, columns=columns)
    while True:
        try:
            rb = next(batches)
        except StopIteration:
            return
        except Exception as e:  # noqa: BLE001 - ArrowInvalid, OSError, ... from a damaged file
            raise InputError(f"cannot decode the Parquet file: {type(e).__name__}: {e}",
                             where=file) from e
        yield rb


def _check_parquet_schema(spec: PipelineSpec, schema, file: str) -> None:
    import pyarrow as pa

    names = schema.names
    id_field = spec.data.id_field
    for name in list(spec.inputs) + ([id_field] if id_field else []):
        if name not in names:
            raise InputError(f"column {name!r} is missing (columns: {', '.join(names)})",
                             where=file)
    for name, inp in spec.inputs.items():
        t, depth = schema.field(name).type, 0
        while pa.types.is_list(t) or pa.types.is_large_list(t) or pa.types.is_fixed_size_list(t):
            t, depth = t.value_type, depth + 1
        numeric = pa.types.is_integer(t) or pa.types.is_floating(t)
        if not (numeric or (pa.types.is_boolean(t) and inp.dtype == "bool")):
            raise InputError(f"column {name!r} holds {t}; expected {inp.dtype} numbers",
                             where=file)
        if depth != len(inp.shape) - 1:
            raise InputError(f"column {name!r} nests lists {depth} deep; input shape "
                             f"{inp.shape} needs {len(inp.shape) - 1} (one per dimension after "
                             f"batch)", where=file)
    if id_field:
        t = schema.field(id_field).type
        if not (pa.types.is_integer(t) or pa.types.is_string(t) or pa.types.is_large_string(t)):
            raise InputError(f"id column {id_field!r} must hold integers or strings (one scalar "
                             f"per record), got {t}", where=file)


def _parquet_candidates(spec: PipelineSpec, file: str, rb, first: int) -> Candidates:
    n = rb.num_rows
    fields, problems = {}, {}
    for name, inp in spec.inputs.items():
        col = rb.column(name)
        columnar = field_from_arrow(col, len(inp.shape) - 1)
        if columnar is not None:
            fields[name] = columnar
            continue
        # nulls or ragged nested lists: read as Python values for a reason per record
        fields[name], found = field_from_values(name, inp, col.to_pylist())
        for p, reason in found.items():
            problems.setdefault(p, reason)
    ids = None
    if spec.data.id_field:
        ids = rb.column(spec.data.id_field).to_pylist()
        for p, rid in enumerate(ids):
            if rid is None:
                problems.setdefault(p, f"missing id: {spec.data.id_field!r} is null")
    return Candidates(np.arange(first, first + n, dtype=np.int64), ids,
                      [f"{file}[row {i}]" for i in range(first, first + n)], fields, problems)
