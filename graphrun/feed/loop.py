"""Feed: the input's record batches through the engine into the writer, on three threads.

A batch takes three steps, each on its own thread when overlapped (the default on a GPU):

    stager    read and check records, pick the bucket, pad the rows into a free pinned host
              slot                                             (graphrun-stager thread)
    launcher  enqueue h2d copies, replay, d2h copies and events; nothing waits here
                                                               (the calling thread)
    completer wait for the batch's last event, cut the real rows out, free the slot, write
                                                               (graphrun-completer thread)

The slots (Engine.make_room: pinned host slots for a forward pass) are the bounded queue between
them: the stager takes a free slot, the completer gives it back once the outputs are out of it,
so at most `slots` batches are in flight and memory stays bounded whatever the file's size. The launcher, which the device
waits on, only enqueues: padding and writing happen on the other two threads (numpy copies,
file writes, hashing and event waits release the GIL).

All three share the GIL, and that is what bounds the rate of small batches: each CUDA call of a
launch releases it, and the launcher then waits until another thread lets go of it. A launch
then costs about one GIL hand-over per CUDA call it makes. So launches make as few calls as
their copies need (engine/launch.py) and time their phases on a sample of batches
(engine/timing.py). The device's own side of a launch is kept off the compute stream: the
copies of one lane's batch run while the other lane's graph replays (engine/lanes.py). The
other threads are not made to wait while a launch runs: the stager would then fall behind.

Serially (slots=1, no threads) the same three steps run one after another per batch.
Order is kept everywhere: batches are launched, collected, written and rejected in input
order, so outputs, the journal and --resume are the same on both paths.

On a CPU a forward pass's stream is serial by default: torch's own threads run the model on
every core, and the stager and completer would take cores (and the GIL) from it. A generation
job's is overlapped on every device (its runner's default_path). GRAPHRUN_OVERLAP (or run()'s
overlap) forces either path (job/spine.py).
"""

from __future__ import annotations

import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Callable, Iterable, Iterator

import numpy as np

from graphrun.engine.buckets import split_rows
from graphrun.feed.completer import Completer
from graphrun.engine.capture import model_failed
from graphrun.base import envs
from graphrun.base.errors import GraphrunError
from graphrun.feed.protocols import Batch, Engine, Sink, Work
from graphrun.read.grouping import Reorder
from graphrun.feed.handoff import Prefetch, SlotPool
from graphrun.read.records import take_where

_DONE = object()  # the end of the staged work
OVERLAP_ENV = "GRAPHRUN_OVERLAP"
_OVERLAP_WORDS = {"on": True, "1": True, "true": True, "off": False, "0": False, "false": False,
                  "auto": None, "": None}


def overlap_choice(overlap: bool | None) -> bool | None:
    """The caller's choice, else GRAPHRUN_OVERLAP's; None: decide by the device (overlapped on
    CUDA, serial on the CPU)."""
    if overlap is not None:
        if overlap not in (True, False):
            raise GraphrunError(f"overlap={overlap!r} is not one of True, False, None")
        return overlap
    word = envs.get(OVERLAP_ENV).lower()
    if word not in _OVERLAP_WORDS:
        raise GraphrunError(f"{OVERLAP_ENV}={envs.get(OVERLAP_ENV)!r} is not one of on, off, "
                            "auto; set one of those or unset it")
    return _OVERLAP_WORDS[word]


def feed_stream(engine: Engine, batches: Iterable[Batch], sink: Sink, *,
                on_batches: Callable, on_read: Callable, should_stop: Callable[[], bool],
                start: int = 0, oversize: str = "split", overlap: bool = True,
                on_done: Callable = lambda ordinals: None) -> dict[str, float]:
    """Run every record batch; return host seconds per phase and thread (manifest.py's
    host_phase_s says which).

    start: the first input ordinal read; each batch's first covered ordinal goes to the sink,
    which journals it so that --resume re-reads whole batches (see journal.py).
    oversize: data.oversize; a batch larger than every bucket is split into parts here, or
    (eager, error) handed to engine.run_rows whole.
    overlap: True (threads), False (serial).
    on_read(record batch) as each is read; on_done(ordinals) as records finish (Completer)."""
    host = dict.fromkeys(("read", "stage", "read_wait", "launch", "device_wait", "write"), 0.0)
    stream = Stream(engine, sink, on_batches, on_read, should_stop, host, oversize == "split",
                    on_done=on_done)
    stream.run(with_batch_starts(batches, start), overlap)
    return host


def with_batch_starts(batches: Iterable, start: int) -> Iterator[tuple]:
    """(record batch, batch_start): the first input ordinal each batch accounts for (its
    records and rejects), from `start`, which the journal keeps for --resume."""
    for rb in batches:
        batch_start, start = start, covered_to(rb, start) + 1
        yield rb, batch_start


