"""Overlapped or serial: the stream taken in legs, and a trial that times both paths on it.

On a CPU neither of the feed's paths always wins (feed.py says why), so the stream can run in
legs (Cursor.take), each on the path an OverlapTrial picks, and the trial keeps the faster.
"""

from __future__ import annotations

import time
from typing import Iterable, Iterator

from graphrun.base import envs
from graphrun.base.errors import GraphrunError


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
    times faster: serial is the safe path, and a round is noisy (one has picked the path that
    was slower over whole runs; benchmarks/RESULTS.md). Every
    leg does real work: only the slower path's legs cost time (2 s in 64 s at the defaults).

    Legs end on time however slow a batch is: a leg cannot end inside a batch, and an
    overlapped leg also finishes the batches it has in flight, so its overlapped legs keep
    only as many in flight (leg_slots, from 2) as take a quarter of a leg by the latest
    serial leg's time a batch. Where a batch takes more than half a leg, the legs
    cannot time the two paths: serial (the safe path) runs to the end, and `reason` says so.
    """

    ORDER = (False, True, True, False, True, False, False, True)  # False: serial
    MIN_LEG_BATCHES = 2
    MAX_SLOTS = 16  # feed.SLOTS' most

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
        return max(2, min(self.MAX_SLOTS, int(self.leg_s / (4 * self.batch_s))))

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


def _covered_to(rb, start: int) -> int:
    """The last input ordinal a record batch accounts for (a record or a reject)."""
    last = start - 1
    if len(rb.indices):
        last = max(last, int(rb.indices[-1]))
    if rb.rejects:
        last = max(last, max(r.index for r in rb.rejects))
    return last


OVERLAP_ENV = "GRAPHRUN_OVERLAP"
MEASURE = "measure"
_OVERLAP_WORDS = {"on": True, "1": True, "true": True, "off": False, "0": False, "false": False,
                  MEASURE: MEASURE, "auto": None, "": None}


def overlap_choice(overlap: bool | str | None) -> bool | str | None:
    """The caller's choice, else GRAPHRUN_OVERLAP's; None: decide by the device."""
    if overlap is not None:
        if overlap not in (True, False, MEASURE):
            raise GraphrunError(f"overlap={overlap!r} is not one of True, False, "
                                f"{MEASURE!r}, None")
        return overlap
    word = envs.get(OVERLAP_ENV).lower()
    if word not in _OVERLAP_WORDS:
        raise GraphrunError(f"{OVERLAP_ENV}={envs.get(OVERLAP_ENV)!r} is not one of on, off, "
                            "measure, auto; set one of those or unset it")
    return _OVERLAP_WORDS[word]


def overlapped_path(trial: "OverlapTrial | None", overlapped: bool | None) -> bool | None:
    """The path the stream ran on; measured, the one its latest trial round chose (or,
    when the stream ended within the first round, the path of its last leg)."""
    if trial is None:
        return overlapped
    return trial.choice if trial.choice is not None else trial.last


def overlap_reason(trial: "OverlapTrial | None", overlapped: bool | None,
                   how: str | None) -> str | None:
    """What chose the stream's path, and why (manifest totals.overlap_reason)."""
    if trial is None:
        if overlapped is None:
            return None
        return f"{'overlapped' if overlapped else 'serial'}: {how}"
    if trial.reason:
        return f"{trial.reason} ({how}: measured)"
    return (f"the stream ended within the first trial round, on the "
            f"{'overlapped' if trial.last else 'serial'} path of its last leg "
            f"({how}: measured)")
