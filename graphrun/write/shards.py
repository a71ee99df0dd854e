"""The write step: output shards, rejects, and the journal that makes a run resumable.

Shards hold `output.rows_per_file` records each (the last one fewer), numbered from 00000, in
the files each format's sink lists (sinks/).

A shard is written as `.part-00000.<suffix>.tmp`; when it is full the writer hands it to a
committer and writes on into the next one. The committer hashes, fsyncs and renames it into
place, and only then journals it (journal.py), in shard order; so a crash leaves committed
shards plus temp files (or renamed but unjournaled shards) that a resume deletes.

So that a crash or a signal loses at most output.commit_interval_s of rows, a shard still
open that long after the last commit is committed as it stands, at the end of a write(): its
sink makes the rows so far resumable from its temp files (checkpoint()), and the committer
fsyncs them and journals an open line with their sizes and sha256. The shard stays open; a
resume cuts its temp files back to those sizes and reopens them, so every shard still holds
output.rows_per_file rows and a resumed run writes the same files as one never interrupted.
An interrupted run (close(partial=False)) commits its open shard so, losing nothing written.

bfloat16 outputs are stored as float32 holding bfloat16-rounded values (numpy, npy and parquet
have no bfloat16). Memory is the sink's: see sinks/.

Rejects must reach reject() before write() is given any row with a larger ordinal: a shard's
commit covers the rejects below its next_index, and a resume starts reading there.
"""

from __future__ import annotations

import os
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import numpy as np

from graphrun.base.errors import OutputError
from graphrun.write.disk import write_failure, write_remedy
from graphrun.write.folder import prepare_out_dir
from graphrun.write.journal import (REJECTS, FileInfo, PrefixDigest, ResumePoint, ShardPlace,
                                    append_journal, check_fresh, fsync_path, read_journal,
                                    reject_line, restore, sha256_file)
from graphrun.write.guard import rejects_sha256
from graphrun.write.sinks import Outputs, shard_suffixes, sink_for
from graphrun.write.sinks.ids import plain
from graphrun.write.sinks.npy import pwrite_all
from graphrun.spec.keys import PipelineSpec
from graphrun.base.tuning import Tuning
from graphrun.base.nofollow import open_file

__all__ = ["ShardWriter", "DiskSteps", "FileInfo", "ResumePoint", "prepare_out_dir",
           "read_journal", "sha256_file"]


@dataclass(frozen=True)
class DiskSteps:
    """What the writer and its committer do to the disk, each with its default's signature;
    a caller (a test) hands in its own to stage an order of commits or a fault."""

    fsync: Callable[[Path], None] = fsync_path  # a file's or a folder's
    sha256: Callable[[Path], str] = sha256_file  # a whole temp file's, at its commit
    append_journal: Callable[..., str] = append_journal  # a shard's line, after its files
    open_rejects: Callable = open_file  # rejects.jsonl, for appending
    # an npy shard's rows and headers, at their offsets (a sink that uses the row pool)
    pwrite: Callable[[int, object, int], None] = pwrite_all

