"""The output folder's bookkeeping: run.json, the crash-safe journal, and resume.

An output folder holds, besides the shards (see sinks/ for their names):

    run.json        the run's fingerprint ({"spec_sha256", "input_sha256", "model_sha256":
                    {role: sha256} of its files, "slice", "shards": the shard file
                    suffixes}), written when the folder is first prepared; it also marks the
                    folder as graphrun's (folder.py). --resume refuses a folder whose
                    fingerprint differs. Input and model are hashed beside setup, so a new run
                    first writes their hashes null, then the hashes before it streams: a
                    run.json without them means nothing was committed.
    journal.jsonl   one line per committed shard, in shard order, appended (and fsynced) only
                    after the shard's files are fsynced and renamed into place and the rejects
                    below its next_index are durable (write.py commits off the writer's thread,
                    several shards at once, and keeps this order):
                    {"shard": k, "files": [{"path", "rows", "sha256", "bytes"}], "rows": total
                     rows so far, "next_index": input ordinal after the shard's last row,
                     "read_from": first ordinal of the batch holding that row,
                     "rejects_bytes": size of rejects.jsonl then, "rejects": its line count,
                     "rejects_sha256": of those bytes (absent, or null, in older journals),
                     "sha256": of this line's fields and the previous line's sha256}
                    A shard still open when output.commit_interval_s passed is committed as it
                    stands by a line with "open": true, whose files are its temp files (their
                    first "bytes" hold its rows so far: sinks' checkpoint()); later lines
                    of the same shard, open or whole, replace it.
    rejects.jsonl   {"index", "id", "where", "reason"} per rejected record.

Resuming reads the last whole journal line: reading restarts at read_from (the start of the
batch that held the last committed row, so batching is as before; rows and rejects below
next_index are dropped as they come again), shard numbering at
k + 1, and rejects.jsonl is cut back to rejects_bytes, so nothing after the last commit is kept
and nothing before it is repeated. After an open line, the shard's temp files are cut back to
their committed bytes and its sink reopens them, so the shard is written on to the same bytes
as a run never interrupted; temp files that no longer hold those bytes (a crash while the
shard was completed) put the point back to the shard's start. Every line is verified first
(journal_line): its checksum chain, shard numbers without a gap (a job's worker starts at its share's first shard, and
its shards sit in the job's folder: job_layout.py), row counts, next_index = first + rows +
rejects.
"""

from __future__ import annotations

import hashlib
import inspect
import json
import os
import re
import shutil
import subprocess
import sys
import threading
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

from graphrun.base.digest import file_sha256
from graphrun.base.errors import InputError, OutputError
from graphrun.write import digests
from graphrun.write.guard import check_rejects_sha256, file_differs, refuse_foreign
from graphrun.write.strict_json import strict_dumps
from graphrun.base.nofollow import open_file, read_own
from graphrun.base.tuning import Tuning

JOURNAL = "journal.jsonl"
REJECTS = "rejects.jsonl"
RUN_JSON = "run.json"
# run.json's copy of the resolved spec: never compared (spec_sha256 is), read to name the keys
# a refused --resume changed, even where no manifest was written (kill -9)
SPEC_COPY = "spec"
_SHARD = re.compile(r"(\.?)part-(\d{5,})\.(.+?)(\.rows)?(\.tmp)?")


def reject_line(index: int, rid, where: str, reason: str) -> str:
    """One line of rejects.jsonl (no newline), strict JSON whatever the record's id held
    (write/strict_json.py)."""
    return strict_dumps({"index": int(index), "id": rid, "where": where, "reason": reason})


def shard_number(name: str, suffixes: list[str], *, temp: bool | None = None) -> int | None:
    """The shard a file name belongs to, if it is exactly one of the format's names
    (`part-00003.<suffix>`, or `.part-00003.<suffix>.tmp` while written, and
    `.part-00003.<suffix>.rows.tmp`, what a sink keeps to reopen an open shard); else None."""
    m = _SHARD.fullmatch(name)
    if m is None or m.group(3) not in suffixes or bool(m.group(1)) != bool(m.group(5)):
        return None
    if m.group(4) and not m.group(5) or temp is not None and bool(m.group(5)) != temp:
        return None
    return int(m.group(2))


