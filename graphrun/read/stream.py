"""The stream step: read the input file chunk by chunk, check every record, and hand out batches
of data.batch_size valid records.

The file's format is its reader's business (formats/, one module per format); the checks are
checks.py's and ids.py's; this module holds the entry point and the batching.
Memory stays at about one chunk whatever the file's size.
"""

from __future__ import annotations

import threading
from collections import deque
from pathlib import Path
from typing import Iterator

import numpy as np

from graphrun.base.errors import InputError
from graphrun.read.grouping import PaddingCount, sorted_batches
from graphrun.read.formats import parquet_id_kind, reader_for
from graphrun.read.checks import RecordChecker
from graphrun.read.ids import last_repeat
from graphrun.read.records import (PackedRecords, Reject, RecordBatch, concat_where,
                                   dense_if_uniform, numpy_dtype, pack_records)
from graphrun.spec.keys import PipelineSpec
from graphrun.base.tuning import Tuning

__all__ = ["Reject", "RecordBatch", "ReadAhead", "job_duplicates", "read_batches"]


def read_batches(spec: PipelineSpec, *, start: int = 0, stop: int | None = None,
                 tuning: Tuning | None = None, padding: PaddingCount | None = None,
                 ids_from: int | None = None, cuts=None) -> Iterator[RecordBatch]:
    """Batches of spec.data.batch_size valid records (the last may be smaller) from the records
    with ordinals in [start, stop). Each batch carries the rejects met before its last record, so
    records and rejects come out in file order; a batch may hold only rejects. With
    on_bad_record: error the first bad record raises InputError (after the full batches before
    it). tuning: the reader's threads and chunk sizes (default: Tuning.from_machine()). With
    data.group_by_length the batches of each window come in length order (grouping.py);
    padding, if given, counts what that saved. ids_from: the first ordinal of the job (or of
    the slice) when reading starts past it (a worker's share, a resumed run): the ids that one
    process reading from there would have seen by `start` count as seen, so a duplicate of an
    earlier share's record is rejected here as one process rejects it. cuts (text.TextCuts), if
    given, counts the records whose text data.text.truncate cut."""
    if start < 0 or (stop is not None and stop < start):
        raise ValueError(f"need 0 <= start <= stop (got start={start}, stop={stop})")
    tuning = tuning or Tuning.from_machine()
    reader = reader_for(spec, tuning)
    if not Path(spec.data.path).is_file():
        raise InputError("input file not found", where=str(spec.data.path))
    checker = RecordChecker(spec, id_kind=parquet_id_kind(spec))
    if ids_from is not None and ids_from < start and spec.data.id_field:
        # the records before start are another worker's (or committed before a resume):
        # checked again only for the ids one process would remember by now
        for chunk in _read(reader, spec, ids_from, start):
            checker.check(chunk)
    # a reader's chunk is Candidates, or Prechecked on another thread (Parquet's decoding pool):
    # this thread then only checks its ids for duplicates and cuts it into batches
    checked = (checker.check(c) for c in _read(reader, spec, start, stop))
    if cuts is not None:
        checked = _counting_cuts(checked, cuts)
    if spec.data.group_by_length:
        yield from _regroup_windows(checked, spec, start, padding)
    else:
        yield from _regroup(checked, spec, tuning.rejects_held)


def padded_batches(batches: Iterator[RecordBatch], spec: PipelineSpec) -> Iterator[RecordBatch]:
    """Each batch's records of an input that differ in their first axis only (text's tokens)
    as one array [n, the batch's longest, ...], the rest the input's pad value; `lengths`
    still give each record's own. Made where the batches are read (the read-ahead thread),
    so that staging a batch for the device is one slice copy, not one per record."""
    try:
        for rb in batches:
            if isinstance(rb, RecordBatch) and len(rb):
                for name, records in rb.fields.items():
                    if not isinstance(records, np.ndarray):
                        dense = padded_to_longest(records, spec.inputs[name].pad)
                        if dense is not None:
                            rb.fields[name] = dense
            yield rb
    finally:  # closed early (a stop, an error): the reader's own close, its pool stopped
        close = getattr(batches, "close", None)
        if close is not None:
            close()


def padded_to_longest(records: list, pad: float) -> np.ndarray | None:
    """Records of one dtype and inner shape as [n, longest, ...] padded with `pad`; None for
    records that differ in more than their first axis."""
    packed = pack_records(records)
    if not isinstance(packed, PackedRecords):
        return None
    lengths, flat = packed.lengths, packed.flat
    out = np.full((len(lengths), int(lengths.max()), *flat.shape[1:]), pad, flat.dtype)
    out[np.arange(out.shape[1]) < lengths[:, None]] = flat
    return out


