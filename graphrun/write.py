"""The write step: output shards, rejects, and the journal that makes a run resumable.

Shards hold `output.rows_per_file` records each (the last one fewer), numbered from 00000, in
the files sinks.py lists per format.

A shard is written as `.part-00000.<suffix>.tmp`, fsynced and renamed into place when full, and
only then journaled (journal.py), so a crash leaves committed shards plus temp files that a
resume deletes. bfloat16 outputs are stored as float32 holding bfloat16-rounded values (numpy,
npy and parquet have no bfloat16). Memory is the sink's: see sinks.py.

Rejects must reach reject() before write() is given any row with a larger ordinal: a shard's
commit writes the rejects below its next_index, and a resume starts reading there.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import numpy as np

from graphrun.errors import OutputError
from graphrun.journal import (REJECTS, FileInfo, ResumePoint, append_journal, check_fresh,
                              fsync_dir, prepare_out_dir, read_journal, restore, sha256_file)
from graphrun.sinks import Outputs, _JsonlSink, _NpySink, _ParquetSink, _plain
from graphrun.spec import BATCH, PipelineSpec

__all__ = ["ShardWriter", "FileInfo", "ResumePoint", "prepare_out_dir", "read_journal",
           "sha256_file"]

SAFE_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]*")


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
