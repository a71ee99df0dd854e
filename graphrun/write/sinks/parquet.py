"""parquet shards: part-00000.parquet, an `id` column (int64 for int ids, else string) and a
column per output: a scalar for shape [batch], nested lists otherwise (ragged axes allowed).
Memory stays within a few row groups (one buffered, at most two more waiting for the rows log:
rows_log.RowsLog) plus a shard's ids."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from graphrun.base.errors import OutputError
from graphrun.write.sinks.ids import Ids
from graphrun.write.sinks.rows_log import RowsLog, log_path
from graphrun.base.tuning import Tuning
from graphrun.base.nofollow import open_file


class ParquetSink:
    """Rows are buffered per record and written as a row group each time the buffer reaches
    tuning.parquet_row_group_bytes; the cut depends only on the rows, so a resumed run writes
    the same file.

    A parquet file cannot be read back before its footer is written, so each row group's
    Arrow table also goes to a RowsLog as it is written (copied, not encoded again), and
    checkpoint() adds the rows still buffered: rows= writes the logged row groups into a new
    file and buffers the rows after them again."""

    suffix = ".parquet"
    uses_row_pool = False
    hashes_ahead = False

    def __init__(self, out_dir: Path, stem: str, rows_per_file: int, shapes: dict,
                 tuning: Tuning, pool=None, rows: int = 0):
        self.tmp = out_dir / f".{stem}.parquet.tmp"
        self.name = f"{stem}.parquet"
        self.row_group_bytes = tuning.parquet_row_group_bytes
        self.ids = Ids()
        self.columns: dict[str, list] = {}
        self.bytes = 0
        self.writer: pq.ParquetWriter | None = None
        self.file = None  # the tmp file the writer writes: opened here, closed here
        self.log = RowsLog(log_path(out_dir, stem, "parquet"))
        self.logs = [self.log.path]
        self._logged = 0  # buffered rows already in the log
        if rows:
            self._reopen()

    def _reopen(self) -> None:
        buffered = []  # rows frames after the last row group: the buffer at the checkpoint
        for kind, *frame in self.log.read():
            if kind == "group":
                self._write_group(frame[0])
                buffered = []
            else:
                buffered.append(frame)
        for ids, records in buffered:  # below the row group's size: add() flushes none
            self.add(ids, records)
        self._logged = len(self.ids)

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

    def checkpoint(self) -> list[tuple[Path, int]]:
        self.log.append_rows(self.ids.values()[self._logged:],  # the rows not yet logged
                             {name: joined(parts)[self._logged:]
                              for name, parts in self.columns.items()})
        self._logged = len(self.ids)
        return [(self.log.path, self.log.size())]

    def _flush(self) -> None:
        columns = {"id": self._id_column()}
        columns.update((name, arrow_column(joined(parts)))
                       for name, parts in self.columns.items())
        table = pa.table(columns)
        self._write_group(table)
        self.log.append_group(table)
        self.ids, self.columns, self.bytes, self._logged = Ids(), {}, 0, 0

    def _write_group(self, table: pa.Table) -> None:
        if self.writer is None:
            self.file = open_file(self.tmp, "wb")
            self.writer = pq.ParquetWriter(self.file, table.schema)
        self.writer.write_table(table, row_group_size=len(table))

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

    def leave(self) -> None:
        writer, self.writer = self.writer, None  # once: abort may follow a failed finish
        if writer is not None:
            writer.close()
        if self.file is not None:
            self.file.close()
        self.log.close()

    def abort(self) -> None:
        self.leave()
        self.tmp.unlink(missing_ok=True)
        self.log.remove()

    def finish(self) -> list[tuple[Path, str]]:
        if len(self.ids):
            self._flush()
        self.writer.close()
        self.file.close()
        self.log.close()
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
