"""The shard sinks of the write step: one per output.format, each writing one shard's rows into
temp files and, at finish(), completing and closing them and handing back (temp path, final
name). Making them durable (hash, fsync, rename, journal) is the committer's work, off the
writer's thread (write.py), so finish() does no fsync.

The files of shard 00000 by format:

    npy      part-00000.ids.npy (int64 when every id is an int, else unicode) and
             part-00000.<output>.npy per output, [rows, ...] in the output dtype
    jsonl    part-00000.jsonl, one {"id": ..., "<output>": nested lists, ...} per line
             (non-finite floats as NaN / Infinity, as Python's json writes them)
    parquet  part-00000.parquet: an `id` column (int64 for int ids, else string)
             and a column per output: a scalar for shape [batch], nested lists otherwise
             (ragged axes allowed)

Memory stays within one parquet row group (~64 MiB) plus a shard's ids; npy and jsonl rows go
straight to disk.
"""

from __future__ import annotations

import json
import os
import struct
from collections import deque
from concurrent.futures import Executor, Future
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from graphrun.errors import OutputError

Outputs = dict[str, "np.ndarray | list[np.ndarray]"]

POOL_WRITE_BYTES = 1 << 20  # npy batches at least this big are written by the row pool
MAX_PENDING = 8  # npy batches handed to the row pool and not yet written, at most


def shard_suffixes(fmt: str, outputs: list[str]) -> list[str]:
    """What follows `part-00000.` in a shard's file names, for the format (the list above)."""
    if fmt == "npy":
        return ["ids.npy"] + [f"{name}.npy" for name in outputs]
    return [fmt]


def _plain(x):
    """numpy scalars to the Python values json can write."""
    return x.item() if isinstance(x, np.generic) else x


def _id_array(ids: list) -> np.ndarray:
    """int64 when every id is an integer (one numpy conversion, not a Python test per id),
    else their strings."""
    if not len(ids):
        return np.zeros(0, np.int64)
    try:
        a = np.asarray(ids)
    except (ValueError, OverflowError):  # ragged or huge: not a plain integer column
        a = None
    if a is not None and a.dtype.kind in "iu" and (a.dtype.kind == "i" or a.max() < 2**63):
        return a.astype(np.int64, copy=False)
    return np.array([str(x) for x in ids])


class _Ids:
    """A shard's ids as the batches gave them. Batches of int64 arrays (the reader's ordinals
    and integer ids) stay arrays and are joined by one concatenate at the end; anything else
    is turned into Python values, as ids always were (same files either way)."""

    def __init__(self):
        self.parts: list = []
        self.count = 0

    def __len__(self) -> int:
        return self.count

    def add(self, ids) -> None:
        """ids: a list, or an array (copied: the caller may reuse its own)."""
        if not len(ids):
            return
        if isinstance(ids, np.ndarray):
            ids = ids.copy() if ids.dtype == np.int64 else ids.tolist()
        self.parts.append(ids)
        self.count += len(ids)

    def _all_arrays(self) -> bool:
        return all(isinstance(p, np.ndarray) for p in self.parts)

    def values(self) -> list:
        return [x for p in self.parts for x in (p.tolist() if isinstance(p, np.ndarray) else p)]

    def array(self) -> np.ndarray:
        """What _id_array makes of all the ids."""
        if self.parts and self._all_arrays():  # int64 arrays: add() made lists of others
            return np.concatenate(self.parts)
        return _id_array(self.values())


