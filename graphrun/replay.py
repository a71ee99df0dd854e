"""Replay: the record batches of the input through the runner into the writer, overlapped.

Serially, the device idles while the host parses the next batch, and the host idles while the
device replays. Overlapped (the default):
  - a reader thread parses ahead into a bounded queue (a few batches; memory stays bounded);
  - batch i+1 is padded into the second pinned host slot and launched (h2d, replay, d2h all
    enqueued on the device's stream) before the host waits for batch i's last copy, so the
    device runs i+1 while the host cuts i's outputs and hands them over;
  - a writer thread writes shards while the main thread feeds the device.
Order is kept everywhere: batches are collected, written and rejected in input order, so the
outputs, the journal and --resume are the same as on the serial path.
"""

from __future__ import annotations

import queue
import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import Callable, Iterable, Iterator

import numpy as np

from .buckets import split_sizes

_DONE = object()


@dataclass
class Launched:
    bucket: object
    slot: int
    marks: list
    n: int
    lengths: dict
    indices: np.ndarray
    ids: list
    batch_start: int


def replay_stream(runner, batches: Iterable, writer, *, on_batches: Callable,
                  on_read: Callable, should_stop: Callable[[], bool], start: int = 0,
                  overlap: bool = True) -> dict[str, float]:
    """Run every record batch; return host seconds per phase (where the host spent the run).

    start: the first input ordinal read; each batch's first covered ordinal goes to the writer,
    which journals it so that --resume re-reads whole batches (see journal.py)."""
    host = {"read_wait": 0.0, "stage": 0.0, "device_wait": 0.0, "write": 0.0}
    sink = BackgroundWriter(writer) if overlap else writer
    source = prefetch(batches, depth=4) if overlap else iter(batches)
    pending: deque[Launched] = deque()
    slot = 0

    def finish(item: Launched) -> None:
        t0 = time.perf_counter()
        outs, times = runner.collect(item.bucket, item.slot, item.marks, item.n, item.lengths)
        t1 = time.perf_counter()
        sink.write(item.indices, item.ids, outs, item.batch_start)
        host["device_wait"] += t1 - t0
        host["write"] += time.perf_counter() - t1
        on_batches([(item.bucket, times)], item.n, int(item.indices[0]))

    try:
        while True:
            t0 = time.perf_counter()
            try:
                rb = next(source, _DONE)
            except BaseException:  # a bad record: what came before it is still written
                while pending:
                    finish(pending.popleft())
                raise
            host["read_wait"] += time.perf_counter() - t0
            if rb is _DONE:
                break
            for r in rb.rejects:
                sink.reject(r.index, r.id, r.where, r.reason)
            n = len(rb.ids)
            on_read(rb)
            batch_start, start = start, _covered_to(rb, start) + 1
            for part in _parts(runner, rb, n):
                if part is None:  # data.oversize: eager, run at the batch's own size
                    while pending:
                        finish(pending.popleft())
                    outs, ran = runner.run_rows(rb.fields, n, rb.lengths)
                    sink.write(rb.indices, rb.ids, outs, batch_start)
                    on_batches(ran, n, int(rb.indices[0]))
                    continue
                fields, k, lengths, indices, ids = part
                t0 = time.perf_counter()
                bucket = runner.stage(fields, k, lengths, slot)
                marks = runner.launch(bucket, slot)
                host["stage"] += time.perf_counter() - t0
                if pending:
                    finish(pending.popleft())
                pending.append(Launched(bucket, slot, marks, k, lengths, indices, ids,
                                        batch_start))
                slot ^= 1
                if not overlap:
                    finish(pending.popleft())
            if should_stop():
                break
        while pending:  # the batch in flight is finished, not dropped
            finish(pending.popleft())
    finally:
        if isinstance(source, Prefetch):
            source.close()
        if isinstance(sink, BackgroundWriter):
            sink.join()
    return host


def _covered_to(rb, start: int) -> int:
    """The last input ordinal a record batch accounts for (a record or a reject)."""
    last = start - 1
    if len(rb.indices):
        last = max(last, int(rb.indices[-1]))
    if rb.rejects:
        last = max(last, max(r.index for r in rb.rejects))
    return last


def _parts(runner, rb, n: int) -> Iterator:
    """A record batch as bucket-sized parts: itself, or chunks of the largest batch bucket
    (data.oversize: split), or None for 'run it eagerly' (data.oversize: eager)."""
    if n == 0:
        return
    largest = runner.table.max_batch
    if n > largest and runner.spec.data.oversize != "split":
        yield None  # run_rows applies eager, or raises for error
        return
    start = 0
    for size in split_sizes(n, largest):
        sl = slice(start, start + size)
        if size == n:
            yield rb.fields, n, rb.lengths, rb.indices, rb.ids
        else:
            yield ({k: v[sl] for k, v in rb.fields.items()}, size,
                   {a: v[sl] for a, v in rb.lengths.items()}, rb.indices[sl], rb.ids[sl])
        start += size


class Prefetch:
    """Iterate `source` on a background thread, `depth` items ahead. An exception raised by the
    source (a bad record with on_bad_record: error) is re-raised here, in order."""

    def __init__(self, source: Iterable, depth: int):
        self._queue: queue.Queue = queue.Queue(maxsize=depth)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._fill, args=(iter(source),),
                                        name="graphrun-reader", daemon=True)
        self._thread.start()

    def _fill(self, it: Iterator) -> None:
        try:
            for item in it:
                if not self._put((True, item)):
                    return
        except BaseException as exc:  # noqa: BLE001 - handed to the consumer, in order
            self._put((False, exc))
            return
        self._put((True, _DONE))

    def _put(self, item) -> bool:
        while not self._stop.is_set():
            try:
                self._queue.put(item, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    def __iter__(self) -> "Prefetch":
        return self

    def __next__(self):
        ok, item = self._queue.get()
        if not ok:
            raise item
        if item is _DONE:
            raise StopIteration
        return item

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)


def prefetch(source: Iterable, depth: int) -> Prefetch:
    return Prefetch(source, depth)


class BackgroundWriter:
    """The writer's write/reject calls, in order, on a background thread. An error there is
    raised on the next call or at join()."""

    def __init__(self, writer, depth: int = 8):
        self._writer = writer
        self._queue: queue.Queue = queue.Queue(maxsize=depth)
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._drain, name="graphrun-writer", daemon=True)
        self._thread.start()

    def _drain(self) -> None:
        while True:
            item = self._queue.get()
            if item is _DONE:
                return
            if self._error is None:
                method, args = item
                try:
                    getattr(self._writer, method)(*args)
                except BaseException as exc:  # noqa: BLE001 - re-raised on the main thread
                    self._error = exc

    def _raise(self) -> None:
        if self._error is not None:
            err, self._error = self._error, None
            raise err

    def write(self, *args) -> None:
        self._raise()
        self._queue.put(("write", args))

    def reject(self, *args) -> None:
        self._raise()
        self._queue.put(("reject", args))

    def join(self) -> None:
        """Wait until everything queued is written. A second Ctrl-C while waiting must not
        leave this thread writing while the caller closes the writer: keep waiting."""
        self._queue.put(_DONE)
        while True:
            try:
                self._thread.join()
                break
            except KeyboardInterrupt:
                continue
        self._raise()
