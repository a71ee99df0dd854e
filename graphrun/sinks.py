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
import struct
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from graphrun.errors import OutputError

Outputs = dict[str, "np.ndarray | list[np.ndarray]"]


def _plain(x):
    """numpy scalars to the Python values json can write."""
    return x.item() if isinstance(x, np.generic) else x


def _all_ints(ids: list) -> bool:
    """Every id an integer (bools are not): one numpy conversion, not a Python test per id."""
    if not len(ids):
        return True
    try:
        return np.asarray(ids).dtype.kind in "iu"
    except (ValueError, OverflowError):  # ragged or huge: not a plain integer column
        return False


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


def _npy_header(dtype: np.dtype, shape: tuple, length: int | None = None) -> bytes:
    """A version 1.0 .npy header, space-padded to `length` bytes (default: a multiple of 64)."""
    text = f"{{'descr': {dtype.str!r}, 'fortran_order': False, 'shape': {shape!r}, }}"
    body = text.encode("latin1")
    length = length or -(-(10 + len(body) + 1) // 64) * 64
    return (b"\x93NUMPY\x01\x00" + struct.pack("<H", length - 10) + body
            + b" " * (length - 11 - len(body)) + b"\n")


class _NpySink:
    """Rows go straight to one temp file per output, behind a header sized for a full shard
    and rewritten with the real row count at the end; ids are kept until then."""

    def __init__(self, out_dir: Path, stem: str, rows_per_file: int, shapes: dict):
        self.out_dir, self.stem = out_dir, stem
        self.rows_per_file, self.shapes = rows_per_file, shapes
        self.ids: list = []
        self.files: dict[str, tuple] = {}  # name -> (file, dtype, header length)

    def add(self, ids: list, outputs: Outputs) -> None:
        self.ids += ids
        for name, value in outputs.items():
            a = value if isinstance(value, np.ndarray) else np.stack(value)
            if a.shape[1:] != self.shapes[name]:
                raise OutputError(f"output {name!r}: rows of shape {list(a.shape[1:])}, "
                                  f"the spec says {self.shapes[name]}")
            if name not in self.files:
                self.files[name] = self._open(name, a.dtype)
            self.files[name][0].write(memoryview(np.ascontiguousarray(a)).cast("B"))

    def _open(self, name: str, dtype: np.dtype) -> tuple:
        f = open(self.out_dir / f".{self.stem}.{name}.npy.tmp", "wb")
        header = _npy_header(dtype, (self.rows_per_file, *self.shapes[name]))
        f.write(header)
        return f, dtype, len(header)

    def abort(self) -> None:
        for f, _, _ in self.files.values():
            f.close()
            Path(f.name).unlink(missing_ok=True)

    def finish(self) -> list[tuple[Path, str]]:
        ids_tmp = self.out_dir / f".{self.stem}.ids.npy.tmp"
        with open(ids_tmp, "wb") as f:
            np.save(f, _id_array(self.ids), allow_pickle=False)
        placed = [(ids_tmp, f"{self.stem}.ids.npy")]
        for name, (f, dtype, length) in self.files.items():
            f.seek(0)
            f.write(_npy_header(dtype, (len(self.ids), *self.shapes[name]), length))
            f.close()
            placed.append((Path(f.name), f"{self.stem}.{name}.npy"))
        return placed


class _JsonlSink:
    """One JSON object per record, written as it comes."""

    def __init__(self, out_dir: Path, stem: str):
        self.tmp = out_dir / f".{stem}.jsonl.tmp"
        self.name = f"{stem}.jsonl"
        self.f = open(self.tmp, "w", encoding="utf-8", newline="\n")

    def add(self, ids: list, outputs: Outputs) -> None:
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
        self.ids: list = []
        self.columns: dict[str, list] = {}
        self.bytes = 0
        self.writer: pq.ParquetWriter | None = None

    def add(self, ids: list, outputs: Outputs) -> None:
        records = {name: list(v) for name, v in outputs.items()}  # per-record arrays (views)
        sizes = np.sum([[np.asarray(r).nbytes for r in rs] for rs in records.values()], axis=0)
        start = 0
        while start < len(ids):
            filled = self.bytes + np.cumsum(sizes[start:])
            k = int(np.searchsorted(filled, self.row_group_bytes))  # first row reaching the cap
            stop = min(len(ids), start + k + 1)
            self.ids += ids[start:stop]
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
        self.ids, self.columns, self.bytes = [], {}, 0

    def _id_column(self) -> pa.Array:
        # The first row group fixes the type: ints may join a string column, not the reverse.
        int_column = self.writer.schema.field("id").type == pa.int64() if self.writer else None
        as_int = _all_ints(self.ids)
        if int_column and not as_int:
            raise OutputError(f"{self.name}: record ids mix ints and strings; parquet needs "
                              "one id type per shard")
        if as_int and int_column is not False:
            return pa.array([int(x) for x in self.ids], pa.int64())
        return pa.array([str(x) for x in self.ids], pa.string())

    def abort(self) -> None:
        if self.writer is not None:
            self.writer.close()
        self.tmp.unlink(missing_ok=True)

    def finish(self) -> list[tuple[Path, str]]:
        if self.ids:
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
