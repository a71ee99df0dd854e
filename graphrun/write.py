"""The write step: output shards, rejects, and the journal that makes a run resumable.

Shards hold `output.rows_per_file` records each (the last one fewer), numbered from 00000:

    npy      part-00000.ids.npy (int64 when every id is an int, else unicode) and
             part-00000.<output>.npy per output, [rows, ...] in the output dtype
    jsonl    part-00000.jsonl, one {"id": ..., "<output>": nested lists, ...} per line
             (non-finite floats as NaN / Infinity, as Python's json writes them)
    parquet  part-00000.parquet: an `id` column (int64 for int ids, else string)
             and a column per output: a scalar for shape [batch], nested lists otherwise
             (ragged axes allowed)

A shard is written as `.part-00000.<suffix>.tmp`, fsynced and renamed into place when full, and
only then journaled (journal.py), so a crash leaves committed shards plus temp files that a
resume deletes. bfloat16 outputs are stored as float32 holding bfloat16-rounded values (numpy,
npy and parquet have no bfloat16). Memory stays within one parquet row group (~64 MiB) plus a
shard's ids; npy and jsonl rows go straight to disk.

Rejects must reach reject() before write() is given any row with a larger ordinal: a shard's
commit writes the rejects below its next_index, and a resume starts reading there.
"""

from __future__ import annotations

import json
import os
import re
import struct
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from graphrun.errors import OutputError
from graphrun.journal import (REJECTS, FileInfo, ResumePoint, append_journal, check_fresh,
                              fsync_dir, prepare_out_dir, read_journal, restore, sha256_file)
from graphrun.spec import BATCH, PipelineSpec

__all__ = ["ShardWriter", "FileInfo", "ResumePoint", "prepare_out_dir", "read_journal",
           "sha256_file"]

SAFE_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]*")
Outputs = dict[str, "np.ndarray | list[np.ndarray]"]