class ShardWriter:
    """Writes rows into shards of rows_per_file records and journals each committed shard.

    Used from one thread; only the committer's work runs on others. An error there (a full
    disk) is raised by the next write(), reject() or close()."""

    def __init__(self, spec: PipelineSpec, out_dir: Path, *, resume: ResumePoint | None = None,
                 tuning: Tuning | None = None, place: ShardPlace | None = None,
                 disk: DiskSteps | None = None):
        """place: a worker's (scale/): its shards go into the job's folder, numbered in its
        range; out_dir keeps its journal and rejects. disk: its steps on the disk (DiskSteps)."""
        self.out_dir = Path(out_dir)
        self.disk = disk or DiskSteps()
        self.shard_dir = place.folder if place else self.out_dir
        self.tuning = tuning or Tuning.from_machine()
        self.sink_type = sink_for(spec)
        # a format whose shards hold the rejected records' lines too (openai_batch's error
        # lines), in input order among the rows: rejects not yet in a shard
        self._to_sink: list[tuple[int, object, str, str]] = []
        self.rows_per_file = spec.output.rows_per_file
        self.commit_interval_s = spec.output.commit_interval_s
        self.names = list(spec.outputs)
        self.sink_type.check(spec.outputs)
        self._shapes = {n: tuple(o.shape[1:]) for n, o in spec.outputs.items()}
        self._bf16 = {n: o.dtype == "bfloat16" for n, o in spec.outputs.items()}
        # Output dtype: the spec's, else the first array's, then fixed for the whole run.
        self._dtypes = {n: np.dtype("float32" if o.dtype == "bfloat16" else o.dtype)
                        for n, o in spec.outputs.items() if o.dtype is not None}
        self._pending: list[tuple[int, bytes]] = []  # rejects not yet in rejects.jsonl
        # rejects.jsonl, opened for appending at the first reject written and kept open until
        # close(): opening it for every batch with a reject cost ~20 us of the writer's thread
        self._rejects_file = None
        self._sink = None
        self._row_pool: ThreadPoolExecutor | None = None  # npy rows of big batches
        self._sink_failed = False  # a write into the open shard failed
        self._rejects_failed = False  # an append to rejects.jsonl failed: no later shard commits
        self._shard_rows = 0
        self._open_rows = 0  # rows of the open shard that an open line committed
        self._closed = False
        self._reported = False  # a commit error was raised to the caller already
        # Called before a shard goes to the committer (so before its journal line): what
        # must be on disk by then, latencies.jsonl's lines (latencies.py).
        self.on_hand_over = None
        point = resume or ResumePoint(next_index=0, shard=place.first if place else 0, rows=0,
                                      rejects=0, rejects_bytes=0)
        # Counted up to the last shard handed to the committer (rejects: appended to the file).
        self._shard, self._rows = point.shard, point.rows
        self._rejects, self._rejects_bytes = point.rejects, point.rejects_bytes
        self._last_index = point.next_index - 1
        self._committed_below = point.next_index  # rows/rejects below it are handed over
        self._batch_start = point.start
        self.suffixes = shard_suffixes(spec.output.format, self.names)
        if place is not None:  # the job's folder was checked: its range is this worker's
            restore(self.out_dir, point, self.suffixes, place)
        elif resume is None:
            check_fresh(self.out_dir, self.suffixes)
        else:
            restore(self.out_dir, resume, self.suffixes)
        self._rejects_hash = rejects_sha256(self.out_dir / REJECTS, point.rejects_bytes)  # so far
        self._committer = _Committer(self.out_dir, point, self.tuning, self.shard_dir,
                                     self.disk)
        if point.open is not None:  # the shard an open line committed: written on
            self._rows -= point.open.rows
            self._sink = self._open_sink(rows=point.open.rows)
            self._shard_rows = self._open_rows = point.open.rows
        self._last_commit = time.monotonic()

    @property
    def rows_written(self) -> int:
        return self._rows + self._shard_rows

    @property
    def rejects_written(self) -> int:
        return self._rejects + len(self._pending)

    def write(self, indices: np.ndarray, ids: np.ndarray | list, outputs: Outputs,
              batch_start: int | None = None) -> None:
        """Real rows only: indices [n] increasing input ordinals, ids [n] (an int64 array, as
        the reader gives ordinals and integer ids, is kept as one: no Python int per row),
        outputs name -> [n, ...]. batch_start: the first input ordinal the batch covers (where
        a resume re-reads it)."""
        indices = np.asarray(indices, dtype=np.int64).reshape(-1)
        ids = ids.reshape(-1) if isinstance(ids, np.ndarray) else list(ids)
        self._check_batch(indices, ids, outputs)
        self._raise_commit_error()
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
        self._flush_rejects(below=int(indices[0]))
        outputs = {name: self._cast(name, outputs[name]) for name in self.names}
        start = 0
        while start < len(indices):
            stop = min(len(indices), start + self.rows_per_file - self._shard_rows)
            if self._to_sink:  # the rejects before this row, then the rows up to the next
                self._rejects_into_shard(below=int(indices[start]))
                if self._to_sink:
                    after = min(r[0] for r in self._to_sink)
                    stop = start + max(1, int(np.searchsorted(indices[start:stop], after)))
            if self._sink is None:
                self._sink = self._open_sink()
            try:
                self._sink.add(ids[start:stop], {k: v[start:stop] for k, v in outputs.items()})
            except BaseException:
                self._sink_failed = True  # rows may be missing from it: never commit it
                raise
            self._shard_rows += stop - start
            self._last_index = int(indices[stop - 1])
            start = stop
            if self._shard_rows == self.rows_per_file:
                self._hand_over()
        if (self._shard_rows > self._open_rows
                and time.monotonic() - self._last_commit >= self.commit_interval_s):
            self._commit_open()

    def reject(self, index: int, id, where: str, reason: str) -> None:
        if self._closed:
            raise ValueError("reject() after close()")
        self._raise_commit_error()
        if index < self._committed_below:  # re-read after a resume: committed already
            return
        line = reject_line(index, plain(id), where, reason)
        self._pending.append((int(index), (line + "\n").encode()))
        if getattr(self.sink_type, "takes_rejects", False):
            self._to_sink.append((int(index), id, where, reason))

    def wait_for_commits(self) -> None:
        """Block until every shard completed so far is journaled; raise a commit error. What
        a crash would leave now is then exactly the journal (tests use it to stage one)."""
        self._committer.wait()
        self._raise_commit_error()

    def close(self, *, partial: bool = True) -> list[FileInfo]:
        """Commit the last partial shard and every reject, wait for every commit; return all
        committed files.

        partial=False (an interrupted run) commits the partial shard as it stands, open (an
        open line), and the rejects below its last row: --resume writes it on, so it writes
        the same shards as a run that was never interrupted. After a failed commit nothing
        more is committed (the journal must stay in shard order): the counts and files are
        the journal's."""
        if self._closed:
            return self._committer.files()
        self._closed = True
        try:
            if self._committer.error is None and not self._rejects_failed:
                if partial and not self._sink_failed:
                    self._rejects_into_shard(below=None)
                if (self._shard_rows or self._sink is not None) and partial and not \
                        self._sink_failed:
                    self._hand_over()
                elif self._shard_rows > self._open_rows and not self._sink_failed:
                    self._commit_open()
                self._flush_rejects(below=None if partial else self._committed_below)
                self._pending = []  # partial=False: the rejects after it come again on resume
        finally:
            if self._sink is not None:
                if self._open_rows:  # an open line committed its temp files: kept for resume
                    self._sink.leave()
                else:
                    self._sink.abort()
                self._sink, self._shard_rows = None, self._open_rows
            if self._row_pool is not None:
                self._row_pool.shutdown()
            self._committer.close()
            if self._rejects_file is not None:
                self._rejects_file.close()
        if self._committer.error is not None or self._rejects_failed:
            self._rows, self._rejects = self._committer.rows, self._committer.rejects
            self._pending, self._shard_rows = [], 0
            self._raise_commit_error()
            return self._committer.files()
        if (self.out_dir / REJECTS).exists():
            self.disk.fsync(self.out_dir / REJECTS)  # the rejects after the last shard
        self.disk.fsync(self.out_dir)
        return self._committer.files()

    def committed_files(self) -> list[FileInfo]:
        """What the journal holds now (after a close() that failed, say)."""
        return self._committer.files()

    @property
    def committed_from(self) -> int:
        """The input ordinal a --resume would read from now (the last journal line's
        read_from): nothing below it is read again."""
        return self._committer.read_from

    # --- shards ---

    def _open_sink(self, rows: int = 0):
        """The shard's sink; rows: reopened on its temp files, which hold that many rows."""
        stem = f"part-{self._shard:05d}"
        given = {}
        if self.sink_type.uses_row_pool:
            if self._row_pool is None:  # threads start with the first shard, end at close()
                self._row_pool = ThreadPoolExecutor(self.tuning.row_writers,
                                                    thread_name_prefix="graphrun-rows")
            given["pwrite"] = self.disk.pwrite
        if self.sink_type.hashes_ahead:
            given["ahead"] = self._committer.ahead
        return self.sink_type(self.shard_dir, stem, self.rows_per_file, self._shapes,
                              self.tuning, self._row_pool, rows=rows, **given)

    def _commit_open(self) -> None:
        """Commit the open shard's rows so far (an open line); it stays open, written on."""
        next_index = self._last_index + 1
        try:
            files = self._sink.checkpoint()
            self._flush_rejects(below=next_index)
            if self.on_hand_over is not None:
                self.on_hand_over()
        except BaseException:  # (a full disk) the shard is never committed
            self._sink_failed = True
            raise
        self._committer.submit(_Shard(
            number=self._shard, files=[(path, path.name) for path, _ in files], digests={},
            rows=self._shard_rows, total_rows=self._rows + self._shard_rows,
            next_index=next_index, read_from=self._batch_start, rejects=self._rejects,
            rejects_bytes=self._rejects_bytes, rejects_sha256=self._rejects_hash.hexdigest(),
            sizes=[size for _, size in files]))
        self._committed_below = next_index
        self._open_rows = self._shard_rows
        self._last_commit = time.monotonic()

    def _hand_over(self) -> None:
        """Complete the shard's files and give them to the committer; writing goes on at once."""
        sink, self._sink = self._sink, None  # finished or failed, close() must not abort it
        next_index = self._last_index + 1
        if self._open_rows:
            # finish() may rewrite bytes an open line committed (a short npy shard's header):
            # the journal thread hashes that line's prefix first, as it stood at its commit
            self._committer.wait()
        try:
            files = sink.finish()
            # Its journal line counts the rejects below next_index: in the file before it is
            # journaled (the committer fsyncs them).
            self._flush_rejects(below=next_index)
            if self.on_hand_over is not None:
                self.on_hand_over()
        except BaseException:  # (a full disk) the shard is never committed, nor handed again
            self._sink_failed = True
            sink.abort()
            raise
        self._rows += self._shard_rows
        self._committer.submit(_Shard(
            number=self._shard, files=files, digests=getattr(sink, "digests", {}),
            logs=sink.logs,
            rows=self._shard_rows, total_rows=self._rows,
            next_index=next_index, read_from=self._batch_start, rejects=self._rejects,
            rejects_bytes=self._rejects_bytes, rejects_sha256=self._rejects_hash.hexdigest()))
        self._shard += 1
        self._committed_below = next_index
        self._shard_rows = self._open_rows = 0
        self._last_commit = time.monotonic()

    def _rejects_into_shard(self, below: int | None) -> None:
        """A sink that takes rejects: those below `below` (all when None) written into the
        open shard (one opened for them), in input order; the shard then covers them."""
        ready = sorted(r for r in self._to_sink if below is None or r[0] < below)
        if not ready:
            return
        self._to_sink = [r for r in self._to_sink if below is not None and r[0] >= below]
        if self._sink is None:
            self._sink = self._open_sink()
        try:
            for index, rid, where, reason in ready:
                self._sink.add_reject(rid, where, reason)
        except BaseException:
            self._sink_failed = True
            raise
        self._last_index = max(self._last_index, ready[-1][0])

    def _flush_rejects(self, below: int | None) -> None:
        """Append pending rejects with index < below (all when None), in index order. Not
        durable here: a shard's commit, or close(), fsyncs them; after a failed one, none is."""
        if not self._pending:
            return
        ready = sorted((r for r in self._pending if below is None or r[0] < below),
                       key=lambda r: r[0])
        self._pending = [r for r in self._pending if below is not None and r[0] >= below]
        data = b"".join(line for _, line in ready)
        if data:
            view = memoryview(data)
            try:
                if self._rejects_file is None:
                    self._rejects_file = self.disk.open_rejects(self.out_dir / REJECTS, "ab",
                                                                buffering=0)
                while view:  # all of it reaches the file before the caller goes on
                    view = view[self._rejects_file.write(view):]
            except BaseException:
                self._rejects_failed = True
                raise
            self._rejects_hash.update(data)
        self._rejects += len(ready)
        self._rejects_bytes += len(data)

    def _raise_commit_error(self) -> None:
        """A failed commit stops the run: raised by every write() and reject() after it, and
        by close() unless raised before (so that a failed run can still close and report)."""
        err = self._committer.error
        if err is None or (self._closed and self._reported):
            return
        self._reported = True
        if isinstance(err, OSError):  # the disk: full, gone, not writable
            raise OutputError(f"{write_failure(self.out_dir, err)}; "
                              f"{write_remedy(self.out_dir, err)}") from err
        raise err

    # --- rows ---

    def _check_batch(self, indices: np.ndarray, ids, outputs: Outputs) -> None:
        if self._closed:
            raise ValueError("write() after close()")
        n = len(indices)
        if set(outputs) != set(self.names):
            raise ValueError(f"outputs {sorted(outputs)} do not match the spec's {self.names}")
        lengths = {name: len(v) for name, v in outputs.items()}
        if len(ids) != n or any(k != n for k in lengths.values()):
            raise ValueError(f"{n} indices, {len(ids)} ids and output lengths {lengths} differ")
        if n > 1 and not (indices[1:] > indices[:-1]).all():
            raise ValueError(f"indices must increase (got {indices[:5].tolist()}...)")

    def _cast(self, name: str, value) -> np.ndarray | list[np.ndarray]:
        if isinstance(value, np.ndarray):
            return self._cast_one(name, value)
        return [self._cast_one(name, np.asarray(v)) for v in value]

    def _cast_one(self, name: str, a: np.ndarray) -> np.ndarray:
        if a.dtype.kind in "US":  # text: a cast to the first batch's width would cut it
            return a
        a = a.astype(self._dtypes.setdefault(name, a.dtype), copy=False)
        return _round_bfloat16(a) if self._bf16[name] else a


