"""Checks that keep --resume from removing a user's entry or from going on over a committed file
that changed: what journal.py and folder.py refuse, and the sha256 of rejects.jsonl's
committed bytes that each journal line records."""

from __future__ import annotations

from pathlib import Path

from graphrun.base.digest import file_sha256
from graphrun.base.errors import OutputError

FIRST_MARK_TEMP = ".run.json.tmp"  # run.json's temp name while it is first written


def refuse_foreign(folder: Path, paths: list) -> list:
    """paths, if each is a regular file; else OutputError naming the first that is not (a
    folder, a symlink): graphrun writes only regular files, so it is a user's, and is kept."""
    for p in map(Path, paths):
        if p.is_symlink() or not p.is_file():
            kind = ("a symlink" if p.is_symlink() else "a folder" if p.is_dir()
                    else "not a regular file")
            raise OutputError(f"output folder {folder} holds {p.name}, {kind} named like one of "
                              "graphrun's shard files; graphrun writes and removes only regular "
                              "files, so it stopped without changing anything: move "
                              f"{p.name} out of the folder, then run again")
    return paths


def only_a_first_mark_temp(folder: Path) -> bool:
    """The folder holds only .run.json.tmp, a regular file: what a run killed while it first
    wrote run.json leaves (before it, the folder was new or empty)."""
    entries = list(folder.iterdir())
    return ([p.name for p in entries] == [FIRST_MARK_TEMP] and entries[0].is_file()
            and not entries[0].is_symlink())


def file_differs(out_dir: Path, path: Path, size: int, recorded: int, journal: str) -> str:
    """The message for a committed file whose size or (same size) sha256 changed."""
    what = (f"its size ({size} bytes, recorded {recorded})" if size != recorded
            else "its sha256 (same size: changed in place)")
    return (f"cannot resume {out_dir}: {path} differs from what {journal} recorded when it was "
            f"committed, in {what}; put the file back (from a copy), or rerun with --overwrite "
            "to compute the run again")


def rejects_sha256(path: Path, size: int):
    """A sha256 object fed the first `size` bytes of the file (rejects.jsonl; a writer resuming
    goes on feeding it what it appends)."""
    return file_sha256(path, size)


def check_rejects_sha256(out_dir: Path, path: Path, size: int, count: int, want: str | None,
                         journal: str) -> None:
    """OutputError when the first `size` bytes of rejects.jsonl are not the ones committed."""
    if want is not None and rejects_sha256(path, size).hexdigest() != want:
        raise OutputError(f"cannot resume {out_dir}: the first {size} bytes of {path} ({count} "
                          f"committed rejects) differ from what {journal} recorded (sha256): a "
                          "line was edited; put the file back (from a copy), or rerun with "
                          "--overwrite to compute the run again")
