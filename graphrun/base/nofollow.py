"""Files of an output folder opened for writing without following links.

A symbolic link (or a second hard link) planted under one of graphrun's own names, say
rejects.jsonl, would make a write land in a file elsewhere, which graphrun must never change:
every file graphrun writes or appends in an output folder is opened here, and a link is
refused with one message.
"""

from __future__ import annotations

import errno
import os
import stat
from pathlib import Path
from typing import IO, Any

from graphrun.base.errors import OutputError

# open()'s modes graphrun writes with -> os.open's flags (O_TRUNC is applied after the check)
_FLAGS = {"w": os.O_WRONLY | os.O_CREAT | os.O_TRUNC,
          "a": os.O_WRONLY | os.O_CREAT | os.O_APPEND,
          "r+": os.O_RDWR}


def linked(path: str | os.PathLike) -> OutputError:
    return OutputError(f"{path} is a link (to a file elsewhere, perhaps); graphrun writes no "
                       "file of its output folder through a link, so that no file outside it "
                       "changes: remove the link (or move the folder's files back in place), "
                       "then run again")


class NotRegular(OutputError, OSError):
    """A fifo, device or folder under one of graphrun's names. An OSError too: a reader that
    takes an unreadable file as absent takes this one so."""


def not_regular(path: str | os.PathLike) -> NotRegular:
    return NotRegular(f"{path} is not a regular file (a fifo or a device, perhaps); graphrun "
                      "reads and writes only regular files in its output folder: remove it (or "
                      "move it away), then run again")


def open_fd(path: str | os.PathLike, flags: int, mode: int = 0o666) -> int:
    """os.open(path, flags) that refuses a link as the last component: a symbolic one by
    O_NOFOLLOW, a hard one (a regular file of more than one name) before it is truncated; and
    refuses anything but a regular file there, without waiting on a fifo for its reader."""
    try:
        fd = os.open(path, (flags & ~os.O_TRUNC) | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK,
                     mode)
    except OSError as e:
        if e.errno in (errno.ELOOP, errno.EMLINK):
            raise linked(path) from None
        if e.errno == errno.ENXIO:  # a fifo no one reads: refused, not waited on for good
            raise not_regular(path) from None
        raise
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise not_regular(path)
        if st.st_nlink > 1:
            raise linked(path)
        os.set_blocking(fd, True)  # O_NONBLOCK was for the open alone
        if flags & os.O_TRUNC:
            os.ftruncate(fd, 0)
    except BaseException:
        os.close(fd)
        raise
    return fd


def read_own(path: str | os.PathLike) -> bytes:
    """A file of the output folder, read whole: never through a link (refused, as a write
    is), and without waiting on a fifo for its writer (NotRegular)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise linked(path) from None
        raise
    with open(fd, "rb") as f:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise not_regular(path)
        return f.read()


def open_file(path: str | os.PathLike, mode: str, **kwargs: Any) -> IO:
    """open(path, mode) for mode w, a or r+ (with b for bytes), without following links."""
    fd = open_fd(path, _FLAGS[mode.replace("b", "")])
    try:
        return open(fd, mode, **kwargs)
    except BaseException:
        os.close(fd)
        raise


def refuse_links(folder: Path, names) -> None:
    """One error for the first of these names in folder that is a symbolic link, before a
    run writes anything there."""
    for name in sorted(names):
        if (folder / name).is_symlink():
            raise linked(folder / name)