@dataclass(frozen=True)
class _Shard:
    """A complete shard handed to the committer, and what its journal line will say."""

    number: int
    files: list[tuple[Path, str]]  # (temp path, final name): complete, not yet durable
    digests: dict  # temp path -> the sink's ahead.RunningDigest of it, where it kept one
    rows: int  # in this shard
    total_rows: int  # in the run once it is committed
    next_index: int
    read_from: int
    rejects: int  # lines and bytes of rejects.jsonl below next_index, already appended
    rejects_bytes: int
    rejects_sha256: str
    sizes: list[int] | None = None  # an open line's: the bytes of each file it commits
    logs: list[Path] = field(default_factory=list)  # the sink's checkpoint logs: removed


class _Committer:
    """Commits the shards that the writer hands over, off the writer's thread.

    Per file of a shard, at once: an fsync on one of the in_flight sync threads (it waits on
    the disk) and a sha256 on one of the hashers threads (it re-reads the file from the page
    cache, on a CPU, or finishes the digest the sink kept as it wrote: ahead.py), so neither
    the disk nor the CPUs idle while the other works, and later shards proceed while earlier
    ones finish. On the one journal thread, strictly in shard
    order: wait for the shard's fsyncs and hashes, rename its files into place, fsync
    rejects.jsonl (the writer appended the rejects below the shard's next_index before handing
    it over), fsync the folder (the renames and new names), append the journal line. So a line
    is written only after its shard's files and rejects are durable and after every earlier
    line: after a crash the journal lists a prefix of the shards, each intact, as when commits
    ran on the writer's thread. After a failure no later shard is renamed or journaled.

    Shared with the writer's thread, under _lock: how many shards were handed over and how
    many settled (journaled, or dropped after a failure), the first error, and what the
    journal holds (files, rows, rejects).

    An open shard's line (sizes given) is committed on the journal thread alone: its temp
    files fsynced and the sha256 of their first bytes taken (read on from the last open
    line's, PrefixDigest), nothing renamed."""

    def __init__(self, out_dir: Path, point: ResumePoint, tuning: Tuning, shard_dir: Path,
                 disk: DiskSteps):
        self.out_dir, self.shard_dir = out_dir, shard_dir  # journal and rejects; shards
        self.disk = disk
        self.in_flight = tuning.in_flight
        self._lock = threading.Condition()
        self._handed = self._settled = 0
        self.error: BaseException | None = None
        self._files, self.rows, self.rejects = list(point.files), point.rows, point.rejects
        self.read_from = point.start  # the last journal line's: where a --resume reads from
        self._digest = point.digest  # the journal's last line's checksum (journal thread only)
        # Threads start at the first shard and end at close().
        self._syncers = ThreadPoolExecutor(tuning.in_flight, thread_name_prefix="graphrun-fsync")
        self._hashers = ThreadPoolExecutor(tuning.hashers, thread_name_prefix="graphrun-sha256")
        self._journal = ThreadPoolExecutor(1, thread_name_prefix="graphrun-journal")
        self.ahead = (self._hashers, self._syncers)  # a sink's files hashed as written
        self._prefixes: dict[Path, PrefixDigest] = {}  # the open shard's (journal thread only)

    def submit(self, shard: _Shard) -> None:
        """Hand over a shard; waits while in_flight shards are not yet journaled."""
        with self._lock:
            self._lock.wait_for(lambda: self._handed - self._settled < self.in_flight)
            self._handed += 1
        if shard.sizes is not None:
            self._journal.submit(self._commit, shard)
            return
        synced = [self._syncers.submit(self.disk.fsync, tmp) for tmp, _ in shard.files]
        hashed = [self._hashers.submit(shard.digests[tmp].result) if tmp in shard.digests
                  else self._hashers.submit(self.disk.sha256, tmp) for tmp, _ in shard.files]
        self._journal.submit(self._commit, shard, synced, hashed)  # one thread: in order

    def wait(self) -> None:
        with self._lock:
            self._lock.wait_for(lambda: self._settled == self._handed)

    def close(self) -> None:
        """Wait for every shard handed over to settle, then end the threads."""
        self._journal.shutdown()  # all settled: no one waits for the pools' results any more
        for pool in (self._syncers, self._hashers):
            pool.shutdown(cancel_futures=True)  # after a failure: the later shards' work

    def files(self) -> list[FileInfo]:
        with self._lock:
            return list(self._files)

    def _commit(self, shard: _Shard, synced: list[Future] | None = None,
                hashed: list[Future] | None = None) -> None:
        try:
            if self.error is None:
                if shard.sizes is None:
                    infos = self._place(shard, synced, hashed)
                else:  # an open line: its temp files' first bytes, durable
                    infos = [FileInfo(name, shard.rows, self._prefix(tmp, size), size)
                             for (tmp, name), size in zip(shard.files, shard.sizes)]
                if shard.rejects_bytes:
                    self.disk.fsync(self.out_dir / REJECTS)
                self.disk.fsync(self.shard_dir)  # renames, and an open shard's new temp names
                self._digest = self.disk.append_journal(
                    self.out_dir, shard.number, infos, shard.total_rows, shard.next_index,
                    shard.rejects_bytes, shard.rejects, shard.read_from, prev=self._digest,
                    rejects_sha256=shard.rejects_sha256, open_shard=shard.sizes is not None)
                with self._lock:
                    if shard.sizes is None:
                        self._files += infos
                    self.rows, self.rejects = shard.total_rows, shard.rejects
                    self.read_from = shard.read_from
        except BaseException as err:  # noqa: BLE001 - raised on the writer's thread
            with self._lock:
                self.error = err
        finally:
            with self._lock:
                self._settled += 1
                self._lock.notify_all()

    def _place(self, shard: _Shard, synced: list[Future], hashed: list[Future]
               ) -> list[FileInfo]:
        """A whole shard's files, fsynced and hashed, renamed into place."""
        infos = []
        for (tmp, name), sync, digest in zip(shard.files, synced, hashed):
            sync.result()  # durable before it is renamed (raises the fsync's error)
            infos.append(FileInfo(name, shard.rows, digest.result(), tmp.stat().st_size))
            os.replace(tmp, self.shard_dir / name)
        for log in shard.logs:  # after the open lines that committed them, in journal order
            log.unlink(missing_ok=True)
        self._prefixes.clear()  # the open shard's lines are over
        return infos

    def _prefix(self, tmp: Path, size: int) -> str:
        """sha256 of the first `size` bytes of an open shard's temp file, made durable."""
        self.disk.fsync(tmp)
        return self._prefixes.setdefault(tmp, PrefixDigest()).upto(tmp, size)

def _round_bfloat16(a: np.ndarray) -> np.ndarray:
    """float32 -> nearest bfloat16 (ties to even), kept as float32; NaN stays NaN. One new
    array, rounded in place (the caller's rows are left alone); uint32 wraps as before."""
    bits = np.ascontiguousarray(a).view(np.uint32)
    out = bits >> 16
    out &= 1
    out += 0x7FFF
    out += bits
    out &= 0xFFFF0000
    rounded = out.view(np.float32)
    np.copyto(rounded, a, where=np.isnan(a))
    return rounded
