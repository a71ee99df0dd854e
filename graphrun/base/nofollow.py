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


def open_fd(path: str | os.PathLike, flags: int, mode: int = 0o666) -> int:
    """os.open(path, flags) that refuses a link as the last component: a symbolic one by
    O_NOFOLLOW, a hard one (a regular file of more than one name) before it is truncated."""
    try:
        fd = os.open(path, (flags & ~os.O_TRUNC) | os.O_NOFOLLOW | os.O_CLOEXEC, mode)
    except OSError as e:
        if e.errno in (errno.ELOOP, errno.EMLINK):
            raise linked(path) from None
        raise
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_nlink > 1:
            raise linked(path)
        if flags & os.O_TRUNC:
            os.ftruncate(fd, 0)
    except BaseException:
        os.close(fd)
        raise
    return fd


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