def covered_to(rb, start: int) -> int:
    """The last input ordinal a record batch accounts for (a record or a reject)."""
    last = start - 1
    if len(rb.indices):
        last = max(last, int(rb.indices[-1]))
    if rb.rejects:
        last = max(last, max(r.index for r in rb.rejects))
    return last


@dataclass
class Stream:
    """The stream on one path; every batch written (or the error raised) by the time run()
    returns."""

    engine: Engine
    sink: Sink
    on_batches: Callable
    on_read: Callable
    should_stop: Callable[[], bool]
    host: dict
    split: bool  # data.oversize: split
    on_done: Callable = lambda ordinals: None
    # data.group_by_length: the window's outputs so far
    reorder: Reorder = field(default_factory=Reorder)

    def run(self, batches: Iterable, overlap: bool) -> None:
        engine = self.engine
        pool = SlotPool(engine.make_room(overlap))
        work = self.staged(batches, pool)
        source = Prefetch(work, depth=pool.size) if overlap else work
        done = Completer(self.sink, pool, self.on_batches, self.host, threaded=overlap,
                         reorder=self.reorder, on_done=self.on_done)
        stream = engine.current_stream()
        try:
            with engine.device_context():
                self.launch_all(source, done, stream)
            done.drain()  # the batches in flight are finished, not dropped
        finally:
            pool.close()
            if isinstance(source, Prefetch):
                source.close()
            done.close()

    def launch_all(self, source: Iterator[Work], done: Completer, stream) -> None:
        """The launching thread's loop: each staged part launched (or run whole) in order."""
        host, rb = self.host, None  # rb: the record batch of the part being launched
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
                self.on_read(item.rb)
            if item.kind == "graph":
                t0 = time.perf_counter()
                with model_blamed(item, rb, self.engine):
                    launched = self.engine.launch(item.bucket, item.slot, item.n,
                                                  item.lengths, stream=stream)
                host["launch"] += time.perf_counter() - t0
                done.collect(item, launched)
            elif item.kind == "whole":  # data.oversize: eager, or error, which run_rows raises
                with model_blamed(item, rb, self.engine):
                    outs, ran = self.engine.run_rows(item.fields, item.n, item.lengths,
                                                     ids=item.ids, indices=item.indices)
                done.written(item, outs, ran)
            if item.last and self.should_stop():
                break

    def staged(self, batches: Iterable, pool: "SlotPool") -> Iterator[Work]:
        """The stager: each (record batch, batch_start) as bucket-sized parts, each padded into
        a free slot."""
        source, host = iter(batches), self.host
        while True:
            t0 = time.perf_counter()
            taken = next(source, None)
            host["read"] += time.perf_counter() - t0
            if taken is None:
                return
            rb, batch_start = taken
            parts = list(self.parts(rb))
            if not parts:
                yield Work("none", rb=rb, batch_start=batch_start)
            for i, part in enumerate(parts):
                part.rb, part.last = (rb if i == 0 else None), i == len(parts) - 1
                # grouped (data.group_by_length): a resume re-reads the window, not the batch
                part.batch_start = batch_start if rb.window is None else rb.window
                part.window, part.window_end = rb.window, rb.window_end and part.last
                if part.kind == "graph":
                    part.slot = pool.acquire()
                    t0 = time.perf_counter()
                    part.bucket = self.engine.stage(part.fields, part.n, part.lengths,
                                                    part.slot, ids=part.ids,
                                                    indices=part.indices)
                    host["stage"] += time.perf_counter() - t0
                    part.fields = None  # staged: the rows live in the slot now
                yield part

    def parts(self, rb) -> Iterator[Work]:
        """A record batch as bucket-sized parts: itself, chunks of the largest batch bucket
        (data.oversize: split), or itself whole for run_rows (eager, error)."""
        n = len(rb.ids)
        if n == 0:
            return
        largest = self.engine.max_batch
        if n <= largest or not self.split:
            yield Work("graph" if n <= largest else "whole", n, rb.indices, rb.ids, rb.lengths,
                       fields=rb.fields)
            return
        for sl in split_rows(n, largest):
            yield Work("graph", sl.stop - sl.start, rb.indices[sl], rb.ids[sl],
                       {a: v[sl] for a, v in rb.lengths.items()},
                       fields={k: v[sl] for k, v in rb.fields.items()})


@contextmanager
def model_blamed(item: Work, rb, engine=None):
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
            # grouped batches are in length order, not ordinal order: look the record up
            where = take_where(rb.where, np.flatnonzero(rb.indices == first)[:1])[0]
        ids = item.ids.tolist() if isinstance(item.ids, np.ndarray) else list(item.ids)
        bucket = item.bucket.name if item.bucket is not None else "oversize-eager"
        hint = engine.explain(exc) if engine is not None else None
        raise model_failed(exc, bucket, where or f"record {first}", ids, hint) from exc
