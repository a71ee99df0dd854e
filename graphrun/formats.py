"""The dense formats of the stream step: .npy, .npz and Parquet, read chunk by chunk into
Candidates for stream.py to check and batch.

Memory stays at about one chunk whatever the file's size: .npy is memory-mapped, .npz members
are memory-mapped when stored and decompressed front to back when deflated. A mapped chunk's
pages are released once it is read (see _release_rows), and a dense chunk is capped in records
too, as a record may also cost Python objects (a string id). Parquet is the exception:
pyarrow decodes a column chunk on one thread only, so several row groups are decoded at once,
ahead of the reader, each converted and checked on the thread that decoded it (see
_parquet_batches), and a row group too big for that is cut into pieces (parquet_pages.py): at
most PARQUET_AHEAD_BYTES of them in memory, never the whole file.
"""

from __future__ import annotations

import functools
import math
import mmap
import os
import struct
import sys
import threading
import zipfile
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Iterator

import numpy as np

from graphrun.cores import usable_cores
from graphrun.errors import InputError
from graphrun.parquet_pages import (Flat, Piece, PieceMismatch, ThriftError, plan_pieces,
                                    read_footer, read_piece, whole_piece)
from graphrun.records import (Candidates, Field, Prechecked, RowWhere, field_from_arrow,
                              field_from_values, numpy_dtype, precheck, shape_problem)
from graphrun.spec import PipelineSpec

ARRAY_CHUNK_BYTES = 16 << 20  # npy/npz/parquet rows read at once: about this many bytes
# ... and at most this many: a record may also cost Python objects whatever its array bytes (a
# string id; integer ids and ordinals are int64 arrays, locations are formatted only for
# rejects), so a 16 MiB chunk of narrow records (4 floats) would be 1M such objects at once.
ARRAY_CHUNK_ROWS = 16384
# Parquet row groups decoded at once. A thread decodes a list<float> column at 330k (Xeon of
# the GPU machine) to 1M (EPYC) records of 256 values a second, and the GPU machine's MLP takes
# 2.5M: so every core but four (the stager, launcher, completer and the CUDA driver's), at most
# 12. On its 16 cores 12 threads ran the MLP's run at 0.87-0.90x of replay, 8 at 0.81-0.86x.
PARQUET_THREADS = max(min(usable_cores(), 2), min(12, usable_cores() - 4))
# Columns read without their levels (parquet_pages.Flat) where decoding is short of cores. It takes
# a third of pyarrow's CPU time, but its Python runs per page (pyarrow's per batch) and so takes
# the GIL from the launching thread more often. The MLP's run from 1M records on the H200's host:
# 4 decoding threads (8 cores) 0.41-0.60x of replay with levels, 0.61-0.85x without (five
# calls); 12 threads (16 cores), round-robin, 0.953x with levels and 0.906x without (65,536-row
# groups), 0.936x both ways (one row group) (RESULTS.md). So with fewer than 8 threads only.
# (A rule that left them out once the reader kept waiting for decoding was dropped: on 16 cores
# it fired on a one-row-group file while the group was being cut, and cost that run 2%.)
PARQUET_FLAT = PARQUET_THREADS < 8
# Decoded Parquet row groups waiting ahead of the reader, those being decoded included: about
# this many bytes at most, room for the 12 threads' row groups of 65536 records of 256 float32
# (64.5 MiB each; 512 MiB held the 8 threads of before to 7 at once).
PARQUET_AHEAD_BYTES = 1 << 30
# A row group bigger than this is cut into pieces of about PARQUET_PIECE_BYTES, decoded as row
# groups are (parquet_pages.py), or where it cannot be cut streamed chunk by chunk, without
# decoding ahead: pq.write_table writes row groups of up to 1Mi rows, 1 GiB of such records.
PARQUET_GROUP_BYTES = 128 << 20
PARQUET_PIECE_BYTES = 64 << 20
# How much lower the decoding threads' priority is (nice): on the H200's host the MLP's run
# from Parquet went from 0.89-0.91x of replay to 0.91x (medians of 3) at +5; +10 and +19 were
# no better.
PARQUET_NICE = 5
# Encoded Parquet pages are read this many bytes at a time. Without it pyarrow reads a whole
# column chunk at once, and with pre_buffer (its default) every row group's asked for at once:
# 440 MiB held to stream 64 MiB row groups of a 440 MB file, whatever the batch size.
PARQUET_BUFFER_BYTES = 1 << 20
# Bytes per decoded value of each Parquet physical type; other types (strings) are counted at
# their uncompressed size in the file.
_PARQUET_VALUE_BYTES = {"BOOLEAN": 1, "INT32": 4, "FLOAT": 4, "INT64": 8, "DOUBLE": 8, "INT96": 12}
# Bytes of the Python objects a checked chunk holds per record: a string id (a str of a few
# characters and its list slot), and a record of an input with a named axis after batch (a numpy
# view each where the records' lengths differ).
_PY_STR_BYTES = 64
_PY_ARRAY_BYTES = 144


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
    behind = None  # the rows of the chunk before the last one handed out
    for lo in range(start, stop, step):
        hi = min(lo + step, stop)
        rows = np.arange(lo, hi, dtype=np.int64)  # read-only from here on: shared
        yield Candidates(
            indices=rows,
            ids=_ids(ids[lo:hi]) if ids is not None else None,
            where=RowWhere(file, rows),
            fields={name: Field(dense=np.asarray(a[lo:hi])) for name, a in arrays.items()},
        )
        # Records of the file's dtype stay views of the mapping until they are padded into
        # the host slots (no copy in between). The consumer asks for chunk k+1 only once it
        # has staged every row of chunk k-1 (batches are regrouped across one chunk edge at
        # most), so that chunk's pages are released now, one chunk behind.
        if behind is not None:
            for a in mapped:
                _release_rows(a, *behind)
        behind = (lo, hi)


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
        _dont_need(mm, first, end - first)


