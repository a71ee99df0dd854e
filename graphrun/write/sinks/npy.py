"""npy shards: part-00000.ids.npy (int64 when every id is an int, else unicode) and
part-00000.<output>.npy per output, [rows, ...] in the output dtype."""

from __future__ import annotations

import os
import re
import struct
from collections import deque
from concurrent.futures import Executor, Future
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np

from graphrun.base.errors import OutputError
from graphrun.write.ahead import RunningDigest
from graphrun.write.sinks.ids import Ids
from graphrun.write.sinks.rows_log import IdsLog, log_path
from graphrun.spec.keys import BATCH
from graphrun.base.tuning import Tuning
from graphrun.base.nofollow import open_fd, open_file

SAFE_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]*")


def npy_header(dtype: np.dtype, shape: tuple, length: int | None = None) -> bytes:
    """A version 1.0 .npy header, space-padded to `length` bytes (default: a multiple of 64)."""
    text = f"{{'descr': {dtype.str!r}, 'fortran_order': False, 'shape': {shape!r}, }}"
    body = text.encode("latin1")
    length = length or -(-(10 + len(body) + 1) // 64) * 64
    return (b"\x93NUMPY\x01\x00" + struct.pack("<H", length - 10) + body
            + b" " * (length - 11 - len(body)) + b"\n")


def pwrite_all(fd: int, data, offset: int) -> None:
    """Write all of `data` at `offset` (pwrite may write less than asked)."""
    view = memoryview(data)
    while view:
        n = os.pwrite(fd, view, offset)
        view, offset = view[n:], offset + n


@dataclass
class RowFile:
    """One output's temp file of a shard: rows are appended at `end`."""

    fd: int
    path: Path
    dtype: np.dtype
    header_bytes: int
    end: int
    digest: RunningDigest | None = None  # hashed as it is written (a writer pool's steps)

    def close(self) -> None:
        """Once: a second close (abort after finish) must not close a descriptor number the
        process has since given to another file."""
        fd, self.fd = self.fd, -1
        if fd >= 0:
            os.close(fd)


class NpySink:
    """Rows go straight to one temp file per output, behind a header sized for a full shard
    and rewritten with the real row count at the end; ids are kept until then.

    Rows are written at their own offset (pwrite). Big batches (a decoder's logits) go to the
    writer's row pool, a few threads writing at once: one thread's page-cache copies are slower
    than a GPU makes logits. Each batch's rows stay referenced until written, at most
    tuning.row_pool_pending batches; a write's error is raised by the next add() or finish().
    Small batches are written on the caller's thread. Given the committer's threads (ahead:
    hashers, syncers), each file is also hashed and flushed as it grows (ahead.RunningDigest):
    `digests` hands that to the committer for a full shard, whose header never changes.

    checkpoint() appends the ids added since the last one to an IdsLog: the files' first bytes
    and that log are then the shard so far, and rows= reopens them."""

    suffix = ".npy"
    uses_row_pool = True
    hashes_ahead = True

    def __init__(self, out_dir: Path, stem: str, rows_per_file: int, shapes: dict,
                 tuning: Tuning, pool: Executor | None = None,
                 ahead: tuple[Executor, Executor] | None = None, rows: int = 0,
                 pwrite: Callable[[int, object, int], None] = pwrite_all):
        self.out_dir, self.stem = out_dir, stem
        self.pwrite = pwrite  # rows and headers at their offsets (the writer's DiskSteps)
        self.rows_per_file, self.shapes = rows_per_file, shapes
        self.tuning, self.pool, self.ahead = tuning, pool, ahead
        self.ids = Ids()
        self.files: dict[str, RowFile] = {}
        self._pending: deque[tuple[Future, RowFile, int]] = deque()  # (write, file, offset)
        self.digests: dict[Path, RunningDigest] = {}  # temp path -> its running sha256
        self.error: BaseException | None = None  # a failed write: this shard is never finished
        self.ids_log = IdsLog(log_path(out_dir, stem, "ids.npy"))
        self.logs = [self.ids_log.path]
        if rows:  # an open shard's temp files, cut back to its committed rows
            self.ids.add(self.ids_log.read())
            self.files = {name: self._reopen(name) for name in shapes}

    @staticmethod
    def check(outputs: dict) -> None:
        """Refuse outputs npy files cannot hold."""
        for name, out in outputs.items():
            if any(isinstance(d, str) and d != BATCH for d in out.shape[1:]):
                raise OutputError(f"output {name!r} has shape {out.shape}: npy cannot hold "
                                  "ragged outputs; use format jsonl or parquet")
            if name == "ids" or not SAFE_NAME.fullmatch(name):
                raise OutputError(f"output {name!r} cannot name an npy file (ids is taken; "
                                  "use letters, digits, _ . -)")

    def add(self, ids, outputs: dict) -> None:
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
            pooled = self.pool is not None and len(data) >= self.tuning.row_pool_bytes
            while self._pending and (self._pending[0][0].done() or (
                    pooled and len(self._pending) >= self.tuning.row_pool_pending)):
                self._settle(self._pending.popleft()[0].result)
            if pooled:
                self._pending.append((self.pool.submit(self.pwrite, f.fd, data, offset), f,
                                      offset))
            else:
                self._settle(self.pwrite, f.fd, data, offset)
            if f.digest is not None:
                # hashed up to the first byte a pool thread may still be writing
                f.digest.written(min((o for _, g, o in self._pending if g is f), default=f.end))

    def _settle(self, call, *args) -> None:
        """Run a write (or wait for one); a failure is kept: the shard has a hole."""
        try:
            call(*args)
        except BaseException as exc:
            self.error = self.error or exc
            raise

    def _open(self, name: str, dtype: np.dtype) -> RowFile:
        path = self.out_dir / f".{self.stem}.{name}.npy.tmp"
        fd = open_fd(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
        header = npy_header(dtype, (self.rows_per_file, *self.shapes[name]))
        self.pwrite(fd, header, 0)
        digest = (RunningDigest(path, *self.ahead, self.tuning.hash_step_bytes)
                  if self.ahead is not None else None)
        return RowFile(fd, path, dtype, len(header), len(header), digest)

    def _reopen(self, name: str) -> RowFile:
        path = self.out_dir / f".{self.stem}.{name}.npy.tmp"
        with open(path, "rb") as f:
            np.lib.format.read_magic(f)
            dtype = np.lib.format.read_array_header_1_0(f)[2]
            header_bytes = f.tell()
        fd = open_fd(path, os.O_WRONLY)
        digest = (RunningDigest(path, *self.ahead, self.tuning.hash_step_bytes)
                  if self.ahead is not None else None)
        return RowFile(fd, path, dtype, header_bytes, os.fstat(fd).st_size, digest)

    def checkpoint(self) -> list[tuple[Path, int]]:
        """The rows so far made resumable: (temp file, bytes holding them) to commit."""
        self._wait()
        self.ids_log.append(self.ids.values()[self.ids_log.count:])
        return [(self.ids_log.path, self.ids_log.size())] + [
            (f.path, f.end) for f in self.files.values()]

    def _wait(self) -> None:
        while self._pending:
            self._settle(self._pending.popleft()[0].result)
        if self.error is not None:
            raise self.error

    def abort(self) -> None:
        self.leave()
        for f in self.files.values():
            f.path.unlink(missing_ok=True)
        self.ids_log.remove()

    def leave(self) -> None:
        """Close the files, kept as they are (an open journal line committed their start)."""
        try:
            for future, _, _ in self._pending:  # let no thread write into a closed descriptor
                future.exception()
        finally:
            self._pending.clear()
            for f in self.files.values():
                if f.digest is not None:
                    f.digest.close()
                f.close()
            self.ids_log.close()

    def finish(self) -> list[tuple[Path, str]]:
        self._wait()
        self.ids_log.close()  # the ids go into the shard's own ids file
        ids_tmp = self.out_dir / f".{self.stem}.ids.npy.tmp"
        with open_file(ids_tmp, "wb") as f:
            np.save(f, self.ids.array(), allow_pickle=False)
        placed = [(ids_tmp, f"{self.stem}.ids.npy")]
        for name, f in self.files.items():
            header = npy_header(f.dtype, (len(self.ids), *self.shapes[name]), f.header_bytes)
            self.pwrite(f.fd, header, 0)
            f.close()
            placed.append((f.path, f"{self.stem}.{name}.npy"))
            if f.digest is None:
                continue
            if f.digest.started and len(self.ids) == self.rows_per_file:
                self.digests[f.path] = f.digest  # the header it hashed is the one written
            else:  # a short shard's header changed, or nothing was hashed: whole at commit
                f.digest.close()
        return placed
