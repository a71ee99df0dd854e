"""The phase clock: a run's time from the process's start to its manifest, as named phases that
add up (the manifest's `phases` and totals.process_wall_s).

    clock = PhaseClock()
    with clock.active():                          # phase() below records into this clock
        with phase("model build"):
            with phase("weights load"):           # nested: counted once, here, not in the outer
                ...
        with phase("capture", part=("batch=8", 0)):   # also in the per-bucket breakdown

Time is attributed to the innermost open phase of the thread that activated the clock, so the
named phases never overlap; whatever no phase covers is "other". A phase opened whole=True keeps
the phases nested in it as its own time (they still count per bucket, `within` it): a bucket set
up mid-stream is one phase, not more warm-up and capture. Other threads (the reader, the
writer's committers, the stream's stager) run beside the main thread: their work is not a phase
of its own, only the main thread's waits for it are (the stream, the drain).
"""

from __future__ import annotations

import datetime as dt
import contextvars
import time
from contextlib import contextmanager, nullcontext
from typing import Iterator

OTHER = "other"
IMPORTS = "interpreter and imports"  # the CLI's clock: from the process's start to the run
LIBRARY_IMPORTS = "imports ({})"  # a model library's import (transformers, timm) in model build
BEFORE_RUN = "before run()"  # a clock made by run(): the Python API caller's own time
PART_PHASES = ("warm-up", "capture", "verify")  # per bucket and lane (BucketPhases)
FIRST_USE = "bucket setup on first use"  # capture.lazy: a bucket set up mid-stream, whole

# The clock of the run in progress on this thread: module code deep in setup (models/load.py,
# engine/capture.py) marks its phases without a clock passed through every signature.
_ACTIVE: contextvars.ContextVar["PhaseClock | None"] = contextvars.ContextVar(
    "graphrun_phase_clock", default=None)
_NO_PHASE = nullcontext()


def process_start() -> tuple[float, str]:
    """When this process started, on time.perf_counter()'s scale, and how that was found:
    "proc" (/proc/self/stat's start time against /proc/uptime, 10 ms ticks), "psutil" (its
    create_time, whole seconds of boot time), else "graphrun import" (graphrun's first clock:
    the interpreter's start and the imports before graphrun's are then not counted)."""
    now, epoch = time.perf_counter(), time.time()
    try:
        import os

        with open("/proc/self/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        with open("/proc/uptime") as f:
            uptime = float(f.read().split()[0])
        age = uptime - int(fields[19]) / os.sysconf("SC_CLK_TCK")  # field 22: starttime
        if 0 <= age < 1e7:
            return now - age, "proc"
    except (OSError, ValueError, IndexError):
        pass
    try:
        import psutil

        return now - max(0.0, epoch - psutil.Process().create_time()), "psutil"
    except (ImportError, OSError, AttributeError):
        return FIRST_CLOCK, "graphrun import"


FIRST_CLOCK = time.perf_counter()  # graphrun's first clock: the CLI imports this module first
PROCESS_T0, PROCESS_T0_HOW = process_start()


class PhaseClock:
    """Named phases of one run, from the process's start (PROCESS_T0) to end()."""

    def __init__(self, before: str = IMPORTS):
        """before: the name of the time from the process's start to this clock."""
        self.t0, self.t0_how = PROCESS_T0, PROCESS_T0_HOW
        self.created = time.perf_counter()
        self.totals: dict[str, float] = {before: self.created - self.t0}
        self.parts: dict[tuple[str, int], dict[str, float]] = {}  # (bucket, lane) -> phase -> s
        self.within: dict[tuple[str, int], str] = {}  # a part timed inside a whole phase: its name
        self.first_output: float | None = None  # when the first batch reached the writer
        self.ended: float | None = None
        # [name, entered, seconds of the phases nested in it, the whole phase it is in or is]
        self._stack: list[list] = []

    @contextmanager
    def active(self) -> Iterator["PhaseClock"]:
        """phase() records into this clock on this thread (nested runs restore the outer)."""
        token = _ACTIVE.set(self)
        try:
            yield self
        finally:
            _ACTIVE.reset(token)

    @contextmanager
    def phase(self, name: str, part: tuple[str, int] | None = None,
              whole: bool = False) -> Iterator[None]:
        """whole: the phases nested in this one are its time (recorded per part only)."""
        outer = self._stack[-1][3] if self._stack else None  # a whole phase around this one
        frame = [name, time.perf_counter(), 0.0, outer or (name if whole else None)]
        self._stack.append(frame)
        try:
            yield
        finally:
            spent = time.perf_counter() - frame[1]
            self._stack.pop()
            if self.ended is None:  # after the end (closing the runner): not the run's
                if outer is None:
                    self.totals[name] = self.totals.get(name, 0.0) + spent - frame[2]
                if part is not None:
                    mine = self.parts.setdefault(part, {})
                    mine[name] = mine.get(name, 0.0) + spent
                    if outer is not None:
                        self.within[part] = outer
            if self._stack and outer is None:
                self._stack[-1][2] += spent

    def output_handed(self) -> None:
        """The first batch's outputs handed to the writer (any thread: one assignment)."""
        if self.first_output is None:
            self.first_output = time.perf_counter()

    def end(self) -> float:
        """The run's end (the manifest's text complete); the seconds since the process began.
        The phases open now (manifest write, a caller's) are counted up to here."""
        now = time.perf_counter()
        inner = 0.0
        for k in range(len(self._stack) - 1, -1, -1):  # innermost first
            name, entered, nested, _ = self._stack[k]
            if k and self._stack[k - 1][3] is not None:  # inside a whole phase: its time
                continue
            self.totals[name] = self.totals.get(name, 0.0) + (now - entered) - nested - inner
            inner = now - entered
        self.ended = now
        return now - self.t0

    def elapsed(self) -> float:
        return (self.ended or time.perf_counter()) - self.t0

    def top(self) -> list[tuple[str, float]]:
        """(name, seconds) in the order first entered, then "other": they add up to
        elapsed()."""
        named = [(n, max(0.0, s)) for n, s in self.totals.items() if n != OTHER]
        rest = self.elapsed() - sum(s for _, s in named)
        return named + [(OTHER, max(0.0, rest))]

    def first_output_s(self) -> float | None:
        return None if self.first_output is None else self.first_output - self.t0


def phase(name: str, part: tuple[str, int] | None = None, whole: bool = False):
    """A phase of the active clock's run (a no-op outside a run, or on another thread)."""
    clock = _ACTIVE.get()
    return _NO_PHASE if clock is None else clock.phase(name, part, whole)


def utc_now() -> str:
    """The wall time a manifest records (started, finished_at): UTC, to the second."""
    return dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")
