"""Replay: the record batches of the input through the runner into the writer, overlapped.

A batch takes three steps, each on its own thread when overlapped (the default on a GPU):

    stager    read and check records, pick the bucket, pad the rows into a free pinned host
              slot                                             (graphrun-stager thread)
    launcher  enqueue h2d copies, replay, d2h copies and events; nothing waits here
                                                               (the calling thread)
    completer wait for the batch's last event, cut the real rows out, free the slot, write
                                                               (graphrun-completer thread)

The host slots (runner.host_slots) are the bounded queue between them: the stager takes a free
slot, the completer gives it back once the outputs are out of it, so at most `slots` batches
are in flight and memory stays bounded whatever the file's size. The launcher, which the device
waits on, only enqueues: padding and writing happen on the other two threads (numpy copies,
file writes, hashing and event waits release the GIL).

All three share the GIL, and that is what bounds the rate of small batches: each CUDA call of a
launch releases it, and the launcher then waits until another thread lets go of it. A launch
alone takes about 50 us on the H200; overlapped it took 180-600 us, by how many CUDA calls it
made (bench_launch.py, bench_datapath.py). So launches make as few calls as their copies need
(runner.launch) and time their phases on a sample of batches (timing.sampled). The device's
own side of a launch is kept off the compute stream: the copies of one lane's batch run while
the other lane's graph replays (runner.add_lane). Making the other threads wait while a
launch runs was tried and was slower: the stager then fell behind (RESULTS.md, 2026-11-30).

Serially (slots=1, no threads) the same three steps run one after another per batch.
Order is kept everywhere: batches are launched, collected, written and rejected in input
order, so outputs, the journal and --resume are the same on both paths.

On a CPU neither path always wins: torch's own threads run the model on every core, and the
stager and completer take cores (and the GIL) from it, so overlapped was up to 15% slower with
JSONL and up to 9% faster with npy (RESULTS.md). There the stream is run in legs, and an
OverlapTrial times both paths on the stream itself, then keeps the faster (see its docstring).
"""

from __future__ import annotations

import queue
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Callable, Iterable, Iterator

import numpy as np

from .buckets import split_sizes
from .capture import model_failed
from .errors import GraphrunError
from .records import take_where

# overlapped: at least one being staged, one on the device, one being written; at most 16, as
# the batches queued on the device are what carries it through the launching thread's waits
# for the GIL: the MLP's Parquet run (12 decoding threads beside it) went from 0.907x of replay
# with 8 slots to 0.934x with 16 and 0.935x with 32; from npy 0.939x with 8 and 16, 0.922x with
# 32 (RESULTS.md, seventh session)
SLOTS = (3, 16)
SLOT_BUDGET = 512 << 20  # bytes of pinned host slots, at most
_DONE = object()


@dataclass
class Work:
    """One part of a record batch, handed from the stager to the launcher.

    kind: "graph" (staged in `slot` for `bucket`), "eager" (data.oversize: eager, run at the
    batch's own size from `fields`) or "none" (a batch of rejects only)."""
    kind: str
    n: int = 0
    indices: np.ndarray | None = None
    ids: "np.ndarray | list | None" = None  # int64 ordinals or ids, else the ids as read
    lengths: dict = field(default_factory=dict)
    batch_start: int = 0
    bucket: object = None
    slot: int = -1
    fields: dict | None = None
    rb: object = None  # the record batch, on its first part: its rejects and its count
    last: bool = True  # the last part of its record batch: the run may stop after it