def _dont_need(mm: mmap.mmap, first: int, length: int) -> None:
    """madvise(MADV_DONTNEED) on bytes [first, first + length) of a mapping. mmap.madvise holds
    the GIL through the call, 0.1-0.5 ms for a 16 MiB chunk (the kernel unmaps 4096 pages) on a
    2-core VM, while the replay's other Python threads stall: libc's madvise called through
    ctypes releases it. mmap.madvise where ctypes cannot."""
    madvise = _libc_madvise()
    if madvise is not None:
        base = np.frombuffer(mm, np.uint8).ctypes.data  # the mapping's first byte
        if madvise(base + first, length, mmap.MADV_DONTNEED) == 0:
            return
    mm.madvise(mmap.MADV_DONTNEED, first, length)


@functools.lru_cache(maxsize=1)
def _libc_madvise():
    try:
        import ctypes

        fn = ctypes.CDLL(None, use_errno=True).madvise
    except (OSError, AttributeError, TypeError):  # no libc symbol table (not Linux/macOS)
        return None
    fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    fn.restype = ctypes.c_int
    return fn


def _ids(ids: np.ndarray) -> np.ndarray | list:
    """A chunk of an id array: integers as int64 (no Python int per record), strings as a list
    of str. uint64 ids past the int64 range stay Python ints (the writer stores such a shard's
    ids as strings, as it always did)."""
    if ids.dtype.kind == "S":
        return ids.astype(str).tolist()
    if ids.dtype.kind in "iu":
        return _int64_ids(np.asarray(ids))
    return ids.tolist()


def _int64_ids(ids: np.ndarray) -> np.ndarray | list:
    if ids.dtype.kind == "u" and ids.dtype.itemsize == 8 and len(ids) and ids.max() >= 2**63:
        return ids.tolist()
    return ids.astype(np.int64)


# ---- Parquet ------------------------------------------------------------------------------------