def job_duplicates(spec: PipelineSpec, tuning: Tuning | None = None, reader=None
                   ) -> dict[int, str]:
    """ordinal -> reason of every record that one process reading the whole file rejects as a
    duplicate id, for a job whose processes each see only part of the file (a Ray run's
    actors). The ids are read alone first (JSONL: the lines parsed for their id; Parquet: the
    id column); only a file whose ids repeat is then checked as one process checks it (only an
    id of a record that passes every other check counts), up to its last repeat. reader: the
    file's (formats/), else reader_for's."""
    if not spec.data.id_field:
        return {}
    reader = reader or reader_for(spec, tuning or Tuning.from_machine())
    checker = RecordChecker(spec, id_kind=parquet_id_kind(spec))
    checker.found_duplicates = {}
    try:
        last = last_repeat(reader.ids())
        for chunk in reader.chunks(0, last + 1) if last is not None else ():
            checker.check(chunk)
    except OSError as err:
        raise InputError(f"reading the input file failed: {err.strerror or err}; fix the "
                         "file's disk, then run again", where=str(spec.data.path)) from err
    return checker.found_duplicates


def _read(reader, spec: PipelineSpec, start: int, stop: int | None) -> Iterator:
    """The reader's chunks; the file failing to read (EIO, a disk gone) is the input's error,
    not a write failure of the output folder."""
    try:
        yield from reader.chunks(start, stop)
    except OSError as err:
        raise InputError(f"reading the input file failed: {err.strerror or err}; the batches "
                         "before it are committed: fix the file's disk, then run again with "
                         "--resume", where=str(spec.data.path)) from err


class ReadAhead:
    """Iterate `batches`, read on a thread of their own started at once: the first `ahead`
    while the runner sets up (loads the model, captures, verifies), then on ahead of the
    consumer while the batches held take less than `hold_bytes` (at least one): a text file is
    tokenized during the model library's import, not while the device waits. An error met on
    the way is raised by the next() that reaches it, in order, as the plain iterator raises
    it. peek() shows every batch held: at least the first `ahead` (capture.lazy decides from
    them which buckets to set up before the stream; a file read ahead whole sets up all).

    Only that thread advances the iterator, so a signal on the consumer's thread never lands
    inside it; close() stops the thread, waits until it is out of the iterator, then closes it
    (a Parquet reader's decoding pool stops)."""

    def __init__(self, batches: Iterator[RecordBatch], ahead: int = 1, hold_bytes: int = 0):
        self._it = iter(batches)
        self._ahead, self._hold = max(1, ahead), hold_bytes
        # (True, batch or _END, its bytes) or (False, the exception, 0), in order, not taken
        self._queue: deque = deque()
        self._held = 0  # bytes of the batches in the queue
        self._read = 0  # entries the thread has put in the queue
        self._stop = False
        self._inside = 0  # consumers in next()
        self._cond = threading.Condition()
        # set once the thread is done with the iterator: what close() waits for, not
        # Thread.join, which Python 3.11 leaves marking a live thread as ended when a signal
        # handler's KeyboardInterrupt cuts it short (the next join then returns at once)
        self._fetched = threading.Event()
        self._thread = threading.Thread(target=self._fetch, name="graphrun-read-ahead",
                                        daemon=True)
        self._thread.start()

    def _room(self) -> bool:
        return self._read < self._ahead or not self._queue or self._held < self._hold

    def _fetch(self) -> None:
        try:
            while True:
                with self._cond:
                    while not self._room() and not self._stop:
                        self._cond.wait()
                    if self._stop:
                        return
                item = next(self._it, _END)
                size = _bytes(item) if self._hold else 0  # no budget: nothing to count
                with self._cond:
                    self._queue.append((True, item, size))
                    self._held += size
                    self._read += 1
                    self._cond.notify_all()
                if item is _END:
                    return
        except BaseException as exc:  # noqa: BLE001 - raised by the consumer's next()
            with self._cond:
                self._queue.append((False, exc, 0))
                self._read += 1
        finally:
            with self._cond:
                self._fetched.set()
                self._cond.notify_all()

    def peek(self) -> tuple[list[RecordBatch], bool]:
        """(the batches held, not taken: the first `ahead` and those read on past them, whether
        the input ends among them); waits until the first `ahead` are read."""
        with self._cond:
            while self._read < self._ahead and not self._fetched.is_set():
                self._cond.wait()
            held = list(self._queue)
        batches = [item for ok, item, _ in held if ok and item is not _END]
        return batches, any(ok and item is _END for ok, item, _ in held)

    def __iter__(self) -> "ReadAhead":
        return self

    def __next__(self) -> RecordBatch:
        with self._cond:
            self._inside += 1
            try:
                while not self._queue and not self._fetched.is_set():
                    self._cond.wait()
                if not self._queue:  # stopped (closed), or past the end or an error
                    raise StopIteration
                ok, item, size = self._queue.popleft()
                self._held -= size
            finally:
                self._inside -= 1
                self._cond.notify_all()
        if not ok:
            raise item
        if item is _END:
            with self._cond:
                self._queue.appendleft((True, _END, 0))  # the end stays the end
            raise StopIteration
        return item

    def close(self) -> None:
        with self._cond:
            self._stop = True
            self._cond.notify_all()
        self._fetched.wait()  # the thread is out of the iterator (a signal here: call again)
        with self._cond:
            while self._inside:  # a consumer already in next() gets what it waits for
                self._cond.wait()
            self._queue.clear()
            self._held = 0
        close = getattr(self._it, "close", None)
        if close is not None:
            close()