@dataclass(frozen=True)
class FileInfo:
    """One committed file; path is relative to the output folder."""

    path: str
    rows: int
    sha256: str
    bytes: int


@dataclass(frozen=True)
class ShardPlace:
    """Where a worker of a job (scale/) puts its shards: the job's folder, not its own (which
    holds its journal and rejects), numbered from `first` and below `end`, the numbers its share
    may use; a one-process run has none."""

    folder: Path
    first: int = 0
    end: int | None = None
    job_start: int = 0  # the job's first input ordinal: ids from there on count as seen
    job_stop: int | None = None  # the ordinal the job stops before (None: the input's end)

    def holds(self, number: int | None) -> bool:
        return number is not None and self.first <= number < (self.end if self.end is not None
                                                                else number + 1)


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
    digest: str = ""  # the last journal line's checksum; the next line's chains on it
    rejects_sha256: str | None = None  # of rejects.jsonl's committed bytes; None: not recorded
    journal_bytes: int = 0  # journal.jsonl's size through this point's last line
    open: OpenShard | None = None  # the shard `shard` as an open line committed it

    @property
    def start(self) -> int:
        return self.next_index if self.read_from is None else self.read_from


@dataclass(frozen=True)
class OpenShard:
    """A shard committed as it stood, still open: its temp files' first bytes hold its rows."""

    files: list[FileInfo]  # its temp files: the rows so far, sha256 and size of those bytes
    rows: int
    base: ResumePoint  # the point before its first open line: where it restarts without them


def sha256_file(path: Path) -> str:
    return file_sha256(path).hexdigest()


class InputHash:
    """sha256 of the input file, computed by a child process beside setup (about as long as a
    model's setup for a GB), not after it. In a thread of this process it
    would take the GIL from the runner's and reader's threads now and then. result() waits
    for it; stop() abandons it (a run that failed in setup needs no hash)."""

    # base/digest.py's source: the child runs isolated (-I), where graphrun may not be
    # importable (a checkout on PYTHONPATH, as on the GPU machine)
    CHILD = (inspect.getsource(inspect.getmodule(file_sha256)) +
             "\nimport sys\nprint(file_sha256(sys.argv[1]).hexdigest())\n")

    def __init__(self, path: Path, keep_bytes: int = Tuning.hash_keep_bytes):
        """keep_bytes: from this size the digest is kept between runs (digests.py)."""
        self.path, self.keep_bytes = path, keep_bytes
        self.waited_s = 0.0  # how long callers waited in result()
        # where the digest came from: "cache" (kept from an earlier run, digests.py), "read"
        # (the file read and hashed), None while not known
        self.source: str | None = None
        self._digest: str | None = None
        self._error: BaseException | None = None
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._proc: subprocess.Popen | None = None
        # set when _hash returns: what result() and stop() wait for, not Thread.join, which
        # Python 3.11 leaves marking a live thread as ended when a signal handler's
        # KeyboardInterrupt cuts it short (stop() would then leave the child hashing)
        self._finished = threading.Event()
        self._thread = threading.Thread(target=self._run, name="graphrun-input-hash",
                                        daemon=True)
        self._thread.start()

    def _hash(self) -> None:
        try:
            # a large file unchanged since it was hashed: its digest, not its bytes read again
            key = digests.stat_key(self.path, self.keep_bytes)
            self._digest = digests.known(key)
            if self._digest is not None:
                self.source = "cache"
                return
            if not sys.executable:  # embedded without an interpreter to start: hash here
                self._digest = sha256_file(self.path)
                self.source = "read"
                digests.keep(self.path, key, self._digest)
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
            self.source = "read"
            digests.keep(self.path, key, self._digest)
        except BaseException as err:  # noqa: BLE001 - raised by result()
            self._error = err

    def _run(self) -> None:
        try:
            self._hash()
        finally:
            self._finished.set()

    def done(self) -> bool:
        return self._finished.is_set()

    def result(self) -> str:
        t0 = time.perf_counter()
        self._finished.wait()
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
        self._finished.wait()
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
    with open_file(path, "ab") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    if created:
        fsync_path(path.parent)


