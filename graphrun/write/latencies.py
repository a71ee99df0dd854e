"""latencies.jsonl: one line per batch (and per bucket run of a split batch), kept consistent
with the journal across a crash.

Lines are held in memory and written by one os.write each time the writer hands a shard to
its committer (ShardWriter.on_hand_over), before that shard can be journaled: so every batch
below a committed shard's re-read point has its line on disk (as the page cache holds it)
before the journal says so, and a kill -9 leaves no line of a committed batch unwritten and
none torn by a half-flushed buffer. --resume keeps the lines of batches below where it
re-reads, and the batches after it log again, numbered on from the kept lines.
"""

from __future__ import annotations

import json
import os
from graphrun.base.nofollow import open_fd, open_file, read_own
from pathlib import Path


class LatencyLog:
    """Append-only latencies.jsonl; write() buffers a line, flush() writes them all at once."""

    def __init__(self, path: Path, lines_before: int, *, append: bool):
        self.lines_before = lines_before  # kept from the run this one resumes
        self._lines: list[str] = []
        flags = os.O_WRONLY | os.O_CREAT | (os.O_APPEND if append else os.O_TRUNC)
        self._fd: int | None = open_fd(path, flags)

    def write(self, line: str) -> None:
        self._lines.append(line)

    def flush(self) -> None:
        if not self._lines or self._fd is None:
            return
        data = memoryview("".join(self._lines).encode())
        self._lines = []
        while data:
            data = data[os.write(self._fd, data):]

    def close(self) -> None:
        """Write what is buffered and close; the descriptor is closed even if the write fails
        (a full disk), and a second close does nothing."""
        if self._fd is None:
            return
        try:
            self.flush()
        finally:
            fd, self._fd = self._fd, None
            os.close(fd)


def open_latencies(path: Path, keep_below: int | None) -> LatencyLog:
    """latencies.jsonl for appending. On resume, only the lines of batches that start below
    `keep_below` (where reading restarts) are kept: the batches after it run again."""
    if keep_below is None or not path.exists():
        return LatencyLog(path, 0, append=False)
    kept = []
    for line in read_own(path).decode(errors="replace").splitlines():
        try:
            entry = json.loads(line)
            if entry.get("first", 0) < keep_below and entry.get("batch") == len(kept) + 1:
                kept.append(line + "\n")
        except (ValueError, AttributeError):  # a line torn by a crash of an older graphrun
            continue
    tmp = path.with_name(path.name + ".tmp")
    with open_file(tmp, "w") as f:
        f.write("".join(kept))
    tmp.replace(path)
    return LatencyLog(path, len(kept), append=True)