def _bytes(batch) -> int:
    """A batch's arrays' bytes (ragged records: each record's array's)."""
    if not isinstance(batch, RecordBatch):
        return 0
    total = batch.indices.nbytes
    for records in batch.fields.values():
        if isinstance(records, np.ndarray):
            total += records.nbytes
        else:
            total += sum(a.nbytes for a in records if isinstance(a, np.ndarray))
    return total


_END = object()


def _counting_cuts(chunks: Iterator[RecordBatch], cuts) -> Iterator[RecordBatch]:
    for chunk in chunks:
        cuts.add(chunk)
        yield chunk


# ---- batching ----------------------------------------------------------------------------------

def _regroup(chunks: Iterator[RecordBatch], spec: PipelineSpec, rejects_held: int
             ) -> Iterator[RecordBatch]:
    batch_size, stop_at_bad = spec.data.batch_size, spec.data.on_bad_record == "error"
    held = _Held(_empty_batch(spec))
    rejects: deque[Reject] = deque()  # rejects not yet handed out, in file order
    for chunk in chunks:
        bad = chunk.rejects[0] if stop_at_bad and chunk.rejects else None
        if bad is not None:  # keep the records before it, hand out the full batches, then raise
            chunk = _slice(chunk, 0, int(np.searchsorted(chunk.indices, bad.index)))
        rejects.extend(chunk.rejects)
        held.add(chunk)
        while len(held) >= batch_size:
            batch = held.pop(batch_size)
            last = batch.indices[-1]
            while rejects and rejects[0].index < last:
                batch.rejects.append(rejects.popleft())
            yield batch
        if len(rejects) >= rejects_held:
            yield _with_rejects(held.pop(len(held)), rejects)
        if bad is not None:  # the records before the bad one are still written
            if len(held) or rejects:
                yield _with_rejects(held.pop(len(held)), rejects)
            raise stopped_at(bad)
    if len(held) or rejects:
        yield _with_rejects(held.pop(len(held)), rejects)


def _regroup_windows(chunks: Iterator[RecordBatch], spec: PipelineSpec, start: int,
                     padding: PaddingCount | None) -> Iterator[RecordBatch]:
    """data.group_by_length: windows of N consecutive ordinals from `start`, each handed out
    once read whole (its rejects on its first batch, so memory holds about a window), its
    records batched in length order. A bad record with on_bad_record: error ends the window
    it is in: the records before it are still handed out, then it raises."""
    size, stop_at_bad = spec.data.group_by_length, spec.data.on_bad_record == "error"
    held = _Held(_empty_batch(spec))
    rejects: deque[Reject] = deque()
    lo = start  # the current window is [lo, lo + size)
    for chunk in chunks:
        bad = chunk.rejects[0] if stop_at_bad and chunk.rejects else None
        if bad is not None:
            chunk = _slice(chunk, 0, int(np.searchsorted(chunk.indices, bad.index)))
        rejects.extend(chunk.rejects)
        held.add(chunk)
        seen = max(int(chunk.indices[-1]) if len(chunk) else lo - 1,
                   chunk.rejects[-1].index if chunk.rejects else lo - 1)
        while bad is None and seen >= lo + size - 1:  # the window is read whole
            yield from _window(held, rejects, lo, lo + size, spec, padding)
            lo += size
        if bad is not None:
            if len(held) or rejects:
                yield from _window(held, rejects, lo, None, spec, padding)
            raise stopped_at(bad)
    if len(held) or rejects:
        yield from _window(held, rejects, lo, None, spec, padding)


