"""parquet shards: part-00000.parquet, an `id` column (int64 for int ids, else string) and a
column per output: a scalar for shape [batch], nested lists otherwise (ragged axes allowed).
Memory stays within one row group plus a shard's ids."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from graphrun.base.errors import OutputError
from graphrun.write.sinks.ids import Ids
from graphrun.base.tuning import Tuning
from graphrun.base.nofollow import open_file


class ParquetSink:
    """Rows are buffered per record and written as a row group each time the buffer reaches
    tuning.parquet_row_group_bytes; the cut depends only on the rows, so a resumed run writes
    the same file."""

    suffix = ".parquet"
    uses_row_pool = False
    hashes_ahead = False

    def __init__(self, out_dir: Path, stem: str, rows_per_file: int, shapes: dict,
                 tuning: Tuning, pool=None):
        self.tmp = out_dir / f".{stem}.parquet.tmp"
        self.name = f"{stem}.parquet"
        self.row_group_bytes = tuning.parquet_row_group_bytes
        self.ids = Ids()
        self.columns: dict[str, list] = {}
        self.bytes = 0
        self.writer: pq.ParquetWriter | None = None
        self.file = None  # the tmp file the writer writes: opened here, closed here

    @staticmethod
    def check(outputs: dict) -> None:
        if "id" in outputs:
            raise OutputError("output 'id' clashes with the record id in parquet; rename it")

    def add(self, ids, outputs: dict) -> None:
        if all(isinstance(v, np.ndarray) for v in outputs.values()):
            whole = sum(v.nbytes for v in outputs.values())
            if self.bytes + whole < self.row_group_bytes:  # no row reaches the cap: no cut
                self.ids.add(ids)
                for name, v in outputs.items():
                    self.columns.setdefault(name, []).append(v)
                self.bytes += whole
                return
        # per row, the bytes of all its outputs: where the row group is cut
        sizes = np.sum([row_bytes(v) for v in outputs.values()], axis=0)
        start = 0
        while start < len(ids):
            filled = self.bytes + np.cumsum(sizes[start:])
            k = int(np.searchsorted(filled, self.row_group_bytes))  # first row reaching the cap
            stop = min(len(ids), start + k + 1)
            self.ids.add(ids[start:stop])
            for name, v in outputs.items():  # a batch's array (or its records' list), sliced
                self.columns.setdefault(name, []).append(v[start:stop])
            self.bytes = int(filled[stop - start - 1])
            start = stop
            if k < len(filled):
                self._flush()

    def _flush(self) -> None:
        columns = {"id": self._id_column()}
        columns.update((name, arrow_column(joined(parts)))
                       for name, parts in self.columns.items())
        table = pa.table(columns)
        if self.writer is None:
            self.file = open_file(self.tmp, "wb")
            self.writer = pq.ParquetWriter(self.file, table.schema)
        self.writer.write_table(table, row_group_size=len(table))
        self.ids, self.columns, self.bytes = Ids(), {}, 0

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
        writer, self.writer = self.writer, None  # once: abort may follow a failed finish
        if writer is not None:
            writer.close()
        if self.file is not None:
            self.file.close()
        self.tmp.unlink(missing_ok=True)

    def finish(self) -> list[tuple[Path, str]]:
        if len(self.ids):
            self._flush()
        self.writer.close()
        self.file.close()
        return [(self.tmp, self.name)]


def row_bytes(v) -> np.ndarray:
    """[n] bytes of each row of one output: a batch's array [n, ...], or a list of records."""
    if isinstance(v, np.ndarray):
        return np.full(len(v), v.itemsize * int(np.prod(v.shape[1:])), np.int64)
    return np.array([np.asarray(r).nbytes for r in v], np.int64)


def joined(parts: list):
    """A row group's batches of one output: one array [n, ...] where every batch is an array
    of one shape (one copy, no Python per row), else the records' list."""
    if all(isinstance(p, np.ndarray) for p in parts) and len({p.shape[1:] for p in parts}) == 1:
        return np.concatenate(parts)
    return [r for p in parts for r in (list(p) if isinstance(p, np.ndarray) else p)]


def arrow_column(records) -> pa.Array:
    """n per-record arrays of one ndim, or one array [n, ...] -> a scalar column (ndim 0) or
    nested list column; the same column either way."""
    if isinstance(records, np.ndarray):
        return _dense_column(records)
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


def _dense_column(a: np.ndarray) -> pa.Array:
    """arrow_column of the records a[0], a[1], ...: every list of an axis as long as it."""
    column = pa.array(a.reshape(-1))
    for axis in reversed(range(1, a.ndim)):
        lists = int(np.prod(a.shape[:axis]))  # one list per element of the axes before
        offsets = np.arange(lists + 1, dtype=np.int32) * np.int32(a.shape[axis])
        column = pa.ListArray.from_arrays(pa.array(offsets), column)
    return column
