"""The output folder's bookkeeping: run.json, the crash-safe journal, and resume.

An output folder holds, besides the shards (see outputs/ for their names):

    run.json        the run's fingerprint ({"spec_sha256": ..., "input_sha256": ...}), written
                    when the folder is first prepared; --resume refuses a folder whose
                    fingerprint differs. The input is hashed beside setup, so a new run
                    first writes input_sha256 null, then the hash before it streams: a
                    run.json without the hash means nothing was committed.
    journal.jsonl   one line per committed shard, in shard order, appended (and fsynced) only
                    after the shard's files are fsynced and renamed into place and the rejects
                    below its next_index are durable (write.py commits off the writer's thread,
                    several shards at once, and keeps this order):
                    {"shard": k, "files": [{"path", "rows", "sha256", "bytes"}], "rows": total
                     rows so far, "next_index": input ordinal after the shard's last row,
                     "read_from": first ordinal of the batch holding that row,
                     "rejects_bytes": size of rejects.jsonl then, "rejects": its line count}
    rejects.jsonl   {"index", "id", "where", "reason"} per rejected record.

Resuming reads the last whole journal line: reading restarts at read_from (the start of the
batch that held the last committed row, so batching is as before; rows and rejects below
next_index are dropped as they come again), shard numbering at
k + 1, and rejects.jsonl is cut back to rejects_bytes, so nothing after the last commit is kept
and nothing before it is repeated.
"""

from __future__ import annotations

import fnmatch
import hashlib
import json
import os
import subprocess
import sys
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from graphrun.errors import InputError, OutputError

JOURNAL = "journal.jsonl"
REJECTS = "rejects.jsonl"
RUN_JSON = "run.json"
# Every name graphrun writes into an output folder; --overwrite removes these and nothing else.
OWN_PATTERNS = ("part-*", JOURNAL, REJECTS, "manifest.json", "latencies.jsonl", ".*.tmp",
                RUN_JSON)
SHARD_TEMPS = ".part-*.tmp"  # a shard being written (outputs/)


@dataclass(frozen=True)
class FileInfo:
    """One committed file; path is relative to the output folder."""

    path: str
    rows: int
    sha256: str
    bytes: int


@dataclass(frozen=True)
class ResumePoint:
    """Where a run stands after its last committed shard."""

    next_index: int  # input ordinal after the last committed record
    shard: int  # number of the next shard to write
    rows: int  # output rows committed
    rejects: int  # lines committed in rejects.jsonl
    rejects_bytes: int  # its committed size; anything past it is cut on resume
    files: list[FileInfo] = field(default_factory=list)  # every committed shard file
    # Where reading restarts: the first ordinal of the batch holding the last committed row,
    # so the records after it are batched (and padded to buckets) exactly as before, and a
    # resumed run's outputs are bit-identical to an uninterrupted one. Rows and rejects below
    # next_index that this re-reads are dropped by the writer.
    read_from: int | None = None

    @property
    def start(self) -> int:
        return self.next_index if self.read_from is None else self.read_from


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()


class InputHash:
    """sha256 of the input file, computed by a child process beside setup (about as long as a
    model's setup for a GB), not after it. In a thread of this process it
    would take the GIL from the runner's and reader's threads now and then. result() waits
    for it; stop() abandons it (a run that failed in setup needs no hash)."""

    # sha256_file's loop, standalone: the child runs isolated (-I), where graphrun may not be
    # importable (a checkout on PYTHONPATH, as on the GPU machine)
    CHILD = ("import hashlib, sys\n"
             "h = hashlib.sha256()\n"
             "with open(sys.argv[1], 'rb') as f:\n"
             "    while chunk := f.read(1 << 20):\n"
             "        h.update(chunk)\n"
             "print(h.hexdigest())\n")

    def __init__(self, path: Path):
        self.path = path
        self.waited_s = 0.0  # how long callers waited in result()
        self._digest: str | None = None
        self._error: BaseException | None = None
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._proc: subprocess.Popen | None = None
        self._thread = threading.Thread(target=self._hash, name="graphrun-input-hash",
                                        daemon=True)
        self._thread.start()

    def _hash(self) -> None:
        try:
            if not sys.executable:  # embedded without an interpreter to start: hash here
                self._digest = sha256_file(self.path)
                return
            with self._lock:
                if self._stop.is_set():
                    return
                self._proc = subprocess.Popen(
                    [sys.executable, "-I", "-c", self.CHILD, str(self.path)],
                    stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                    text=True)
            out, err = self._proc.communicate()
            if self._stop.is_set():
                return
            if self._proc.returncode != 0:
                lines = err.strip().splitlines()
                raise OSError(lines[-1] if lines else f"exit status {self._proc.returncode}")
            self._digest = out.strip()
        except BaseException as err:  # noqa: BLE001 - raised by result()
            self._error = err

    def done(self) -> bool:
        return not self._thread.is_alive()

    def result(self) -> str:
        t0 = time.perf_counter()
        self._thread.join()
        self.waited_s += time.perf_counter() - t0
        if self._error is not None:
            raise InputError(f"cannot read the input file to hash it (for --resume's check "
                             f"that it did not change): {self._error}; check that it is "
                             "readable, then run again", where=str(self.path)) from self._error
        if self._digest is None:
            raise OutputError(f"the input file {self.path} was not hashed (stopped)")
        return self._digest

    def stop(self) -> str | None:
        """The hash if it is done, else None, the hashing stopped and its thread joined."""
        with self._lock:
            if not self.done():
                self._stop.set()
                if self._proc is not None and self._proc.poll() is None:
                    self._proc.kill()
        self._thread.join()
        return self._digest