def _npy_header(dtype: np.dtype, shape: tuple, length: int | None = None) -> bytes:
    """A version 1.0 .npy header, space-padded to `length` bytes (default: a multiple of 64)."""
    text = f"{{'descr': {dtype.str!r}, 'fortran_order': False, 'shape': {shape!r}, }}"
    body = text.encode("latin1")
    length = length or -(-(10 + len(body) + 1) // 64) * 64
    return (b"\x93NUMPY\x01\x00" + struct.pack("<H", length - 10) + body
            + b" " * (length - 11 - len(body)) + b"\n")


class _NpySink:
    """Rows go straight to one temp file per output, behind a header sized for a full shard
    and rewritten with the real row count at the end; ids are kept until then.

    Rows are written at their own offset (pwrite). Big batches (a decoder's logits: 4 MB) go to
    the writer's row pool, a few threads writing at once: one thread copies into the page cache
    at about 3 GB/s, slower than a GPU makes logits. Each batch's rows stay referenced until
    written, at most MAX_PENDING batches; a write's error is raised by the next add() or
    finish(). Small batches are written on the caller's thread."""

    def __init__(self, out_dir: Path, stem: str, rows_per_file: int, shapes: dict,
                 pool: Executor | None = None):
        self.out_dir, self.stem = out_dir, stem
        self.rows_per_file, self.shapes = rows_per_file, shapes
        self.pool = pool
        self.ids = _Ids()
        self.files: dict[str, _RowFile] = {}
        self._pending: deque[Future] = deque()
        self.error: BaseException | None = None  # a failed write: this shard is never finished

    def add(self, ids, outputs: Outputs) -> None:
        self.ids.add(ids)
        for name, value in outputs.items():
            a = value if isinstance(value, np.ndarray) else np.stack(value)
            if a.shape[1:] != self.shapes[name]:
                raise OutputError(f"output {name!r}: rows of shape {list(a.shape[1:])}, "
                                  f"the spec says {self.shapes[name]}")
            if name not in self.files:
                self.files[name] = self._open(name, a.dtype)
            f = self.files[name]
            data = memoryview(np.ascontiguousarray(a)).cast("B")
            offset, f.end = f.end, f.end + len(data)
            if self.pool is None or len(data) < POOL_WRITE_BYTES:
                self._settle(_pwrite_all, f.fd, data, offset)
                continue
            while self._pending and (self._pending[0].done()
                                     or len(self._pending) >= MAX_PENDING):
                self._settle(self._pending.popleft().result)
            self._pending.append(self.pool.submit(_pwrite_all, f.fd, data, offset))

    def _settle(self, call, *args) -> None:
        """Run a write (or wait for one); a failure is kept: the shard has a hole."""
        try:
            call(*args)
        except BaseException as exc:
            self.error = self.error or exc
            raise

    def _open(self, name: str, dtype: np.dtype) -> "_RowFile":
        path = self.out_dir / f".{self.stem}.{name}.npy.tmp"
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o666)
        header = _npy_header(dtype, (self.rows_per_file, *self.shapes[name]))
        _pwrite_all(fd, header, 0)
        return _RowFile(fd, path, dtype, len(header), len(header))

    def _wait(self) -> None:
        while self._pending:
            self._settle(self._pending.popleft().result)
        if self.error is not None:
            raise self.error

    def abort(self) -> None:
        try:
            for future in self._pending:  # let no thread write into a closed descriptor
                future.exception()
        finally:
            self._pending.clear()
            for f in self.files.values():
                f.close()
                f.path.unlink(missing_ok=True)

    def finish(self) -> list[tuple[Path, str]]:
        self._wait()
        ids_tmp = self.out_dir / f".{self.stem}.ids.npy.tmp"
        with open(ids_tmp, "wb") as f:
            np.save(f, self.ids.array(), allow_pickle=False)
        placed = [(ids_tmp, f"{self.stem}.ids.npy")]
        for name, f in self.files.items():
            header = _npy_header(f.dtype, (len(self.ids), *self.shapes[name]), f.header_bytes)
            _pwrite_all(f.fd, header, 0)
            f.close()
            placed.append((f.path, f"{self.stem}.{name}.npy"))
        return placed


@dataclass
class _RowFile:
    """One output's temp file of a shard: rows are appended at `end`."""

    fd: int
    path: Path
    dtype: np.dtype
    header_bytes: int
    end: int

    def close(self) -> None:
        """Once: a second close (abort after finish) must not close a descriptor number the
        process has since given to another file."""
        fd, self.fd = self.fd, -1
        if fd >= 0:
            os.close(fd)


def _pwrite_all(fd: int, data, offset: int) -> None:
    """Write all of `data` at `offset` (pwrite may write less than asked)."""
    view = memoryview(data)
    while view:
        n = os.pwrite(fd, view, offset)
        view, offset = view[n:], offset + n