class ShardWriter:
    """Writes rows into shards of rows_per_file records and journals each committed shard."""

    def __init__(self, spec: PipelineSpec, out_dir: Path, *, resume: ResumePoint | None = None):
        self.out_dir = Path(out_dir)
        self.format = spec.output.format
        self.rows_per_file = spec.output.rows_per_file
        self.names = list(spec.outputs)
        _check_outputs(spec)
        self._shapes = {n: tuple(o.shape[1:]) for n, o in spec.outputs.items()}
        self._bf16 = {n: o.dtype == "bfloat16" for n, o in spec.outputs.items()}
        # Output dtype: the spec's, else the first array's, then fixed for the whole run.
        self._dtypes = {n: np.dtype("float32" if o.dtype == "bfloat16" else o.dtype)
                        for n, o in spec.outputs.items() if o.dtype is not None}
        self._pending: list[tuple[int, bytes]] = []  # rejects not yet in rejects.jsonl
        self._sink = None
        self._shard_rows = 0
        self._closed = False
        point = resume or ResumePoint(next_index=0, shard=0, rows=0, rejects=0, rejects_bytes=0)
        self._shard, self._rows, self._files = point.shard, point.rows, list(point.files)
        self._rejects, self._rejects_bytes = point.rejects, point.rejects_bytes
        self._last_index = point.next_index - 1
        self._committed_below = point.next_index  # rows/rejects below it are already committed
        self._batch_start = point.start
        if resume is None:
            check_fresh(self.out_dir)
        else:
            restore(self.out_dir, resume)

    @property
    def rows_written(self) -> int:
        return self._rows + self._shard_rows

    @property
    def rejects_written(self) -> int:
        return self._rejects + len(self._pending)

    def write(self, indices: np.ndarray, ids: list, outputs: Outputs,
              batch_start: int | None = None) -> None:
        """Real rows only: indices [n] increasing input ordinals, outputs name -> [n, ...].
        batch_start: the first input ordinal the batch covers (where a resume re-reads it)."""
        indices = np.asarray(indices, dtype=np.int64).reshape(-1)
        ids = list(ids)
        self._check_batch(indices, ids, outputs)
        if len(indices) and indices[0] < self._committed_below:  # re-read after a resume
            keep = int(np.searchsorted(indices, self._committed_below))
            indices, ids = indices[keep:], ids[keep:]
            outputs = {k: v[keep:] for k, v in outputs.items()}
        if len(indices) == 0:
            return
        if indices[0] <= self._last_index:
            raise ValueError(f"indices must increase past {self._last_index} "
                             f"(got {indices[:5].tolist()}...)")
        self._batch_start = int(indices[0]) if batch_start is None else int(batch_start)
        # Rejects below this batch can no longer fall after any future shard's next_index.
        self._flush_rejects(below=int(indices[0]), durable=False)
        outputs = {name: self._cast(name, outputs[name]) for name in self.names}
        start = 0
        while start < len(indices):
            stop = min(len(indices), start + self.rows_per_file - self._shard_rows)
            if self._sink is None:
                self._sink = self._open_sink()
            self._sink.add(ids[start:stop], {k: v[start:stop] for k, v in outputs.items()})
            self._shard_rows += stop - start
            self._last_index = int(indices[stop - 1])
            start = stop
            if self._shard_rows == self.rows_per_file:
                self._commit()

    def reject(self, index: int, id, where: str, reason: str) -> None:
        if self._closed:
            raise ValueError("reject() after close()")
        if index < self._committed_below:  # re-read after a resume: committed already
            return
        line = json.dumps({"index": int(index), "id": _plain(id), "where": where,
                           "reason": reason})
        self._pending.append((int(index), (line + "\n").encode()))

    def close(self, *, partial: bool = True) -> list[FileInfo]:
        """Commit the last partial shard and every reject; return all committed files.

        partial=False (an interrupted run) commits only complete shards and the rejects below
        them: the partial shard is dropped, so --resume writes the same shards as a run that
        was never interrupted."""
        if not self._closed:
            if self._shard_rows and partial:
                self._commit()
            elif self._sink is not None:
                self._sink.abort()
                self._sink, self._shard_rows = None, 0
            self._flush_rejects(below=None if partial else self._committed_below, durable=True)
            self._pending = []
            fsync_dir(self.out_dir)
            self._closed = True
        return list(self._files)

    # --- shards ---

    def _open_sink(self):
        stem = f"part-{self._shard:05d}"
        if self.format == "npy":
            return _NpySink(self.out_dir, stem, self.rows_per_file, self._shapes)
        if self.format == "jsonl":
            return _JsonlSink(self.out_dir, stem)
        return _ParquetSink(self.out_dir, stem)

    def _commit(self) -> None:
        # Order matters for a crash at any point: files in place, then rejects, then journal.
        infos = [self._place(tmp, name) for tmp, name in self._sink.finish()]
        next_index = self._last_index + 1
        self._flush_rejects(below=next_index, durable=True)
        fsync_dir(self.out_dir)  # the renames, and rejects.jsonl if it was just created
        self._rows += self._shard_rows
        append_journal(self.out_dir, self._shard, infos, self._rows, next_index,
                       self._rejects_bytes, self._rejects, self._batch_start)
        self._files += infos
        self._shard += 1
        self._committed_below = next_index
        self._shard_rows = 0
        self._sink = None

    def _place(self, tmp: Path, name: str) -> FileInfo:
        info = FileInfo(name, self._shard_rows, sha256_file(tmp), tmp.stat().st_size)
        os.replace(tmp, self.out_dir / name)
        return info

    def _flush_rejects(self, below: int | None, durable: bool) -> None:
        """Append pending rejects with index < below (all when None), in index order."""
        ready = sorted((r for r in self._pending if below is None or r[0] < below),
                       key=lambda r: r[0])
        self._pending = [r for r in self._pending if below is not None and r[0] >= below]
        data = b"".join(line for _, line in ready)
        path = self.out_dir / REJECTS
        if data or (durable and path.exists()):
            with open(path, "ab") as f:
                f.write(data)
                if durable:  # also makes earlier non-durable appends durable
                    f.flush()
                    os.fsync(f.fileno())
        self._rejects += len(ready)
        self._rejects_bytes += len(data)

    # --- rows ---

    def _check_batch(self, indices: np.ndarray, ids: list, outputs: Outputs) -> None:
        if self._closed:
            raise ValueError("write() after close()")
        n = len(indices)
        if set(outputs) != set(self.names):
            raise ValueError(f"outputs {sorted(outputs)} do not match the spec's {self.names}")
        lengths = {name: len(v) for name, v in outputs.items()}
        if len(ids) != n or any(k != n for k in lengths.values()):
            raise ValueError(f"{n} indices, {len(ids)} ids and output lengths {lengths} differ")
        if n and np.any(np.diff(indices) <= 0):
            raise ValueError(f"indices must increase (got {indices[:5].tolist()}...)")

    def _cast(self, name: str, value) -> np.ndarray | list[np.ndarray]:
        if isinstance(value, np.ndarray):
            return self._cast_one(name, value)
        return [self._cast_one(name, np.asarray(v)) for v in value]

    def _cast_one(self, name: str, a: np.ndarray) -> np.ndarray:
        a = a.astype(self._dtypes.setdefault(name, a.dtype), copy=False)
        return _round_bfloat16(a) if self._bf16[name] else a


def _check_outputs(spec: PipelineSpec) -> None:
    """Refuse output names and shapes the chosen format cannot store."""
    fmt = spec.output.format
    for name, out in spec.outputs.items():
        ragged = any(isinstance(d, str) and d != BATCH for d in out.shape[1:])
        if fmt == "npy" and ragged:
            raise OutputError(f"output {name!r} has shape {out.shape}: npy cannot hold ragged "
                              "outputs; use format jsonl or parquet")
        if fmt == "npy" and (name == "ids" or not SAFE_NAME.fullmatch(name)):
            raise OutputError(f"output {name!r} cannot name an npy file (ids is taken; use "
                              "letters, digits, _ . -)")
        if fmt != "npy" and name == "id":
            raise OutputError(f"output 'id' clashes with the record id in {fmt}; rename it")


def _round_bfloat16(a: np.ndarray) -> np.ndarray:
    """float32 -> nearest bfloat16 (ties to even), kept as float32; NaN stays NaN."""
    bits = np.ascontiguousarray(a).view(np.uint32)
    rounded = ((bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000).view(np.float32)
    return np.where(np.isnan(a), a, rounded)


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


def _close_durably(f) -> None:
    f.flush()
    os.fsync(f.fileno())
    f.close()


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
            ids = np.array(self.ids, dtype=np.int64) if _all_ints(self.ids) else \
                np.array([str(x) for x in self.ids])
            np.save(f, ids, allow_pickle=False)
            f.flush()
            os.fsync(f.fileno())
        placed = [(ids_tmp, f"{self.stem}.ids.npy")]
        for name, (f, dtype, length) in self.files.items():
            f.seek(0)
            f.write(_npy_header(dtype, (len(self.ids), *self.shapes[name]), length))
            _close_durably(f)
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
        _close_durably(self.f)
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
        fd = os.open(self.tmp, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
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