def truncate_durably(path: Path, size: int) -> None:
    with open_file(path, "r+b") as f:
        f.truncate(size)
        os.fsync(f.fileno())


def cut_torn_tail(path: Path) -> None:
    """Drop a journal line torn by a crash mid-append, so the next line starts on its own."""
    if path.exists():
        data = read_own(path)
        if data and not data.endswith(b"\n"):
            truncate_durably(path, data.rfind(b"\n") + 1)


def line_digest(prev: str, line: dict) -> str:
    """A journal line's checksum: sha256 of the previous line's and this line's fields, so a
    line edited, dropped, repeated or appended by hand breaks the chain."""
    body = json.dumps({k: v for k, v in line.items() if k != "sha256"}, sort_keys=True)
    return hashlib.sha256((prev + body).encode()).hexdigest()


def append_journal(out_dir: Path, shard: int, files: list[FileInfo], rows: int,
                   next_index: int, rejects_bytes: int, rejects: int, read_from: int,
                   prev: str = "", rejects_sha256: str | None = None,
                   open_shard: bool = False) -> str:
    """Append a shard's line (durably); returns its checksum, for the next line's `prev`.
    open_shard: the shard is committed as it stands and stays open (files: its temp files)."""
    line = {"shard": shard, "files": [asdict(f) for f in files], "rows": rows,
            "next_index": next_index, "read_from": read_from,
            "rejects_bytes": rejects_bytes, "rejects": rejects, "rejects_sha256": rejects_sha256}
    if open_shard:
        line["open"] = True
    line["sha256"] = line_digest(prev, line)
    append_durably(out_dir / JOURNAL, (json.dumps(line) + "\n").encode())
    return line["sha256"]


def read_journal(out_dir: Path, first: int = 0, first_shard: int = 0,
                 shard_dir: Path | None = None) -> ResumePoint | None:
    """The point after the last whole journal line, or None when nothing was committed.
    Every line is checked (journal_line): its checksum, and that it continues the one
    before; first is the run's first input ordinal (its slice's start), first_shard its first
    shard number (a worker's share of a job starts past the shards of the shares before it).
    An open shard whose temp files (in shard_dir, default out_dir) no longer hold what its
    line committed is left out: the point is the one before it."""
    path = Path(out_dir) / JOURNAL
    if not path.exists():
        return None
    point = ResumePoint(next_index=first, shard=first_shard, rows=0, rejects=0, rejects_bytes=0)
    # The piece after the last newline is empty, or a line torn by a crash mid-append.
    for number, raw in enumerate(read_own(path).split(b"\n")[:-1], 1):
        try:
            point = journal_line(json.loads(raw), point, first)
        except (ValueError, KeyError, TypeError, AttributeError) as e:
            why = str(e) if isinstance(e, ValueError) and str(e) else repr(e)
            raise OutputError(f"{path}:{number} is not a journal line graphrun wrote ({why}); "
                              "the folder cannot be resumed; rerun with --overwrite") from None
        point = replace(point, journal_bytes=point.journal_bytes + len(raw) + 1)
    if point.open is not None and not open_files_hold(point.open, Path(shard_dir or out_dir)):
        point = point.open.base
    return point if point.shard > first_shard or point.open is not None else None


def open_files_hold(shard: OpenShard, folder: Path) -> bool:
    """Whether an open shard's temp files still begin with the bytes its line committed."""
    for info in shard.files:
        path = folder / info.path
        try:
            if path.stat().st_size < info.bytes or prefix_sha256(path, info.bytes) != info.sha256:
                return False
        except OSError:
            return False
    return True


class PrefixDigest:
    """sha256 of a growing file's first bytes, read on from where the last call stopped (a
    shard's open lines each commit a longer prefix of the same temp files)."""

    def __init__(self):
        self.hash, self.done = hashlib.sha256(), 0

    def upto(self, path: Path, size: int) -> str:
        with open(path, "rb") as f:
            f.seek(self.done)
            while self.done < size:
                chunk = f.read(min(1 << 20, size - self.done))
                if not chunk:
                    raise OSError(f"{path} ends at {self.done} bytes, before {size}")
                self.hash.update(chunk)
                self.done += len(chunk)
        return self.hash.hexdigest()


