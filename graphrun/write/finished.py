"""finished.jsonl: a generation job's completions, kept as they finish until a committed shard
holds them, so that --resume takes them back instead of generating them again.

Completions finish out of input order: a freed slot takes the next prompt at once, and under
data.group_by_length a window's prompts run shortest first. A record is written only once
every record before it is (outputs stay in input order), so a finished completion may wait,
unwritten, for a longer one before it: under grouping, for most of its window. An interrupt
(a signal, kill -9, a crash) would lose what waits. Here each completion is appended as it
finishes and the file made durable every FLUSH_S, so an interrupt loses at most that much.

The file: a first line {"run": key} (the run's fingerprint with its input's and model's
hashes: job/state.RunResources.run_key), then a line per finished sample,
{"h": check, "e": {"i": input ordinal, "n": samples its record asked, "s": which sample,
"c": its fields}}, where check is sha256 of the key and the entry's bytes as written: a line
edited, damaged or copied from another run is left out.
A resumed run reads it back only where the key is its own (the same spec, input, model and
slice), takes back the records from where it reads on (ResumePoint.start) whose samples are
all there, and starts the file again with those. What lies below the last journal line's
read_from is dropped as shards commit: a resume never reads it again (the file is rewritten
once it holds more than twice what it keeps). A line torn by a crash is not valid JSON and is
left out: its record is generated again. A completed run removes the file.
"""

from __future__ import annotations

import hashlib
import json
import os
import threading
from collections import deque
from pathlib import Path
from typing import Callable

from graphrun.base.nofollow import open_file, read_own
from graphrun.write.journal import fsync_path

FINISHED = "finished.jsonl"
FINISHED_TMP = f".{FINISHED}.tmp"
FLUSH_S = 1.0  # how much of the finished completions an interrupt may lose, at most
_HEAD, _MID = b'{"h":"', b'","e":'
_CHECK = 32  # hex digits of a line's check
REWRITE_BYTES = 8 << 20  # below this the file is never rewritten to drop what it no longer keeps


