"""The job's one progress bar, and how each worker ended.

Workers run quiet. Each rewrites a small file (workers/rank-K.progress: "<records> <state>")
at most every UPDATE_S, which costs nothing next to a batch; whoever watches the job (the
`--gpus` parent, or rank 0 under torchrun) sums them into one bar.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

from graphrun.base.nofollow import open_fd
from graphrun.job.progress import Progress
from graphrun.write.job_layout import (committed, log_file, manifest_since, progress_file, shares,
                                       worker_dir)

UPDATE_S = 0.2
WIDTH = 48  # the file's fixed size: rewritten in place, read whole


class ProgressFile:
    """A worker's side: advance() per batch finished (Progress's interface), end() when it
    ends."""

    def __init__(self, path: Path):
        self.path, self.done, self.shown = path, 0, 0.0
        self.fd: int | None = None

    def set_total(self, total: int | None) -> None:
        """The job's total is the watcher's (JobProgress), counted once for every worker."""

    def count_tokens(self, tokens) -> None:
        """A generation job's tokens/s: each worker's manifest has its own; the bar shows
        records."""

    def streaming(self) -> None:
        """The job's bar (JobProgress) times the rates."""

    def advance(self, n: int, taken_back: int = 0) -> None:
        # taken_back (read back from finished.jsonl): the job's bar does not tell them apart
        self.done += n
        now = time.monotonic()
        if now - self.shown >= UPDATE_S:
            self.shown = now
            self.write("running")

    def close(self) -> None:
        self.write("running")

    def end(self, state: str) -> None:
        """state: the run's status (completed, interrupted, failed)."""
        self.write(f"done {state}")
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None

    def write(self, state: str) -> None:
        if self.fd is None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self.fd = open_fd(self.path, os.O_WRONLY | os.O_CREAT)
        os.pwrite(self.fd, f"{self.done} {state}\n".encode().ljust(WIDTH), 0)


def read_progress(path: Path) -> tuple[int, str | None]:
    """(records read, "completed"/"interrupted"/"failed" once it ended, else None)."""
    try:
        parts = path.read_bytes()[:WIDTH].decode().split()
        count = int(parts[0])
    except (OSError, ValueError, IndexError, UnicodeDecodeError):
        return 0, None
    return count, parts[2] if len(parts) == 3 and parts[1] == "done" else None


class JobProgress:
    """One bar for the job: the records its workers read this attempt, of those left."""

    def __init__(self, top: Path, mark: dict, show: bool):

        cuts = shares(mark)
        self.paths = [progress_file(top, k) for k in range(len(cuts))]
        total = sum(stop - start for start, stop, _, _ in cuts)
        before = 0
        for k, (start, _, first, _) in enumerate(cuts):
            point = committed(top, k, start, first)
            before += point.rows + point.rejects if point else 0
        self.seen = [0] * len(cuts)
        self.bar = Progress(show, total=max(0, total - before))

    def poll(self) -> list[str | None]:
        """Advance the bar; each worker's end state (None while it runs)."""
        states = []
        for k, path in enumerate(self.paths):
            count, state = read_progress(path)
            if count > self.seen[k]:
                self.bar.advance(count - self.seen[k])
                self.seen[k] = count
            states.append(state)
        return states

    def close(self) -> None:
        self.poll()
        self.bar.close()


def outcome(top: Path, rank: int, rc: int | None, state: str | None, since: float,
            stopped: int = 0) -> tuple[str, str] | None:
    """None where the worker's manifest tells how it ended (it ended well, or wrote one this
    attempt); else (status, why) from its exit: killed by a signal, or ended before writing
    one. stopped: the signal the job was stopped with, if any."""
    if rc == 0 or state == "completed" or (state is not None and manifest_since(top, rank, since)):
        return None
    if rc is not None and rc != 0 and manifest_since(top, rank, since):
        return None
    if rc is not None and rc < 0:
        name = signal.Signals(-rc).name
        status = "interrupted" if stopped and -rc == stopped else "failed"
        return status, f"was killed by {name} (exit signal {-rc})"
    if stopped and rc == 128 + stopped:
        return "interrupted", f"stopped by {signal.Signals(stopped).name} before it streamed"
    why = f"exited with status {rc}" if rc is not None else "ended"
    return "failed", f"{why} before writing its manifest: {last_line(log_file(top, rank))}"


def last_line(path: Path) -> str:
    try:
        lines = [ln for ln in path.read_text(errors="replace").splitlines() if ln.strip()]
    except OSError:
        lines = []
    return lines[-1].strip() if lines else "its own output says why (torchrun's log)"
