"""The completer: the feed's third step. It waits for each launched batch, in order, cuts its
real rows out, frees its host slot and writes its rows and rejects (on the graphrun-completer
thread when overlapped, inline when serial). Batches grouped by length (data.group_by_length)
are held until their window is done, then written in input order (grouping.Reorder)."""

from __future__ import annotations

import queue
import threading
import time
from dataclasses import dataclass
from typing import Callable

from graphrun.feed.protocols import Launched, Sink, Work
from graphrun.read.grouping import Reorder
from graphrun.feed.handoff import SlotPool

_DONE = object()  # the end of the completer's queue
POLL_S = 0.2  # how often drain and close look again when no wake-up came


@dataclass
class Collect:
    """A launched batch to wait for, cut and write."""
    item: Work
    launched: Launched


@dataclass
class Written:
    """A batch that ran whole (engine.run_rows): its outputs and what ran."""
    item: Work
    outs: dict
    ran: list


@dataclass
class RejectJob:
    reject: object  # records.Reject


class Completer:
    """Collects launched batches in order, frees their slots, writes their rows and rejects.

    Threaded: on the graphrun-completer thread, behind a queue; an error there (the sink
    failing, say) is raised on the launching thread at its next call. Otherwise inline."""

    def __init__(self, sink: Sink, pool: SlotPool, on_batches: Callable, host: dict, *,
                 threaded: bool, reorder: Reorder | None = None,
                 on_done: Callable = lambda ordinals: None):
        """on_done(ordinals): records finished (a part's rows, out of the engine) or
        rejected, in the completer's order: what the progress counts."""
        self.sink, self.pool, self.on_done = sink, pool, on_done
        self.reorder = reorder or Reorder()  # grouped batches' outputs, until their window ends
        self.on_batches, self.host = on_batches, host
        self._error: BaseException | None = None  # raised once on the launching thread
        self._failed = False  # for good: nothing more is written after a failure
        self._thread: threading.Thread | None = None
        if threaded:
            # SimpleQueue: its put is one C call, so a KeyboardInterrupt (a second signal)
            # cannot land inside it; queue.Queue's Python put could leave a job queued with the
            # completer never woken, or its count off, and drain or close then waited for good
            self._jobs: queue.SimpleQueue = queue.SimpleQueue()  # bounded by the slots
            self._acks: queue.SimpleQueue = queue.SimpleQueue()  # a wake-up per job done
            self._waiting = False  # drain is waiting: only then are wake-ups put
            self._submitted = 0  # launching thread only: jobs handed over
            self._finished = 0  # completer thread only: jobs done
            self._thread = threading.Thread(target=self._drain, name="graphrun-completer",
                                            daemon=True)
            self._thread.start()

    # -- the launching thread's side --

    def collect(self, item: Work, launched: Launched) -> None:
        self._submit(Collect(item, launched))

    def written(self, item: Work, outs: dict, ran: list) -> None:
        self._submit(Written(item, outs, ran))

    def reject(self, r) -> None:
        self._submit(RejectJob(r))

    def drain(self) -> None:
        """Wait until everything submitted is done; raise what failed there. A wake-up lost
        to an interrupt costs one poll, never the wait."""
        if self._thread is not None:
            self._waiting = True
            while self._finished < self._submitted and self._thread.is_alive():
                try:
                    self._acks.get(timeout=POLL_S)
                except queue.Empty:
                    pass
            self._waiting = False
        self._raise()

    def close(self) -> None:
        """Stop the thread once everything submitted is done. A second Ctrl-C while waiting
        must not leave it writing while the caller closes the sink: keep waiting (the thread
        ends once the jobs before the end mark are done; a mark put twice is harmless)."""
        if self._thread is None:
            return
        while True:
            try:
                self._jobs.put(_DONE)
                break
            except KeyboardInterrupt:
                continue
        while self._thread.is_alive():
            try:
                self._thread.join(POLL_S)
            except KeyboardInterrupt:
                continue
        self._thread = None
        self._raise()

    def _submit(self, job) -> None:
        self._raise()
        if self._thread is None:
            self._do(job)
        else:
            self._jobs.put(job)
            self._submitted += 1  # counted after: an interrupt between never leaves drain waiting

    def _raise(self) -> None:
        if self._error is not None:
            err, self._error = self._error, None
            raise err

    # -- the completer's side --

    def _drain(self) -> None:
        while True:
            job = self._jobs.get()
            if job is _DONE:
                return
            try:
                if not self._failed:
                    self._do(job)
                elif isinstance(job, Collect):  # failed: only wait for it and free its slot
                    try:
                        job.launched.wait()
                    finally:
                        self.pool.release(job.item.slot)
            except BaseException as exc:  # noqa: BLE001 - raised on the launching thread
                self._failed = True
                self._error = self._error or exc  # the first one; slots are freed already
            finally:
                self._finished += 1
                if self._waiting:
                    self._acks.put(None)

    def _do(self, job) -> None:
        if isinstance(job, RejectJob):
            r = job.reject
            self.sink.reject(r.index, r.id, r.where, r.reason)
            self.on_done([r.index])
            return
        item = job.item
        if isinstance(job, Collect):
            t0 = time.perf_counter()
            try:
                outs, times = job.launched.result()
            finally:
                self.pool.release(item.slot)
            ran = [(item.bucket, times)]
            self.host["device_wait"] += time.perf_counter() - t0
        else:
            outs, ran = job.outs, job.ran
        t0 = time.perf_counter()
        if item.window is None:
            self.sink.write(item.indices, item.ids, outs, item.batch_start)
        else:  # data.group_by_length: written in input order once the window is done
            self.reorder.add(item.indices, item.ids, outs)
            if item.window_end:
                self.sink.write(*self.reorder.flush(), item.window)
        self.on_batches(ran, item.n, int(item.indices[0]))
        self.on_done(item.indices)
        self.host["write"] += time.perf_counter() - t0