def _window(held: "_Held", rejects: deque, lo: int, hi: int | None, spec: PipelineSpec,
            padding: PaddingCount | None) -> Iterator[RecordBatch]:
    """The window [lo, hi) (hi None: all that is held) as sorted batches."""
    window = held.pop(len(held) if hi is None else held.count_below(hi))
    while rejects and (hi is None or rejects[0].index < hi):
        window.rejects.append(rejects.popleft())
    batches = sorted_batches(window, spec.data.batch_size, lo)
    if padding is not None and len(window):
        padding.add_window(window, batches)
    yield from batches


def _with_rejects(batch: RecordBatch, rejects: deque[Reject]) -> RecordBatch:
    batch.rejects.extend(rejects)
    rejects.clear()
    return batch


class _Held:
    """Valid records waiting for a full batch: checked chunks in file order, and how many
    records of the first were handed out already."""

    def __init__(self, empty: RecordBatch):
        self.empty = empty  # a batch of no records, each input and axis present
        self.chunks: deque[RecordBatch] = deque()
        self.cursor = 0
        self.count = 0

    def __len__(self) -> int:
        return self.count

    def add(self, chunk: RecordBatch) -> None:
        if len(chunk):
            self.chunks.append(chunk)
            self.count += len(chunk)

    def count_below(self, hi: int) -> int:
        """How many held records have an ordinal below hi."""
        count, cursor = 0, self.cursor
        for chunk in self.chunks:
            below = int(np.searchsorted(chunk.indices, hi)) - cursor
            count += max(below, 0)
            if below < len(chunk) - cursor:
                break
            cursor = 0
        return count

    def pop(self, k: int) -> RecordBatch:
        """The next k records as one batch (without rejects)."""
        parts = []
        self.count -= k
        while k > 0:
            chunk = self.chunks[0]
            step = min(k, len(chunk) - self.cursor)
            parts.append(_slice(chunk, self.cursor, self.cursor + step))
            self.cursor += step
            k -= step
            if self.cursor == len(chunk):
                self.chunks.popleft()
                self.cursor = 0
        if len(parts) <= 1:
            return parts[0] if parts else _slice(self.empty, 0, 0)
        return RecordBatch(
            indices=np.concatenate([p.indices for p in parts]),
            ids=_concat_ids([p.ids for p in parts]),
            where=concat_where([p.where for p in parts]),
            fields={name: _concat_records([p.fields[name] for p in parts])
                    for name in parts[0].fields},
            lengths={axis: np.concatenate([p.lengths[axis] for p in parts])
                     for axis in parts[0].lengths},
        )


def stopped_at(bad: Reject) -> InputError:
    """data.on_bad_record: error's stop at a bad record: what is wrong, where, what to do."""
    return InputError(f"{bad.reason}; the records before it are written. Fix that record and run "
                      "again with --overwrite (the input changed, so --resume cannot go on from "
                      "them), or set data.on_bad_record: skip to go on past bad records (each "
                      "one goes to rejects.jsonl with its place and reason)",
                      where=bad.where, record_id=bad.id)


def _empty_batch(spec: PipelineSpec) -> RecordBatch:
    """No records: each input [0, ...] in its dtype, named axes 0 long."""
    fields = {name: np.empty([0] + [d if isinstance(d, int) else 0 for d in inp.shape[1:]],
                             numpy_dtype(inp.dtype)) for name, inp in spec.inputs.items()}
    axes = {d for inp in spec.inputs.values() for d in inp.shape[1:] if isinstance(d, str)}
    return RecordBatch(np.empty(0, np.int64), np.empty(0, np.int64), [], fields,
                       {axis: np.empty(0, np.int64) for axis in spec.axes[1:] if axis in axes})


def _slice(batch: RecordBatch, lo: int, hi: int) -> RecordBatch:
    """Records [lo, hi) of a batch, without its rejects; dense where their shapes agree."""
    return RecordBatch(batch.indices[lo:hi], batch.ids[lo:hi], batch.where[lo:hi],
                       {name: r[lo:hi] if isinstance(r, np.ndarray) else dense_if_uniform(r[lo:hi])
                        for name, r in batch.fields.items()},
                       {axis: n[lo:hi] for axis, n in batch.lengths.items()})


def _concat_ids(parts: list) -> np.ndarray | list:
    if all(isinstance(p, np.ndarray) for p in parts):
        return np.concatenate(parts)
    return [i for p in parts for i in (p.tolist() if isinstance(p, np.ndarray) else p)]


def _concat_records(parts: list) -> np.ndarray | list:
    if all(isinstance(p, np.ndarray) for p in parts) and len({p.shape[1:] for p in parts}) == 1:
        return np.concatenate(parts)
    return dense_if_uniform([a for p in parts for a in p])