class FinishedLog:
    """finished.jsonl of one run (see the module docstring). add() is called on the engine's
    thread as each sample finishes, take() on the launching thread; a thread of its own writes
    and fsyncs. A failure to read or write it (a full disk, a folder of that name) stops the
    keeping, not the run: `error` says why."""

    def __init__(self, out_dir: Path, run_key: Callable[[], str],
                 committed_from: Callable[[], int], *, flush_s: float = FLUSH_S):
        """run_key(): the run's key (may wait for the hashes: called on the log's thread);
        committed_from(): the ordinal a --resume would read from now (the writer's)."""
        self.path = Path(out_dir) / FINISHED
        self._run_key, self.committed_from = run_key, committed_from
        self._key: str | None = None
        self.flush_s = flush_s
        self.kept: dict[int, list[dict]] = {}  # taken back from an earlier attempt, by ordinal
        self.taken = 0  # records take() gave back
        self._given: set[int] = set()  # their ordinals, until given_among counts them
        self.error: BaseException | None = None
        self._pending: deque = deque()  # (ordinal, n, sample, fields) not yet written
        self._live: dict[int, list[bytes]] = {}  # the lines the file must keep, by ordinal
        self._live_bytes = 0
        self._file_bytes = 0
        self._f = None  # opened at the first write: the header needs the run's key
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @classmethod
    def open(cls, out_dir: Path, run_key: Callable[[], str], start: int,
             committed_from: Callable[[], int], *, flush_s: float = FLUSH_S) -> "FinishedLog":
        """The run's log, with what an earlier attempt of it kept from `start` on taken back
        (the file started again with those), and its thread started."""
        log = cls(out_dir, run_key, committed_from, flush_s=flush_s)
        if log.path.exists():
            log._read_back(start)
        log._thread = threading.Thread(target=log._run, name="graphrun-finished", daemon=True)
        log._thread.start()
        return log

    def _read_back(self, start: int) -> None:
        samples: dict[int, dict[int, dict]] = {}
        asked: dict[int, int] = {}
        lines: dict[int, list[bytes]] = {}
        try:
            raw = read_own(self.path).split(b"\n")
        except OSError as err:  # unreadable, a folder, a fifo: generated again, none kept
            self.error = err
            return
        if _parsed(raw[0]) == {"run": self.run_key()}:
            for line in raw[1:-1]:  # the piece after the last newline: empty, or torn
                got = self._checked(line)
                entry = _entry(got) if isinstance(got, dict) else None
                if entry is None or entry[0] < start:
                    continue
                i, n, s, fields = entry
                if asked.setdefault(i, n) != n:
                    continue
                samples.setdefault(i, {})[s] = fields
                lines.setdefault(i, []).append(line + b"\n")
        for i, got in samples.items():
            if len(got) == asked[i]:  # all its samples: taken back whole, else made again
                self.kept[i] = [got[s] for s in range(asked[i])]
                self._live[i] = lines[i]
                self._live_bytes += sum(map(len, lines[i]))
        if self.kept:
            self._guarded(self._rewrite)
        else:
            self.path.unlink()

    def run_key(self) -> str:
        if self._key is None:
            self._key = self._run_key()
        return self._key

    def _check(self, entry: bytes) -> bytes:
        return hashlib.sha256(self.run_key().encode() + entry).hexdigest()[:_CHECK].encode()

    def _line(self, entry: bytes) -> bytes:
        return _HEAD + self._check(entry) + _MID + entry + b"}\n"

    def _checked(self, line: bytes):
        """The entry of a line whose check holds, else None."""
        start = len(_HEAD) + _CHECK + len(_MID)
        if not (line.startswith(_HEAD) and line[len(_HEAD) + _CHECK:start] == _MID
                and line.endswith(b"}")):
            return None
        entry = line[start:-1]
        held = line[len(_HEAD):len(_HEAD) + _CHECK]
        return _parsed(entry) if held == self._check(entry) else None

    # -- the run's side ---------------------------------------------------------------------

    def take(self, ordinal: int, n: int) -> list[dict] | None:
        """The n samples' fields an earlier attempt kept for this record, else None."""
        got = self.kept.pop(ordinal, None)
        if got is None or len(got) != n:
            return None
        self.taken += 1
        self._given.add(ordinal)
        return got

    def given_among(self, ordinals, low: int = 0) -> int:
        """How many of these finished records (from `low` on) take() gave back: the progress
        leaves them out of its rate, as they took no time."""
        if not self._given:  # a run that took nothing back: no pass over every part's records
            return 0
        hit = [k for k in map(int, ordinals) if k in self._given]
        self._given.difference_update(hit)
        return sum(k >= low for k in hit)

    def add(self, ordinal: int, n: int, sample: int, fields: dict) -> None:
        """A sample of record `ordinal` (of n) finished: written within flush_s. Only a
        reference is taken here (the engine's thread): fields must not change afterwards."""
        if self.error is None:
            self._pending.append((ordinal, n, sample, fields))

    def close(self, completed: bool) -> None:
        """Stop the thread; a completed run's file is removed, any other's written out."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if not completed:
            self._guarded(self._flush)
        if self._f is not None:
            self._f.close()
            self._f = None
        if completed:
            for path in (self.path, self.path.with_name(FINISHED_TMP)):
                if path.is_file() and not path.is_symlink():  # never a folder or link there
                    path.unlink()

    # -- the log's thread -----------------------------------------------------------------------

    def _run(self) -> None:
        while not self._stop.wait(self.flush_s) and self.error is None:
            self._guarded(self._flush)

    def _guarded(self, step: Callable[[], None]) -> None:
        if self.error is not None:
            return
        try:
            step()
        except Exception as err:  # noqa: BLE001 - a full disk: the run goes on without it
            self.error = err
            self._pending.clear()

    def _flush(self) -> None:
        lines = []
        while self._pending:
            i, n, s, fields = self._pending.popleft()
            line = self._line(json.dumps({"i": i, "n": n, "s": s, "c": fields},
                                         separators=(",", ":")).encode())
            self._live.setdefault(i, []).append(line)
            self._live_bytes += len(line)
            lines.append(line)
        low = self.committed_from()
        for i in [i for i in self._live if i < low]:  # in a committed shard, or never read again
            self._live_bytes -= sum(map(len, self._live.pop(i)))
        if not lines:
            return
        if self._f is None and not self.path.exists():
            self._rewrite()  # its header first; the lines just taken are in _live
        elif self._file_bytes > max(REWRITE_BYTES, 2 * self._live_bytes):
            self._rewrite()
        else:
            self._append(b"".join(lines))

    def _append(self, data: bytes) -> None:
        if self._f is None:
            self._f = open_file(self.path, "ab")
        self._f.write(data)
        self._f.flush()
        os.fsync(self._f.fileno())
        self._file_bytes += len(data)

    def _rewrite(self) -> None:
        """The file replaced by its header and the lines it keeps, durably."""
        header = (json.dumps({"run": self.run_key()}) + "\n").encode()
        data = header + b"".join(line for lines in self._live.values() for line in lines)
        tmp = self.path.with_name(FINISHED_TMP)
        with open_file(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        if self._f is not None:
            self._f.close()
            self._f = None
        os.replace(tmp, self.path)
        fsync_path(self.path.parent)
        self._file_bytes = len(data)


def _parsed(line: bytes):
    try:
        return json.loads(line)
    except ValueError:
        return None


def _entry(got: dict) -> tuple[int, int, int, dict] | None:
    """(ordinal, samples, sample, fields) of a line, None where it is not one of these."""
    i, n, s, fields = got.get("i"), got.get("n"), got.get("s"), got.get("c")
    ints = (i, n, s)
    if not all(type(v) is int for v in ints) or not isinstance(fields, dict):
        return None
    return (i, n, s, fields) if i >= 0 and 0 <= s < n else None