def fsync_path(path: Path) -> None:
    """fsync by name: a file's data, whichever handle wrote it; a folder's renames and new
    names (a file's fsync does not cover its name)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def append_durably(path: Path, data: bytes) -> None:
    """Append and fsync; a crash leaves either the old file or the old file plus a torn tail."""
    created = not path.exists()
    with open(path, "ab") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    if created:
        fsync_path(path.parent)


def truncate_durably(path: Path, size: int) -> None:
    with open(path, "r+b") as f:
        f.truncate(size)
        os.fsync(f.fileno())


def cut_torn_tail(path: Path) -> None:
    """Drop a journal line torn by a crash mid-append, so the next line starts on its own."""
    if path.exists():
        data = path.read_bytes()
        if data and not data.endswith(b"\n"):
            truncate_durably(path, data.rfind(b"\n") + 1)


def append_journal(out_dir: Path, shard: int, files: list[FileInfo], rows: int,
                   next_index: int, rejects_bytes: int, rejects: int, read_from: int) -> None:
    line = {"shard": shard, "files": [asdict(f) for f in files], "rows": rows,
            "next_index": next_index, "read_from": read_from,
            "rejects_bytes": rejects_bytes, "rejects": rejects}
    append_durably(out_dir / JOURNAL, (json.dumps(line) + "\n").encode())


def read_journal(out_dir: Path) -> ResumePoint | None:
    """The point after the last whole journal line, or None when nothing was committed."""
    path = Path(out_dir) / JOURNAL
    if not path.exists():
        return None
    point = None
    files: list[FileInfo] = []
    # The piece after the last newline is empty, or a line torn by a crash mid-append.
    for number, raw in enumerate(path.read_bytes().split(b"\n")[:-1], 1):
        try:
            line = json.loads(raw)
            files += [FileInfo(**f) for f in line["files"]]
            point = ResumePoint(next_index=line["next_index"], shard=line["shard"] + 1,
                                rows=line["rows"], rejects=line["rejects"],
                                rejects_bytes=line["rejects_bytes"], files=files,
                                read_from=line.get("read_from"))
        except (ValueError, KeyError, TypeError) as e:
            raise OutputError(f"{path}:{number} is not a journal line ({e!r}); the folder "
                              "cannot be resumed; rerun with --overwrite") from None
    return point


def check_fresh(out_dir: Path) -> None:
    """A new writer must not mix its shards with another run's; prepare_out_dir clears those."""
    out_dir.mkdir(parents=True, exist_ok=True)
    stale = sorted(p.name for p in out_dir.iterdir()
                   if p.name in (JOURNAL, REJECTS) or fnmatch.fnmatchcase(p.name, "part-*"))
    if stale:
        raise OutputError(f"output folder {out_dir} already holds {_names(stale)}; pass --resume "
                          "to continue that run or --overwrite to replace it")
    _remove(out_dir, list(out_dir.glob(SHARD_TEMPS)))


def restore(out_dir: Path, point: ResumePoint) -> None:
    """Put the folder back to `point`: check the committed files, drop everything after."""
    for info in point.files:
        path = out_dir / info.path
        if not path.is_file():
            raise OutputError(f"cannot resume {out_dir}: {info.path} is listed in {JOURNAL} but "
                              "missing; rerun with --overwrite")
        if path.stat().st_size != info.bytes or sha256_file(path) != info.sha256:
            raise OutputError(f"cannot resume {out_dir}: {info.path} differs from what {JOURNAL} "
                              "recorded (sha256); rerun with --overwrite")
    # A shard renamed into place whose journal line never landed is not part of the run.
    listed = {info.path for info in point.files}
    _remove(out_dir, [p for p in out_dir.glob("part-*") if p.name not in listed]
            + list(out_dir.glob(SHARD_TEMPS)))
    rejects = out_dir / REJECTS
    have = rejects.stat().st_size if rejects.exists() else 0
    if have < point.rejects_bytes:
        raise OutputError(f"cannot resume {out_dir}: {REJECTS} holds {have} bytes but {JOURNAL} "
                          f"recorded {point.rejects_bytes}; rerun with --overwrite")
    if rejects.exists():
        truncate_durably(rejects, point.rejects_bytes)  # rejects past the last commit come again
    cut_torn_tail(out_dir / JOURNAL)


def is_own(name: str) -> bool:
    return any(fnmatch.fnmatchcase(name, p) for p in OWN_PATTERNS)


