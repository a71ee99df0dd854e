"""A shard's file hashed and sent to disk while it is still being written.

A shard's commit needs the file's sha256 and an fsync. Taken only once the shard is complete,
both read or flush the whole file after its last row: at the end of a run that is the time the
device sits idle after its last batch. RunningDigest hashes the file's bytes from its start as
they are written, and has the disk write them (fdatasync), a step at a time on the committer's
threads (never the writer's: a slow disk must not hold up the rows), so the commit hashes and
flushes only what came after the last step.
"""

from __future__ import annotations

import hashlib
import os
from concurrent.futures import Executor, Future
from pathlib import Path

CHUNK = 4 << 20  # bytes hashed per call (hashlib lets go of the GIL for each)
_datasync = getattr(os, "fdatasync", os.fsync)  # macOS has no fdatasync


class RunningDigest:
    """The sha256 of a file written from offset 0 onwards, whose first bytes never change
    after they are written. written() is called by the one thread that writes the file; hash
    steps run on `hashers` and flushes on `syncers`, one of each at a time; result() (another
    thread, once writing is done) hashes the rest and returns the hex digest."""

    def __init__(self, path: Path, hashers: Executor, syncers: Executor, step: int):
        self.path, self.hashers, self.syncers = path, hashers, syncers
        self.step = step  # bytes written between two steps (Tuning.hash_step_bytes)
        self._hash = hashlib.sha256()
        self._done = 0  # bytes hashed
        self._asked = self._synced = 0  # bytes the last hash step and flush were asked for
        self._future: Future | None = None
        self._sync: Future | None = None
        self._fd: int | None = None

    @property
    def started(self) -> bool:
        """Whether a step was started (else result() would only hash the file whole)."""
        return self._asked > 0

    def written(self, end: int) -> None:
        """Bytes [0, end) are in the file: start a step if enough came since the last one and
        none is running."""
        if end - self._asked >= self.step and not _running(self._future):
            self._asked = end
            self._future = self.hashers.submit(self._advance, end)
        if end - self._synced >= self.step and not _running(self._sync):
            self._synced = end
            self._sync = self.syncers.submit(_datasync_path, self.path)

    def result(self) -> str:
        """The whole file's sha256 (its writing finished): the running step awaited, the rest
        read. Raises what a step raised (the disk's error)."""
        try:
            self._wait()
            self._advance(None)
            return self._hash.hexdigest()
        finally:
            self.close()

    def close(self) -> None:
        """Drop it (the file changed where it was hashed, or is deleted): the step awaited, its
        descriptor closed."""
        try:
            self._wait()
        except OSError:
            pass  # the file is not committed: the error is the writer's to report
        finally:
            fd, self._fd = self._fd, None
            if fd is not None:
                os.close(fd)

    def _wait(self) -> None:
        futures, self._future, self._sync = (self._future, self._sync), None, None
        for future in futures:
            if future is not None:
                future.result()

    def _advance(self, end: int | None) -> None:
        """Hash bytes up to `end` (None: to the end of the file) and flush them to disk."""
        if self._fd is None:
            self._fd = os.open(self.path, os.O_RDONLY)
        while end is None or self._done < end:
            want = CHUNK if end is None else min(CHUNK, end - self._done)
            data = os.pread(self._fd, want, self._done)
            if not data:
                break
            self._hash.update(data)
            self._done += len(data)


def _running(future: Future | None) -> bool:
    return future is not None and not future.done()


def _datasync_path(path: Path) -> None:
    """The file's data written to disk (the commit's fsync then waits for the rest only)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        _datasync(fd)
    finally:
        os.close(fd)