def replay_stream(runner, batches: Iterable, writer, *, on_batches: Callable,
                  on_read: Callable, should_stop: Callable[[], bool], start: int = 0,
                  overlap: "bool | OverlapTrial" = True) -> dict[str, float]:
    """Run every record batch; return host seconds per phase and thread (manifest.py's
    host_phase_s says which).

    start: the first input ordinal read; each batch's first covered ordinal goes to the writer,
    which journals it so that --resume re-reads whole batches (see journal.py).
    overlap: True (threads), False (serial), or an OverlapTrial, which runs the stream in legs
    on the path it picks per leg, and keeps what it measured."""
    host = dict.fromkeys(("read", "stage", "read_wait", "launch", "device_wait", "write"), 0.0)
    cursor = Cursor(batches, start)
    if not isinstance(overlap, OverlapTrial):
        _leg(runner, cursor.take(), writer, on_batches, on_read, should_stop, host, overlap)
        return host
    for threaded, seconds in overlap.legs():
        t0, records, batches_before = time.perf_counter(), cursor.records, cursor.batches
        _leg(runner, cursor.take(seconds), writer, on_batches, on_read, should_stop, host,
             threaded, slots=overlap.leg_slots)
        overlap.record(threaded, cursor.records - records, time.perf_counter() - t0,
                       batches=cursor.batches - batches_before)
        if cursor.exhausted or should_stop():
            break
    return host


def _leg(runner, batches: Iterable, writer, on_batches: Callable, on_read: Callable,
         should_stop: Callable[[], bool], host: dict, overlap: bool,
         slots: int | None = None) -> None:
    """The record batches through the runner into the writer on one path, every batch
    written (or the error raised) by the time it returns. slots: at most that many batches
    in flight (a trial's leg, which must end on time: OverlapTrial)."""
    count = runner.host_slots(slot_count(runner.slot_bytes) if overlap else 1)
    pool = SlotPool(min(count, slots) if slots and overlap else count)
    work = staged(runner, batches, pool, host)
    source = Prefetch(work, depth=pool.size) if overlap else work
    done = Completer(runner, writer, pool, on_batches, host, threaded=overlap)
    stream = runner.current_stream()
    try:
        with runner.device_context():
            _launch_all(runner, source, done, host, stream, on_read, should_stop)
        done.drain()  # the batches in flight are finished, not dropped
    finally:
        pool.close()
        if isinstance(source, Prefetch):
            source.close()
        done.close()


class Cursor:
    """The input's record batches, taken in legs: each with the first input ordinal it
    accounts for (its batch_start), counting the records taken, rejects included (they cost
    their parsing too)."""

    def __init__(self, batches: Iterable, start: int):
        self._it = iter(batches)
        self.start = start
        self.records = 0
        self.batches = 0
        self.exhausted = False

    def take(self, seconds: float | None = None) -> Iterator[tuple]:
        """(record batch, batch_start) until the input ends or, given seconds, until that long
        has passed: checked after each batch, so a leg takes at least one and never splits
        one."""
        until = None if seconds is None else time.perf_counter() + seconds
        while True:
            rb = next(self._it, None)
            if rb is None:
                self.exhausted = True
                return
            batch_start, self.start = self.start, _covered_to(rb, self.start) + 1
            self.records += len(rb.indices) + len(rb.rejects)
            self.batches += 1
            yield rb, batch_start
            if until is not None and time.perf_counter() >= until:
                return