class _JsonlSink:
    """One JSON object per record, written as it comes."""

    def __init__(self, out_dir: Path, stem: str):
        self.tmp = out_dir / f".{stem}.jsonl.tmp"
        self.name = f"{stem}.jsonl"
        self.f = open(self.tmp, "w", encoding="utf-8", newline="\n")

    def add(self, ids, outputs: Outputs) -> None:
        if isinstance(ids, np.ndarray):
            ids = ids.tolist()
        for i, rid in enumerate(ids):
            row = {"id": _plain(rid)}
            row.update((name, v[i].tolist()) for name, v in outputs.items())
            self.f.write(json.dumps(row, separators=(",", ":")) + "\n")

    def abort(self) -> None:
        self.f.close()
        self.tmp.unlink(missing_ok=True)

    def finish(self) -> list[tuple[Path, str]]:
        self.f.close()
        return [(self.tmp, self.name)]


class _ParquetSink:
    """Rows are buffered per record and written as a row group each time the buffer reaches
    row_group_bytes; the cut depends only on the rows, so a resumed run writes the same file."""

    row_group_bytes = 64 << 20

    def __init__(self, out_dir: Path, stem: str):
        self.tmp = out_dir / f".{stem}.parquet.tmp"
        self.name = f"{stem}.parquet"
        self.ids = _Ids()
        self.columns: dict[str, list] = {}
        self.bytes = 0
        self.writer: pq.ParquetWriter | None = None

    def add(self, ids, outputs: Outputs) -> None:
        records = {name: list(v) for name, v in outputs.items()}  # per-record arrays (views)
        sizes = np.sum([[np.asarray(r).nbytes for r in rs] for rs in records.values()], axis=0)
        start = 0
        while start < len(ids):
            filled = self.bytes + np.cumsum(sizes[start:])
            k = int(np.searchsorted(filled, self.row_group_bytes))  # first row reaching the cap
            stop = min(len(ids), start + k + 1)
            self.ids.add(ids[start:stop])
            for name, rs in records.items():
                self.columns.setdefault(name, []).extend(rs[start:stop])
            self.bytes = int(filled[stop - start - 1])
            start = stop
            if k < len(filled):
                self._flush()

    def _flush(self) -> None:
        columns = {"id": self._id_column()}
        columns.update((name, _arrow_column(rs)) for name, rs in self.columns.items())
        table = pa.table(columns)
        if self.writer is None:
            self.writer = pq.ParquetWriter(self.tmp, table.schema)
        self.writer.write_table(table, row_group_size=len(table))
        self.ids, self.columns, self.bytes = _Ids(), {}, 0

    def _id_column(self) -> pa.Array:
        # The first row group fixes the type: ints may join a string column, not the reverse.
        int_column = self.writer.schema.field("id").type == pa.int64() if self.writer else None
        ids = self.ids.array()
        as_int = ids.dtype.kind == "i"
        if int_column and not as_int:
            raise OutputError(f"{self.name}: record ids mix ints and strings; parquet needs "
                              "one id type per shard")
        if as_int and int_column is not False:
            return pa.array(ids, pa.int64())
        return pa.array([str(x) for x in self.ids.values()], pa.string())

    def abort(self) -> None:
        writer, self.writer = self.writer, None
        if writer is not None:
            writer.close()
        self.tmp.unlink(missing_ok=True)

    def finish(self) -> list[tuple[Path, str]]:
        if len(self.ids):
            self._flush()
        self.writer.close()
        return [(self.tmp, self.name)]


def _arrow_column(records: list) -> pa.Array:
    """n per-record arrays of one ndim -> a scalar column (ndim 0) or nested list column."""
    if np.ndim(records[0]) == 0:
        return pa.array(np.asarray(records))
    values = pa.array(np.concatenate([np.ravel(r) for r in records]))
    shapes = np.array([np.shape(r) for r in records])  # [n, ndim]
    column = values
    for axis in reversed(range(shapes.shape[1])):
        # One list per element of the axes before `axis`, each shapes[:, axis] long.
        lengths = np.repeat(shapes[:, axis], np.prod(shapes[:, :axis], axis=1))
        offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
        column = pa.ListArray.from_arrays(pa.array(offsets), column)
    return column