def _parquet_chunks(path: Path, spec: PipelineSpec, start: int, stop: int | None
                    ) -> Iterator[Candidates | Prechecked]:
    pf = _open_parquet(path)
    id_field = spec.data.id_field
    columns = list(spec.inputs) + ([id_field] if id_field else [])
    _check_parquet_schema(spec, pf.schema_arrow, path.name)
    meta = pf.metadata
    stop = meta.num_rows if stop is None else min(stop, meta.num_rows)
    spans, row = [], 0  # (row group, its first row) of the row groups holding rows [start, stop)
    for g in range(meta.num_row_groups):
        n = meta.row_group(g).num_rows
        if row + n > start and row < stop:
            spans.append((g, row))
        row += n
    if not spans or start >= stop:
        return
    for chunk in _parquet_batches(path, pf, spec, spans, columns, start, stop):
        # prechecked on a pool thread, or a record batch left to this thread (see _pool_chunk)
        yield chunk if isinstance(chunk, Prechecked) else _parquet_candidates(
            spec, path.name, *chunk)


def _open_parquet(path: Path, metadata=None):
    import pyarrow.parquet as pq

    try:
        return pq.ParquetFile(path, metadata=metadata, pre_buffer=False,
                              buffer_size=PARQUET_BUFFER_BYTES)
    except Exception as e:  # pyarrow raises ArrowInvalid, OSError, ... for unreadable files
        raise InputError(f"cannot read the Parquet file: {e}", where=path.name) from e