class OverlapTrial:
    """Which path is faster on this machine, for this model and input: timed on the stream.

    The stream's first leg warms up (the first batches pay for page faults, allocations and
    caches) and is not timed. A round is then eight legs of `leg_s` each, in the order
    serial, overlapped, overlapped, serial, overlapped, serial, serial, overlapped (so a
    trend in the machine's speed over the round weighs on both paths alike), after which
    the path with more records/s over its legs runs for `every_s` before the next round
    (what else runs on the machine may change). Overlapped is taken only when `margin`
    times faster: serial is the safe path, and a round is noisy (on the 16-core H200 host a
    round once saw the encoder 7% faster overlapped, where whole runs were 10% slower). Every
    leg does real work: only the slower path's legs cost time (2 s in 64 s at the defaults).

    Legs end on time however slow a batch is: a leg cannot end inside a batch, and an
    overlapped leg also finishes the batches it has in flight, so its overlapped legs keep
    only as many in flight (leg_slots, from 2) as take a quarter of a leg by the latest
    serial leg's time a batch. Where a batch takes more than half a leg, the legs
    cannot time the two paths: serial (the safe path) runs to the end, and `reason` says so.
    """

    ORDER = (False, True, True, False, True, False, False, True)  # False: serial
    MIN_LEG_BATCHES = 2

    def __init__(self, leg_s: float = 0.5, every_s: float = 60.0, margin: float = 1.05):
        self.leg_s, self.every_s, self.margin = leg_s, every_s, margin
        self.rounds: list[dict[str, float]] = []  # records/s per path, one entry per round
        self.choice: bool | None = None  # None until a round is complete
        self.last: bool | None = None  # the path of the latest leg
        self.reason: str | None = None  # why the latest choice was made
        self.batch_s: float | None = None  # seconds a batch, on the latest serial leg
        self.leg_slots: int | None = None  # batches in flight at most on this leg (None: all)
        self._round: dict[bool, list] | None = None  # path -> [records, seconds]; None: untimed

    def legs(self) -> Iterator[tuple[bool, float | None]]:
        yield False, self.leg_s  # the warm-up
        while True:
            self._round = {True: [0, 0.0], False: [0, 0.0]}
            for threaded in self.ORDER:
                self.leg_slots = self._trial_slots()
                yield threaded, self.leg_s
                if self._too_slow():
                    self._round, self.leg_slots, self.choice = None, None, False
                    self.reason = (
                        f"serial: a batch took {self.batch_s:.3g} s, too long to time both "
                        f"paths in legs of {self.leg_s:g} s (a leg needs "
                        f"{self.MIN_LEG_BATCHES} batches); serial is the safe path")
                    yield False, None  # the rest of the input
                    return
            self._decide()
            self.leg_slots = None
            yield self.choice, self.every_s

    def _trial_slots(self) -> int:
        """In flight at most on a trial leg: those that take a quarter of a leg, from 2."""
        if not self.batch_s:
            return 2
        return max(2, min(SLOTS[1], int(self.leg_s / (4 * self.batch_s))))

    def _too_slow(self) -> bool:
        """After a serial leg of a round: a leg would hold fewer than MIN_LEG_BATCHES."""
        return (self.last is False and self.leg_s > 0 and self.batch_s is not None
                and self.batch_s * self.MIN_LEG_BATCHES > self.leg_s)

    def record(self, threaded: bool, records: int, seconds: float,
               batches: int | None = None) -> None:
        self.last = threaded
        if not threaded and batches:
            self.batch_s = seconds / batches
        if self._round is not None:
            acc = self._round[threaded]
            acc[0] += records
            acc[1] += seconds

    def _decide(self) -> None:
        serial, overlapped = (self._round[p][0] / max(self._round[p][1], 1e-9)
                              for p in (False, True))
        self._round = None
        self.rounds.append({"serial": round(serial, 1), "overlapped": round(overlapped, 1)})
        self.choice = overlapped > self.margin * serial  # a tie (0 and 0 too): serial
        ratio = f"{overlapped / serial:.2f}x" if serial else "as fast as"
        self.reason = (f"measured: overlapped ran at {ratio} serial's records/s in the latest "
                       f"round; it is taken from {self.margin:g}x")