def prefix_sha256(path: Path, size: int) -> str:
    return PrefixDigest().upto(path, size)


def journal_line(line: dict, before: ResumePoint, first: int) -> ResumePoint:
    """The point after `line`, checked against the point before it; ValueError says why not."""
    if line.get("sha256") != line_digest(before.digest, line):
        raise ValueError("its checksum does not match: edited, reordered or not graphrun's")
    is_open = line.get("open", False)
    if is_open is not True and "open" in line:
        raise ValueError("its 'open' is not true")
    base = before.open.base if before.open is not None else before
    files = [FileInfo(**f) for f in line["files"]]
    ints = [line[k] for k in ("shard", "rows", "next_index", "read_from", "rejects",
                              "rejects_bytes")] + [v for f in files for v in (f.rows, f.bytes)]
    if not all(type(v) is int and v >= 0 for v in ints):
        raise ValueError("a count is not a whole number")
    if line["shard"] != before.shard:
        raise ValueError(f"shard {line['shard']} where shard {before.shard} comes next")
    rows = line["rows"] - base.rows
    # a shard of no rows is one that holds rejected records' lines only (an OpenAI Batch
    # output's error lines): it adds rejects
    empty_ok = rows == 0 and line["rejects"] > base.rejects and all(f.bytes for f in files)
    if not files or any(f.rows != rows for f in files) or (rows <= 0 and not empty_ok):
        raise ValueError(f"its files do not hold the {rows} rows it adds")
    if before.open is not None and rows < before.open.rows + is_open:
        raise ValueError(f"it holds {rows} rows of shard {before.shard}, where an open line "
                         f"committed {before.open.rows}")
    if any(shard_number(f.path, [_suffix(f.path)], temp=is_open) != before.shard for f in files):
        raise ValueError(f"its files are not named as shard {before.shard}'s")
    if line["rejects"] < before.rejects or line["rejects_bytes"] < before.rejects_bytes:
        raise ValueError("its rejects count backwards")
    if line["next_index"] != first + line["rows"] + line["rejects"]:
        raise ValueError(f"next_index {line['next_index']} is not the run's first record "
                         f"{first} + its {line['rows']} rows + {line['rejects']} rejects")
    if not (before.start <= line["read_from"] <= line["next_index"]):
        raise ValueError(f"read_from {line['read_from']} is outside {before.start}.."
                         f"{line['next_index']}")
    return ResumePoint(next_index=line["next_index"], shard=line["shard"] + (not is_open),
                       rows=line["rows"], rejects=line["rejects"],
                       rejects_bytes=line["rejects_bytes"],
                       files=base.files + ([] if is_open else files), read_from=line["read_from"],
                       digest=line["sha256"], rejects_sha256=line.get("rejects_sha256"),
                       journal_bytes=before.journal_bytes,
                       open=OpenShard(files, rows, base) if is_open else None)


def _suffix(name: str) -> str:
    """What a shard file's name has after `part-NNNNN.` (its .rows/.tmp ends left out)."""
    m = _SHARD.fullmatch(name)
    return m.group(3) if m else ""


def journal_names(out_dir: Path) -> tuple[set[str], int]:
    """(the file names the journal lists, the first shard it does not), read leniently: for
    --overwrite, which removes them, a journal that fails read_journal's checks still names
    graphrun's files (only plain shard names are taken: never a path)."""
    names: set[str] = set()
    shards = 0
    try:
        raw = read_own(Path(out_dir) / JOURNAL).split(b"\n")[:-1]
    except OSError:
        return names, 0
    for line in raw:
        try:
            entry = json.loads(line)
            for f in entry["files"]:
                if shard_number(f["path"], [f["path"].split(".", 1)[-1]]) is not None:
                    names.add(f["path"])
            # an open shard's temp files are taken as those of a shard past the journal's
            shards = max(shards, int(entry["shard"]) + (entry.get("open") is not True))
        except (ValueError, KeyError, TypeError, AttributeError):
            continue
    return names, shards


