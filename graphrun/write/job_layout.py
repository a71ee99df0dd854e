"""A job's output folder (several workers, scale/): where each worker's files are.

    run.json            the job's mark: the spine's fingerprint keys, and "workers": one entry
                        per rank, {"slice": [start, stop], "shards": [first, end]}
    part-NNNNN.*        every worker's shards, side by side; worker k numbers its shards from
                        its "first" and stays below its "end", so name order is input order
    workers/rank-K/     worker K's own run folder without shards: run.json, journal.jsonl,
                        rejects.jsonl, latencies.jsonl, manifest.json
    workers/rank-K.progress   its records read so far, and its end ("done completed")
    workers/rank-K.log        a launched worker's stderr (its error, or a traceback)
    workers/input.sha256      the input's and the model's files' sha256, hashed once for
                              the job's workers by the --gpus parent or rank 0 (input_digest.py)
    rejects.jsonl       the workers' rejects in input order, and manifest.json, the job's:
                        both written from the workers' when they end (merge.py)
"""

from __future__ import annotations

import re
from pathlib import Path

from graphrun.base.errors import OutputError
from graphrun.write.journal import ShardPlace, journal_names, read_journal

WORKERS = "workers"
DIGEST = "input.sha256"
_ENTRY = re.compile(r"rank-\d+(\.progress|\.log)?|(input\.sha256|\.input\.sha256\.tmp)")


def worker_dir(top: Path, rank: int) -> Path:
    return Path(top) / WORKERS / f"rank-{rank}"


def progress_file(top: Path, rank: int) -> Path:
    return Path(top) / WORKERS / f"rank-{rank}.progress"


def log_file(top: Path, rank: int) -> Path:
    return Path(top) / WORKERS / f"rank-{rank}.log"


def digest_file(top: Path) -> Path:
    return Path(top) / WORKERS / DIGEST


def workers_entry(name: str) -> str | None:
    """"dir" for a worker's folder name, "file" for its progress or log or the job's input
    digest (or its temp), else None."""
    m = _ENTRY.fullmatch(name)
    return None if m is None else ("file" if m.group(1) or m.group(2) else "dir")


def is_job(mark: dict | None) -> bool:
    return isinstance(mark, dict) and isinstance(mark.get("workers"), list)


def shares(mark: dict) -> list[tuple[int, int, int, int]]:
    """(start, stop, first shard, end shard) per rank, as the mark records them; ValueError
    where it does not hold whole numbers."""
    out = []
    for w in mark["workers"]:
        (start, stop), (first, end) = w["slice"], w["shards"]
        if not all(type(v) is int and v >= 0 for v in (start, stop, first, end)):
            raise ValueError(f"worker entry {w!r} is not whole numbers")
        out.append((start, stop, first, end))
    return out


def job_shards(top: Path, mark: dict) -> tuple[set[str], list[ShardPlace]]:
    """The shard names the workers' journals list, and each worker's unfinished range (from its
    first shard not journaled to its end), read leniently: for --overwrite, which removes
    them; a mark that does not parse names no range."""
    listed: set[str] = set()
    ranges = []
    try:
        found = shares(mark)
    except (ValueError, KeyError, TypeError):
        found = []
    for rank, (_, _, first, end) in enumerate(found):
        names, after = journal_names(worker_dir(top, rank))
        listed |= names
        ranges.append(ShardPlace(Path(top), max(first, after), end))
    return listed, ranges


def manifest_since(top: Path, rank: int, since: float) -> bool:
    """The worker's manifest.json was written at or after `since` (time.time())."""
    try:
        return (worker_dir(top, rank) / "manifest.json").stat().st_mtime >= since - 0.05
    except OSError:
        return False


def committed(top: Path, rank: int, start: int, first_shard: int):
    """A worker's journal point, or None (nothing committed, or a journal not graphrun's)."""
    try:
        return read_journal(worker_dir(top, rank), start, first_shard, shard_dir=Path(top))
    except OutputError:
        return None