def _launch_all(runner, source, done: "Completer", host: dict, stream, on_read: Callable,
                should_stop: Callable[[], bool]) -> None:
    """The launching thread's loop: each staged part launched (or run eagerly) in order."""
    rb = None  # the record batch of the part being launched (a split one's later parts too)
    while True:
        t0 = time.perf_counter()
        try:
            item = next(source, _DONE)
        except BaseException:  # a bad record: what came before it is still written
            done.drain()
            raise
        host["read_wait"] += time.perf_counter() - t0
        if item is _DONE:
            break
        if item.rb is not None:
            rb = item.rb
            for r in item.rb.rejects:
                done.reject(r)
            on_read(item.rb)
        if item.kind == "graph":
            t0 = time.perf_counter()
            with _model_blamed(item, rb):
                marks = runner.launch(item.bucket, item.slot, stream=stream)
            host["launch"] += time.perf_counter() - t0
            done.collect(item, marks)
        elif item.kind == "eager":  # or data.oversize: error, which run_rows raises
            with _model_blamed(item, rb):
                outs, ran = runner.run_rows(item.fields, item.n, item.lengths)
            done.written(item, outs, ran)
        if item.last and should_stop():
            break


@contextmanager
def _model_blamed(item: Work, rb):
    """What the model raises on a part (not a user error graphrun raised) becomes a
    ModelError naming the part's bucket, its first record's place in the input and its ids."""
    try:
        yield
    except GraphrunError:
        raise
    except Exception as exc:  # noqa: BLE001 - the model's own error, on this batch
        first = int(item.indices[0])
        where = None
        if rb is not None and len(rb.indices):
            where = take_where(rb.where, np.searchsorted(rb.indices, [first]))[0]
        ids = item.ids.tolist() if isinstance(item.ids, np.ndarray) else list(item.ids)
        bucket = item.bucket.name if item.bucket is not None else "oversize-eager"
        raise model_failed(exc, bucket, where or f"record {first}", ids) from exc