def prepare_out_dir(out_dir: Path, *, resume: bool, overwrite: bool,
                    fingerprint: dict) -> ResumePoint | None:
    """Make `out_dir` ready for a run; return where to resume, or None to start from record 0.

    A new or empty folder is used as is. Otherwise: --overwrite replaces graphrun's own files
    (never others'); --resume continues the run there if its fingerprint matches; a plain run
    is refused, unless the run there ended (failed or interrupted) before committing anything."""
    out_dir = Path(out_dir)
    if resume and overwrite:
        raise OutputError("--resume and --overwrite exclude each other; pass one of them")
    if not out_dir.exists() or not any(out_dir.iterdir()):
        _start(out_dir, fingerprint)
        return None
    own, foreign = _split_entries(out_dir)
    if overwrite:
        if foreign:
            raise OutputError(f"output folder {out_dir} holds files graphrun did not write "
                              f"({_names(foreign)}); refusing to --overwrite it: move them away "
                              "or pick another output folder")
        _remove(out_dir, own)
        _start(out_dir, fingerprint)
        return None
    if not resume:
        if not own:
            raise OutputError(f"output folder {out_dir} is not empty ({_names(foreign)}); "
                              "pick a new or empty folder")
        if not foreign and _ended_with_nothing_committed(out_dir):
            # An earlier attempt failed (e.g. at setup) or was stopped before its first commit:
            # nothing here is worth protecting or resuming, and sending the user to --resume
            # (refused once the spec is fixed) or --overwrite helps nobody. Start over in it.
            _remove(out_dir, own)
            _start(out_dir, fingerprint)
            return None
        raise OutputError(f"output folder {out_dir} exists and holds a run; pass --resume to "
                          "continue it or --overwrite to replace it")
    _check_fingerprint(out_dir, fingerprint)
    point = read_journal(out_dir)
    if point is None:
        # Nothing was committed: whatever the earlier attempt left is incomplete.
        _remove(out_dir, [p for p in own if p.name != RUN_JSON])
        write_fingerprint(out_dir, fingerprint)
    return point


def _start(out_dir: Path, fingerprint: dict) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    write_fingerprint(out_dir, fingerprint)


def write_fingerprint(out_dir: Path, fingerprint: dict) -> None:
    """run.json, replaced durably (the input's hash is added once it is known)."""
    tmp = out_dir / f".{RUN_JSON}.tmp"
    with open(tmp, "w") as f:
        json.dump(fingerprint, f, indent=2, sort_keys=True)
        f.write("\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, out_dir / RUN_JSON)
    fsync_path(out_dir)


def _ended_with_nothing_committed(out_dir: Path) -> bool:
    """The last attempt ended (its manifest says failed or interrupted) and never committed a
    shard (no whole journal line). Without a manifest the folder may belong to a run still in
    setup, and a completed run whose every record was rejected has rejects but no journal:
    both are kept."""
    if read_journal(out_dir) is not None:
        return False
    try:
        status = json.loads((out_dir / "manifest.json").read_text()).get("status")
    except (OSError, ValueError, AttributeError):
        return False  # absent or unreadable: keep refusing rather than guess
    return status in ("failed", "interrupted")


def _split_entries(out_dir: Path) -> tuple[list[Path], list[Path]]:
    own, foreign = [], []
    for p in sorted(out_dir.iterdir()):
        (own if p.is_file() and is_own(p.name) else foreign).append(p)
    return own, foreign


def _names(paths: list, shown: int = 5) -> str:
    text = ", ".join(Path(p).name for p in paths[:shown])
    return text + (f" and {len(paths) - shown} more" if len(paths) > shown else "")


def _remove(out_dir: Path, paths: list[Path]) -> None:
    for p in paths:
        p.unlink()
    fsync_path(out_dir)


def _check_fingerprint(out_dir: Path, fingerprint: dict) -> None:
    path = out_dir / RUN_JSON
    if not path.exists():
        raise OutputError(f"output folder {out_dir} has no {RUN_JSON}, so it cannot be resumed; "
                          "rerun with --overwrite to replace it")
    try:
        before = json.loads(path.read_text())
    except ValueError as e:
        raise OutputError(f"{path} is not JSON ({e}); rerun with --overwrite") from None
    now = json.loads(json.dumps(fingerprint))  # compare as stored: tuples become lists
    if before.get("input_sha256", "") is None and read_journal(out_dir) is None:
        before["input_sha256"] = now.get("input_sha256")  # never hashed, nothing committed
    changed = [_change(k, before.get(k), now.get(k))
               for k in sorted(set(before) | set(now)) if before.get(k) != now.get(k)]
    if changed:
        raise OutputError(f"cannot resume {out_dir}: it holds a different run ("
                          + "; ".join(changed) + "); rerun with --overwrite to start over, or "
                          "pick another output folder")


def _change(key: str, was, now) -> str:
    def short(v):
        return "absent" if v is None else repr(v[:12] + "..." if isinstance(v, str)
                                               and len(v) > 16 else v)
    return f"{key} changed (was {short(was)}, now {short(now)})"