def check_fresh(out_dir: Path, suffixes: list[str]) -> None:
    """A new writer must not mix its shards with another run's; prepare_out_dir clears those.
    suffixes: the format's shard file suffixes (outputs.shard_suffixes)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    stale = sorted(p.name for p in out_dir.iterdir()
                   if p.name in (JOURNAL, REJECTS) or shard_number(p.name, suffixes, temp=False)
                   is not None)
    if stale:
        raise OutputError(f"output folder {out_dir} already holds {listed_names(stale)}; pass "
                          "--resume to continue that run or --overwrite to replace it")
    temps = [p for p in out_dir.iterdir() if shard_number(p.name, suffixes, temp=True) is not None]
    remove_and_sync(out_dir, refuse_foreign(out_dir, temps))


def restore(out_dir: Path, point: ResumePoint, suffixes: list[str],
            place: ShardPlace | None = None) -> None:
    """Put the folder back to `point`: check the committed files, drop everything after. A
    worker's shards are in place.folder, and only its own numbers (below place.end) are its."""
    shard_dir = place.folder if place else out_dir
    after = ShardPlace(shard_dir, point.shard, place.end if place else None)
    check_committed(out_dir, point, hashes=True, shard_dir=shard_dir)
    # A shard renamed into place whose journal line never landed is not part of the run, nor
    # are temp files; their names are exactly the format's, numbered from the next shard. An
    # open shard's committed temp files are kept, cut back to the bytes its line committed.
    kept = {f.path: f.bytes for f in point.open.files} if point.open is not None else {}
    leftovers = [p for p in shard_dir.iterdir()
                 if after.holds(shard_number(p.name, suffixes)) and p.name not in kept]
    remove_and_sync(shard_dir, refuse_foreign(shard_dir, leftovers))
    for name, size in kept.items():
        truncate_durably(shard_dir / name, size)
    rejects = out_dir / REJECTS
    if rejects.exists():
        truncate_durably(rejects, point.rejects_bytes)  # rejects past the last commit come again
    journal = out_dir / JOURNAL
    if point.journal_bytes and journal.stat().st_size > point.journal_bytes:
        truncate_durably(journal, point.journal_bytes)  # lines of an open shard left out
    cut_torn_tail(journal)


def check_committed(out_dir: Path, point: ResumePoint, *, hashes: bool,
                    shard_dir: Path | None = None) -> None:
    """The files the journal lists are there (in shard_dir, default out_dir), of their size
    (and sha256, with hashes), and rejects.jsonl holds the rejects it recorded (and, with
    hashes, their sha256 where the journal has it); else OutputError naming the file."""
    for info in point.files:
        path = (shard_dir or out_dir) / info.path
        if not path.is_file():
            raise OutputError(f"cannot resume {out_dir}: {info.path} is listed in {JOURNAL} but "
                              "missing; rerun with --overwrite")
        size = path.stat().st_size
        if size != info.bytes or (hashes and sha256_file(path) != info.sha256):
            raise OutputError(file_differs(out_dir, path, size, info.bytes, JOURNAL))
    rejects = out_dir / REJECTS
    have = rejects.stat().st_size if rejects.exists() else 0
    if have < point.rejects_bytes:
        raise OutputError(f"cannot resume {out_dir}: {REJECTS} holds {have} bytes but {JOURNAL} "
                          f"recorded {point.rejects_bytes}; rerun with --overwrite")
    if point.rejects_bytes:
        with open(rejects, "rb") as f:
            lines = f.read(point.rejects_bytes).count(b"\n")
        if lines != point.rejects:
            raise OutputError(f"cannot resume {out_dir}: {REJECTS} holds {lines} rejects where "
                              f"{JOURNAL} recorded {point.rejects}; rerun with --overwrite")
        check_rejects_sha256(out_dir, rejects, point.rejects_bytes, point.rejects,
                             point.rejects_sha256 if hashes else None, JOURNAL)


def listed_names(paths: list, shown: int = 5) -> str:
    text = ", ".join(Path(p).name for p in paths[:shown])
    return text + (f" and {len(paths) - shown} more" if len(paths) > shown else "")


def remove_and_sync(out_dir: Path, paths: list[Path]) -> None:
    """paths: files, or a job's workers/ folder (folder.own_entries checked every file in it)."""
    for p in paths:
        if p.is_dir() and not p.is_symlink():
            shutil.rmtree(p)
        else:
            p.unlink()
    fsync_path(out_dir)