def slot_count(slot_bytes: int) -> int:
    """Slots for an overlapped stream: as many as SLOT_BUDGET holds, within SLOTS. More slots
    absorb a thread's stall (a page fault, the GIL, a shard's commit) without the device
    waiting; beyond that they only hold memory."""
    low, high = SLOTS
    return max(low, min(high, SLOT_BUDGET // max(slot_bytes, 1)))


def staged(runner, batches: Iterable, pool: "SlotPool", host: dict) -> Iterator[Work]:
    """The stager: each (record batch, batch_start) as bucket-sized parts, each padded into a
    free slot."""
    source = iter(batches)
    while True:
        t0 = time.perf_counter()
        taken = next(source, None)
        host["read"] += time.perf_counter() - t0
        if taken is None:
            return
        rb, batch_start = taken
        n = len(rb.ids)
        parts = list(_parts(runner, rb, n))
        if not parts:
            yield Work("none", rb=rb, batch_start=batch_start)
        for i, part in enumerate(parts):
            first, last = rb if i == 0 else None, i == len(parts) - 1
            if part is None:
                yield Work("eager", n, rb.indices, rb.ids, rb.lengths, batch_start,
                           fields=rb.fields, rb=first, last=last)
                continue
            fields, k, lengths, indices, ids = part
            slot = pool.acquire()
            t0 = time.perf_counter()
            bucket = runner.stage(fields, k, lengths, slot)
            host["stage"] += time.perf_counter() - t0
            yield Work("graph", k, indices, ids, lengths, batch_start, bucket, slot,
                       rb=first, last=last)


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
    (data.oversize: split), or None for 'run it at its own size' (data.oversize: eager)."""
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


class Closed(Exception):
    """The slot pool was closed while the stager waited for a slot: the run is ending."""


class SlotPool:
    """The free host slots. The stager takes one per batch, the completer gives it back."""

    def __init__(self, size: int):
        self.size = size
        self._free: queue.Queue = queue.Queue()
        for slot in range(size):
            self._free.put(slot)
        self._closed = threading.Event()

    def acquire(self) -> int:
        while True:
            try:
                return self._free.get(timeout=0.05)
            except queue.Empty:
                if self._closed.is_set():
                    raise Closed from None

    def release(self, slot: int) -> None:
        self._free.put(slot)

    def close(self) -> None:
        self._closed.set()


class Completer:
    """Collects launched batches in order, frees their slots, writes their rows and rejects.

    Threaded: on the graphrun-completer thread, behind a queue; an error there (the writer
    failing, say) is raised on the launching thread at its next call. Otherwise inline."""

    def __init__(self, runner, writer, pool: SlotPool, on_batches: Callable, host: dict, *,
                 threaded: bool):
        self.runner, self.writer, self.pool = runner, writer, pool
        self.on_batches, self.host = on_batches, host
        self._error: BaseException | None = None  # raised once on the launching thread
        self._failed = False  # for good: nothing more is written after a failure
        self._queue: queue.Queue | None = None
        if threaded:
            self._queue = queue.Queue()  # bounded by the slots: a batch holds one until done
            self._thread = threading.Thread(target=self._drain, name="graphrun-completer",
                                            daemon=True)
            self._thread.start()

    # -- the launching thread's side --

    def collect(self, item: Work, marks: list) -> None:
        self._submit(("collect", item, marks))

    def written(self, item: Work, outs: dict, ran: list) -> None:
        self._submit(("write", item, outs, ran))

    def reject(self, r) -> None:
        self._submit(("reject", r))

    def drain(self) -> None:
        """Wait until everything submitted is done; raise what failed there."""
        if self._queue is not None:
            self._queue.join()
        self._raise()

    def close(self) -> None:
        """Stop the thread once everything submitted is done. A second Ctrl-C while waiting
        must not leave it writing while the caller closes the writer: keep waiting."""
        if self._queue is None:
            return
        self._queue.put(_DONE)
        while True:
            try:
                self._thread.join()
                break
            except KeyboardInterrupt:
                continue
        self._queue = None
        self._raise()

    def _submit(self, job: tuple) -> None:
        self._raise()
        if self._queue is None:
            self._do(job)
        else:
            self._queue.put(job)

    def _raise(self) -> None:
        if self._error is not None:
            err, self._error = self._error, None
            raise err

    # -- the completer's side --

    def _drain(self) -> None:
        while True:
            job = self._queue.get()
            try:
                if job is _DONE:
                    return
                if not self._failed:
                    self._do(job)
                elif job[0] == "collect":  # failed: only wait for the batch and free its slot
                    try:
                        self.runner.timer.finish(job[2])
                    finally:
                        self.pool.release(job[1].slot)
            except BaseException as exc:  # noqa: BLE001 - raised on the launching thread
                self._failed = True
                self._error = self._error or exc  # the first one; slots are freed already
            finally:
                self._queue.task_done()

    def _do(self, job: tuple) -> None:
        kind = job[0]
        if kind == "reject":
            r = job[1]
            self.writer.reject(r.index, r.id, r.where, r.reason)
            return
        item = job[1]
        if kind == "collect":
            t0 = time.perf_counter()
            try:
                outs, times = self.runner.collect(item.bucket, item.slot, job[2], item.n,
                                                  item.lengths)
            finally:
                self.pool.release(item.slot)
            ran = [(item.bucket, times)]
            self.host["device_wait"] += time.perf_counter() - t0
        else:
            outs, ran = job[2], job[3]
        t0 = time.perf_counter()
        self.writer.write(item.indices, item.ids, outs, item.batch_start)
        self.on_batches(ran, item.n, int(item.indices[0]))
        self.host["write"] += time.perf_counter() - t0


class Prefetch:
    """Iterate `source` on a background thread, `depth` items ahead. An exception raised by the
    source (a bad record with on_bad_record: error) is re-raised here, in order."""

    def __init__(self, source: Iterable, depth: int):
        self._queue: queue.Queue = queue.Queue(maxsize=depth)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._fill, args=(iter(source),),
                                        name="graphrun-stager", daemon=True)
        self._thread.start()

    def _fill(self, it: Iterator) -> None:
        try:
            for item in it:
                if not self._put((True, item)):
                    return
        except Closed:
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
