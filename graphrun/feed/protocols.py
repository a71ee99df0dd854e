"""The feed's interfaces: what the engine, the sink and a record batch provide to the feed's loop
(feed/loop.py), and the Work handed from its stager to its launcher."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ContextManager, Protocol

import numpy as np

from graphrun.engine.buckets import Bucket


class Launched(Protocol):
    """A launched batch (engine/launch.py's Launch)."""

    def wait(self) -> dict[str, float]: ...  # phase times, us

    def result(self) -> tuple[dict, dict[str, float]]: ...  # real rows, phase times


class Engine(Protocol):
    """What the feed needs of the engine that runs its parts: a runner's `launcher`. A forward
    pass's is engine/launch.py's Launcher (pinned host slots, copy streams, a replay per part);
    a generation job's is generate/scheduler.py's Scheduler (each part's prompts handed to the
    scheduler's thread, which admits them as decode slots free up)."""

    max_batch: int  # records one part holds at most

    # room for the parts in flight (overlapped: several; serial: one), made now; returns how
    # many may be in flight at once
    def make_room(self, overlap: bool) -> int: ...

    # ids: the part's record ids, for an engine whose result depends on them (a generation
    # job's sampling stream); indices: their input ordinals, for an engine that keeps what
    # finished by them (a generation job's finished.jsonl); others ignore both
    def stage(self, fields: dict, n: int, lengths: dict, slot: int, ids=None,
              indices=None) -> Bucket: ...

    def launch(self, bucket: Bucket, slot: int, n: int, lengths: dict, *,
               stream=None) -> Launched: ...

    def run_rows(self, fields: dict, n: int, lengths: dict, ids=None,
                 indices=None) -> tuple[dict, list]: ...

    def current_stream(self): ...  # the stream launches go to (None: none of this thread's)

    def explain(self, exc: BaseException) -> str | None: ...  # the model's error's likely cause

    def device_context(self) -> ContextManager: ...


class Sink(Protocol):
    """Where outputs and rejects go (write.py's ShardWriter)."""

    def write(self, indices: np.ndarray, ids, outputs: dict, batch_start: int) -> None: ...

    def reject(self, index: int, id, where: str, reason: str) -> None: ...


class Batch(Protocol):
    """A record batch as read (records.py's RecordBatch)."""

    indices: np.ndarray
    ids: object
    fields: dict
    lengths: dict
    rejects: list


@dataclass
class Work:
    """One part of a record batch, handed from the stager to the launcher.

    kind: "graph" (staged in `slot` for `bucket`), "whole" (larger than every bucket with
    data.oversize eager or error: engine.run_rows decides) or "none" (rejects only)."""
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
    window: int | None = None  # data.group_by_length: its window's first ordinal
    window_end: bool = False  # the last part of its window: the window's outputs are written