def _parquet_batches(path: Path, pf, spec: PipelineSpec, spans: list[tuple[int, int]],
                     columns: list[str], start: int, stop: int) -> Iterator:
    """The chunks of rows [start, stop) of the row groups in spans ((row group, its first row)),
    in file order: Prechecked, or (record batch, its first row) for the caller to convert.

    pyarrow decodes a column chunk on one thread, releasing the GIL meanwhile: so up to
    PARQUET_THREADS row groups are decoded at once, each whole on a pool thread, which also
    converts and checks its chunks (see _pool_chunk), at most PARQUET_AHEAD_BYTES ahead of the
    caller. A row group too big to decode whole is cut into pieces of about PARQUET_PIECE_BYTES
    decoded the same way (parquet_pages.py); one that cannot be cut is streamed when its turn
    comes, and so is the rest of a row group from a piece or row group whose decoding failed:
    a damaged page raises, naming the file, after the chunks before it."""
    meta = pf.metadata
    sizes = {g: _decoded_bytes(meta.row_group(g), spec) for g, _ in spans}
    rows = sum(meta.row_group(g).num_rows for g, _ in spans)
    step = min(ARRAY_CHUNK_ROWS, max(1, ARRAY_CHUNK_BYTES * rows // max(sum(sizes.values()), 1)))
    # whole batches per chunk where it can: a batch across a chunk edge is a copy of its rows
    step -= step % spec.data.batch_size if step > spec.data.batch_size else 0
    first = dict(spans)
    todo, ahead = deque(first), deque()  # (row group or Piece, its future; None: streamed)
    pool = ThreadPoolExecutor(PARQUET_THREADS, thread_name_prefix="parquet",
                              initializer=_lower_priority)
    chunk = functools.partial(_pool_chunk, spec, path.name)
    splitter = _Splitter(path, spec, meta, sizes, first, start, stop, pool)

    def size(unit) -> int:
        if isinstance(unit, Piece):
            return sizes[unit.group] * unit.rows // meta.row_group(unit.group).num_rows
        return sizes[unit]

    def decode(unit):
        if isinstance(unit, Piece):
            return pool.submit(_decode_piece, path, splitter, unit, step,
                               first[unit.group] + unit.first, start, stop, chunk)
        return pool.submit(_decode_group, path, meta, unit, columns, step, first[unit], start,
                           stop, chunk, splitter)

    try:
        while todo or ahead:
            _decode_ahead(todo, ahead, size, decode, splitter)
            unit, future = ahead.popleft()
            chunks = _decoded(future) if future is not None else None
            if chunks is None:  # streamed, from this piece on to the end of its row group
                g = unit.group if isinstance(unit, Piece) else unit
                lo = first[g] + (unit.first if isinstance(unit, Piece) else 0)
                _forget_group(todo, ahead, g)
                yield from _cut(_stream_group(pf, path.name, g, columns, step), first[g],
                                max(start, lo), stop)
                continue
            chunks.reverse()
            while chunks:  # dropped one by one: each is freed once the caller is done with it
                yield chunks.pop()
    finally:
        pool.shutdown(cancel_futures=True)


def _lower_priority() -> None:
    """Run this (pool) thread PARQUET_NICE below the process's priority (Linux only, where a
    thread has a priority of its own): where the decoding threads take every core, the
    scheduler then lets the stager, launcher and completer run first."""
    if sys.platform != "linux":
        return
    try:
        tid = threading.get_native_id()
        os.setpriority(os.PRIO_PROCESS, tid, min(19, os.getpriority(os.PRIO_PROCESS, tid) +
                                                 PARQUET_NICE))
    except OSError:  # not allowed here: the thread keeps its priority
        pass


def _forget_group(todo: deque, ahead: deque, g: int) -> None:
    """Drop row group g's pieces from todo and ahead, cancelling their decoding."""
    def of_g(unit) -> bool:
        return (unit.group if isinstance(unit, Piece) else unit) == g

    for unit, future in ahead:
        if of_g(unit) and future is not None:
            future.cancel()
    kept_todo = [u for u in todo if not of_g(u)]
    kept_ahead = [(u, f) for u, f in ahead if not of_g(u)]
    todo.clear()
    todo.extend(kept_todo)
    ahead.clear()
    ahead.extend(kept_ahead)


def _decode_ahead(todo: deque, ahead: deque, size, decode, splitter: "_Splitter") -> None:
    """Move row groups and pieces from todo to ahead, starting their decoding, while fewer
    than PARQUET_THREADS are ahead and their decoded bytes fit in PARQUET_AHEAD_BYTES (one fits
    always). A row group bigger than PARQUET_GROUP_BYTES is replaced by its pieces, once cut
    (not waited for while there is something ahead), or goes without a future: streamed."""
    waiting = sum(size(u) for u, future in ahead if future is not None)
    while todo and len(ahead) < PARQUET_THREADS:
        unit = todo[0]
        if not isinstance(unit, Piece) and size(unit) > PARQUET_GROUP_BYTES:
            pieces = splitter.pieces(unit, wait=not ahead)
            if pieces is _LATER:
                break
            todo.popleft()
            if pieces is None:
                ahead.append((unit, None))
            else:
                todo.extendleft(reversed(pieces))
            continue
        if ahead and waiting + size(unit) > PARQUET_AHEAD_BYTES:
            break
        todo.popleft()
        ahead.append((unit, decode(unit)))
        waiting += size(unit)
    splitter.plan_next(todo)


_LATER = object()


class _Splitter:
    """The pieces of the row groups too big to decode whole (parquet_pages.plan_pieces), cut on
    a pool thread: the next such row group is cut while the reader is still at the ones
    before it."""

    def __init__(self, path: Path, spec: PipelineSpec, meta, sizes: dict[int, int],
                 first: dict[int, int], start: int, stop: int, pool: ThreadPoolExecutor):
        self.path, self.meta, self.sizes, self.first = path, meta, sizes, first
        self.start, self.stop, self.pool = start, stop, pool
        self.per_row = _values_per_row(spec)
        # pieces and whole row groups read without their levels where those check out, where
        # decoding is short of cores
        self.flat = (Flat(_record_shapes(spec)) if PARQUET_FLAT and self.per_row is not None
                     else None)
        self.footer, self._lock = None, threading.Lock()  # the file's (Thrift), once read
        self.plans: dict = {}  # row group -> future of its pieces, or of None

    def pieces(self, g: int, wait: bool):
        """Its pieces; None: stream it; _LATER: not cut yet, and not to be waited for."""
        if self.per_row is None:
            return None
        if g not in self.plans:
            self.plans[g] = self.pool.submit(self._plan, g)
        if not wait and not self.plans[g].done():
            return _LATER
        try:
            return self.plans.pop(g).result()
        except Exception:  # noqa: BLE001 - a file the plan cannot read is streamed as before
            return None

    def plan_next(self, todo: deque) -> None:
        if self.per_row is None:
            return
        for unit in todo:
            if not isinstance(unit, Piece) and self.sizes[unit] > PARQUET_GROUP_BYTES:
                if unit not in self.plans:
                    self.plans[unit] = self.pool.submit(self._plan, unit)
                return

    def _plan(self, g: int) -> list | None:
        with open(self.path, "rb") as f:
            n = self.meta.row_group(g).num_rows
            piece_rows = max(1, n * PARQUET_PIECE_BYTES // max(self.sizes[g], 1))
            pieces = plan_pieces(f, self.read_footer(f), g, self.per_row, piece_rows)
        if pieces is None:
            return None
        lo, hi = self.start - self.first[g], self.stop - self.first[g]
        return [p for p in pieces if p.first < hi and p.first + p.rows > lo]

    def read_footer(self, f) -> dict:
        """The file's footer, read once; f: the file, open."""
        with self._lock:
            if self.footer is None:
                self.footer = read_footer(f)
            return self.footer

    def whole(self, g: int):
        """Row group g decoded as a piece, its columns without their levels where those check
        out (parquet_pages.Flat); None where it is not worth trying (no column read so) or its
        pages cannot be walked."""
        if self.flat is None or not self.flat.trying():
            return None
        try:
            with open(self.path, "rb") as f:
                footer = self.read_footer(f)
                piece = whole_piece(f, footer, g, self.per_row)
        except (OSError, ThriftError):
            return None
        if piece is None:
            return None
        try:
            return read_piece(self.path, footer, piece, self.flat)
        except PieceMismatch:
            return None


def _record_shapes(spec: PipelineSpec) -> dict[str, tuple[int, ...]]:
    """Each column's shape per record, for the inputs of a fixed shape and the id (())."""
    shapes = {name: tuple(inp.shape[1:]) for name, inp in spec.inputs.items()
              if all(isinstance(d, int) for d in inp.shape[1:])}
    if spec.data.id_field:
        shapes[spec.data.id_field] = ()
    return shapes


def _values_per_row(spec: PipelineSpec) -> dict[str, int] | None:
    """Values a record holds in each column read (1 for the id and a scalar input); None
    where an input's shape after batch is not fixed (its pages cannot be cut by their counts)."""
    shapes = _record_shapes(spec)
    if any(name not in shapes for name in spec.inputs):
        return None
    per_row = {name: math.prod(shape) for name, shape in shapes.items()}
    return None if 0 in per_row.values() else per_row


def _decoded_bytes(group, spec: PipelineSpec) -> int:
    """About how many bytes a row group of the spec's columns takes decoded and checked: values
    times their width, the wider of the file's and the input's dtype (a checked chunk holds its
    values converted), as the sizes in the metadata are of encoded pages, which a dictionary
    can make far smaller (each of the 16M values of a float column written by
    bench_datapath.py takes 1.7 bytes); and per record its ordinal and lengths, and the Python
    objects of a string id or of a record of variable length."""
    id_field = spec.data.id_field
    widths = {name: numpy_dtype(inp.dtype).itemsize for name, inp in spec.inputs.items()}
    if id_field:
        widths[id_field] = 8
    variable = sum(any(isinstance(d, str) for d in inp.shape[1:]) for inp in spec.inputs.values())
    total = group.num_rows * (8 * len(spec.axes) + _PY_ARRAY_BYTES * variable)
    for i in range(group.num_columns):
        c = group.column(i)
        name = c.path_in_schema.split(".")[0]
        if name not in widths:
            continue
        width = _PARQUET_VALUE_BYTES.get(c.physical_type)
        if width is None:  # strings: their bytes, and a Python str each for an id
            total += c.total_uncompressed_size + _PY_STR_BYTES * group.num_rows * (
                name == id_field)
        else:
            total += c.num_values * max(width, widths[name])
    return total


def _decode_group(path: Path, meta, group: int, columns: list[str], step: int, first: int,
                  start: int, stop: int, chunk, splitter: "_Splitter") -> list:
    """The chunks of one row group's rows in [start, stop), on a pool thread, from a reader of
    its own: each decoded record batch of `step` rows and its first row, through chunk(). The
    group's first row is `first`. Decoded as one piece where its columns' levels can be left
    out (_Splitter.whole), else by pyarrow."""
    rb = splitter.whole(group)
    if rb is not None:
        batches = (rb.slice(lo, step) for lo in range(0, rb.num_rows, step))
        return [chunk(b, row) for b, row in _cut(batches, first, start, stop)]
    with _open_parquet(path, meta) as f:
        batches = f.iter_batches(batch_size=step, row_groups=[group], columns=columns)
        return [chunk(rb, row) for rb, row in _cut(batches, first, start, stop)]


def _decode_piece(path: Path, splitter: "_Splitter", piece: Piece, step: int, first: int,
                  start: int, stop: int, chunk) -> list:
    """The chunks of one piece's rows in [start, stop), as _decode_group's; its first row in
    the file is `first`."""
    rb = read_piece(path, splitter.footer, piece, splitter.flat)
    batches = (rb.slice(lo, step) for lo in range(0, rb.num_rows, step))
    return [chunk(b, row) for b, row in _cut(batches, first, start, stop)]


def _cut(batches: Iterator, row: int, start: int, stop: int) -> Iterator[tuple]:
    """(record batch, its first row) for the rows in [start, stop) of consecutive record batches,
    the first starting at `row`."""
    for rb in batches:
        lo, hi = max(start - row, 0), min(stop - row, rb.num_rows)
        if hi > lo:
            yield rb.slice(lo, hi - lo), row + lo
        row += rb.num_rows
        if row >= stop:
            return


def _pool_chunk(spec: PipelineSpec, file: str, rb, first: int):
    """One chunk as a pool thread leaves it: converted and prechecked, so that the reader's
    thread only checks its ids for duplicates. A chunk that needs its values in Python to say
    what is wrong (nulls, ragged nested lists) is left as it is, (rb, first), for the reader's
    thread to convert: memory stays one chunk of Python values, as the pool runs ahead."""
    c = _parquet_candidates(spec, file, rb, first, python_values=False)
    return (rb, first) if c is None else precheck(spec, c)


def _decoded(future) -> list | None:
    try:
        return future.result()
    except Exception:  # noqa: BLE001 - read again by _stream_group, which says what is wrong
        return None


def _stream_group(pf, file: str, group: int, columns: list[str], step: int) -> Iterator:
    """One row group's record batches, decoded one at a time; a damaged page becomes an
    InputError naming the file."""
    batches = pf.iter_batches(batch_size=step, row_groups=[group], columns=columns)
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


def _parquet_candidates(spec: PipelineSpec, file: str, rb, first: int,
                        python_values: bool = True) -> Candidates | None:
    """The records of a record batch whose first row is `first`. Without python_values, None
    where an input column has to be read as Python values (nulls, ragged nested lists)."""
    n = rb.num_rows
    fields, problems = {}, {}
    for name, inp in spec.inputs.items():
        col = rb.column(name)
        columnar = field_from_arrow(col, len(inp.shape) - 1)
        if columnar is not None:
            fields[name] = columnar
            continue
        if not python_values:
            return None
        # nulls or ragged nested lists: read as Python values for a reason per record
        fields[name], found = field_from_values(name, inp, col.to_pylist())
        for p, reason in found.items():
            problems.setdefault(p, reason)
    ids = None
    if spec.data.id_field:
        col = rb.column(spec.data.id_field)
        ids = _parquet_ids(col)
        if col.null_count:  # a Python loop over the ids only when some are null
            for p in np.flatnonzero(col.is_null().to_numpy(zero_copy_only=False)).tolist():
                problems.setdefault(p, f"missing id: {spec.data.id_field!r} is null")
    rows = np.arange(first, first + n, dtype=np.int64)
    return Candidates(rows, ids, RowWhere(file, rows), fields, problems)


def _parquet_ids(col) -> np.ndarray | list:
    """An integer id column without nulls as int64 (see _ids), else its Python values."""
    import pyarrow as pa

    if pa.types.is_integer(col.type) and not col.null_count:
        return _int64_ids(col.to_numpy(zero_copy_only=False))
    return col.to_pylist()
