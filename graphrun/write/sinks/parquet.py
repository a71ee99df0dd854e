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
from graphrun.write.sinks.rows_log import RowsLog, log_path
from graphrun.base.tuning import Tuning


class ParquetSink:
    """Rows are buffered per record and written as a row group each time the buffer reaches
    tuning.parquet_row_group_bytes; the cut depends only on the rows, so a resumed run writes
    the same file.

    A parquet file cannot be read back before its footer is written, so each row group's rows
    also go to a RowsLog as it is written (raw arrays, without parquet's encoding), and
    checkpoint() adds the rows still buffered: rows= replays the log into a new file."""

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
        self.log = RowsLog(log_path(out_dir, stem, "parquet"))
        self.logs = [self.log.path]
        self._logged = None  # buffered rows already in the log; None: while replaying it
        if rows:
            for ids, records in self.log.read():
                self.add(ids, records)
        self._logged = len(self.ids)

    @staticmethod
    def check(outputs: dict) -> None:
        if "id" in outputs:
            raise OutputError("output 'id' clashes with the record id in parquet; rename it")

    def add(self, ids, outputs: dict) -> None:
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

    def _log_buffered(self) -> None:
        if self._logged is not None and self._logged < len(self.ids):
            self.log.append(self.ids.values()[self._logged:],
                            {name: rs[self._logged:] for name, rs in self.columns.items()})
            self._logged = len(self.ids)

    def checkpoint(self) -> list[tuple[Path, int]]:
        self._log_buffered()
        return [(self.log.path, self.log.size())]

    def _flush(self) -> None:
        self._log_buffered()
        if self._logged is not None:
            self._logged = 0
        columns = {"id": self._id_column()}
        columns.update((name, arrow_column(rs)) for name, rs in self.columns.items())
        table = pa.table(columns)
        if self.writer is None:
            self.writer = pq.ParquetWriter(self.tmp, table.schema)
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

    def leave(self) -> None:
        writer, self.writer = self.writer, None  # once: abort may follow a failed finish
        if writer is not None:
            writer.close()
        self.log.close()

    def abort(self) -> None:
        self.leave()
        self.tmp.unlink(missing_ok=True)
        self.log.remove()

    def finish(self) -> list[tuple[Path, str]]:
        if len(self.ids):
            self._flush()
        self.writer.close()
        self.log.close()
        return [(self.tmp, self.name)]


def arrow_column(records: list) -> pa.Array:
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
