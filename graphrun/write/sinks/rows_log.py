"""What a sink keeps beside an open shard's temp files, to reopen them after a crash: the ids
of its rows (npy keeps them in memory until the shard is finished) or the rows themselves
(parquet: a file without its footer cannot be read back). Appended at each checkpoint, never
rewritten, so the bytes an open journal line committed stay as they were; named
`.part-00000.<suffix>.rows.tmp` (journal.shard_number) and deleted when the shard is finished.
"""

from __future__ import annotations

import io
import json
import os
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from graphrun.base.nofollow import open_file
from graphrun.write.sinks.ids import plain

if TYPE_CHECKING:  # imported where a parquet shard's rows are logged: npy's ids need no pyarrow
    import pyarrow as pa


def log_path(out_dir: Path, stem: str, suffix: str) -> Path:
    return out_dir / f".{stem}.{suffix}.rows.tmp"


class _Log:
    def __init__(self, path: Path):
        self.path = path
        self._f = None
        self.count = 0  # rows appended (or found on reopening)

    def _file(self):
        if self._f is None:
            self._f = open_file(self.path, "ab")
        return self._f

    def size(self) -> int:
        """Bytes appended so far, all of them handed to the file (for a commit's fsync)."""
        if self._f is None:
            return self.path.stat().st_size if self.path.exists() else 0
        self._f.flush()
        return os.fstat(self._f.fileno()).st_size

    def close(self) -> None:
        f, self._f = self._f, None
        if f is not None:
            f.close()

    def remove(self) -> None:
        self.close()
        self.path.unlink(missing_ok=True)


class IdsLog(_Log):
    """Ids, one JSON value a line."""

    def append(self, ids: list) -> None:
        if ids:
            self._file().write("".join(json.dumps(plain(x)) + "\n" for x in ids).encode())
            self.count += len(ids)

    def read(self) -> list:
        ids = [json.loads(line) for line in self.path.read_bytes().splitlines()]
        self.count = len(ids)
        return ids


class RowsLog(_Log):
    """A parquet shard's rows in frames, each a kind byte, its length (8 bytes) and its body:
    b"G" a row group as written (its Arrow table, as an IPC stream: the buffers copied, not
    encoded), b"R" rows still buffered at a checkpoint (rows_frame: the records as the sink
    holds them, which the row groups' cut depends on).

    Row groups are written on a thread of the log's own, a few at most waiting, so that the
    stream's thread does not copy every row a second time; a write's error is raised by the
    next append or size()."""

    WAITING = 2  # row groups held for the log's thread at most

    def __init__(self, path: Path):
        super().__init__(path)
        self._thread: ThreadPoolExecutor | None = None
        self._waiting: deque[Future] = deque()

    def append_group(self, table: pa.Table) -> None:
        self._settle(self.WAITING - 1)
        if self._thread is None:
            self._thread = ThreadPoolExecutor(1, thread_name_prefix="graphrun-rows-log")
        self._waiting.append(self._thread.submit(self._write_group, table))

    def _write_group(self, table: pa.Table) -> None:
        import pyarrow as pa

        out = pa.BufferOutputStream()
        with pa.ipc.new_stream(out, table.schema) as stream:
            stream.write_table(table)
        self._frame(b"G", out.getvalue())

    def append_rows(self, ids: list, records: dict[str, list]) -> None:
        self._settle(0)
        if ids:
            body = io.BytesIO()
            rows_frame(body, ids, records)
            self._frame(b"R", body.getbuffer())

    def size(self) -> int:
        self._settle(0)
        return super().size()

    def _settle(self, keep: int) -> None:
        while len(self._waiting) > keep:
            self._waiting.popleft().result()

    def close(self) -> None:
        """Once its row groups are written (a failed one is the writer's to report)."""
        for future in self._waiting:
            future.exception()
        self._waiting.clear()
        if self._thread is not None:
            self._thread.shutdown()
            self._thread = None
        super().close()

    def _frame(self, kind: bytes, body) -> None:
        f = self._file()
        f.write(kind + len(body).to_bytes(8, "little"))
        f.write(body)

    def read(self):
        """("group", table) and ("rows", ids, {name: records}) in the order they came."""
        import pyarrow as pa

        with open(self.path, "rb") as f:
            while head := f.read(9):
                body = f.read(int.from_bytes(head[1:], "little"))
                if head[:1] == b"G":
                    yield "group", pa.ipc.open_stream(body).read_all()
                else:
                    yield ("rows", *read_rows_frame(io.BytesIO(body)))


def rows_frame(f, ids: list, records: dict[str, list]) -> None:
    """A JSON head (ids, output names, dtypes), then per output the records' shapes
    [n, ndim] and their values, flat (np.save each: records of one output may differ in
    shape, and text records in width)."""
    arrays = {name: [np.asarray(r) for r in rs] for name, rs in records.items()}
    dtypes = {}
    for name, rs in arrays.items():
        kinds = [a.dtype.str for a in rs]
        dtypes[name] = kinds[0] if len(set(kinds)) == 1 else kinds
    head = {"ids": [plain(x) for x in ids], "names": list(arrays), "dtypes": dtypes}
    np.save(f, np.frombuffer(json.dumps(head).encode(), np.uint8), allow_pickle=False)
    for rs in arrays.values():
        np.save(f, np.array([a.shape for a in rs], np.int64).reshape(len(rs), rs[0].ndim),
                allow_pickle=False)
        np.save(f, np.concatenate([a.ravel() for a in rs]), allow_pickle=False)


def read_rows_frame(f) -> tuple[list, dict[str, list]]:
    """rows_frame's ids and records: numpy scalars for a [batch] output, arrays otherwise."""
    head = json.loads(np.load(f, allow_pickle=False).tobytes())
    records = {}
    for name in head["names"]:
        shapes, values = np.load(f, allow_pickle=False), np.load(f, allow_pickle=False)
        kinds = head["dtypes"][name]
        kinds = kinds if isinstance(kinds, list) else [kinds] * len(shapes)
        ends = np.cumsum([int(np.prod(s)) for s in shapes])
        records[name] = [
            piece.astype(kind).reshape(shape) if len(shape) else piece.astype(kind)[0]
            for piece, shape, kind in zip(np.split(values, ends[:-1]), map(tuple, shapes),
                                          kinds)]
    return head["ids"], records
