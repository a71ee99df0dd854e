"""The filesystem a failed write was on, as its message names it: for a full disk (or a used-up
quota), what is mounted where (Linux's /proc/self/mountinfo, matched by mount point or by the
path's st_dev; elsewhere the mount point alone, where st_dev changes up the path), how much of it
is free, and what to do there. Every other failure keeps its own error text."""

from __future__ import annotations

import errno
import os
import re
import shutil
from dataclasses import dataclass
from pathlib import Path

from graphrun.base.units import GiB, MiB

MOUNTINFO = "/proc/self/mountinfo"
FULL = (errno.ENOSPC, errno.EDQUOT)


@dataclass(frozen=True)
class Disk:
    mount: str  # its mount point
    device: str | None  # what is mounted there (/dev/nvme0n1p2, server:/export, tmpfs)
    fstype: str | None  # ext4, xfs, nfs4, ...
    free: int  # bytes free to this user
    total: int

    def named(self) -> str:
        """'/dev/vda (ext4) mounted at /data', 'tmpfs mounted at /dev/shm'."""
        if self.device is None:
            return f"the filesystem mounted at {self.mount}"
        kind = f" ({self.fstype})" if self.fstype and self.fstype != self.device else ""
        return f"{self.device}{kind} mounted at {self.mount}"


def disk_of(path: str | Path, mountinfo: str = MOUNTINFO) -> Disk | None:
    """The filesystem holding path (or its nearest existing parent); None where even that
    cannot be looked at."""
    p = Path(os.path.abspath(path))
    while not p.exists() and p != p.parent:
        p = p.parent
    try:
        p = p.resolve()
        dev = p.stat().st_dev
        mount = _mount_point(p, dev)
        usage = shutil.disk_usage(p)
    except OSError:
        return None
    device, fstype, mount = _mounted(mount, dev, p, mountinfo)
    return Disk(mount, device, fstype, usage.free, usage.total)


def _mount_point(p: Path, dev: int) -> str:
    """The highest folder above p on the same device: where that filesystem is mounted."""
    while p != p.parent:
        try:
            if p.parent.stat().st_dev != dev:
                break
        except OSError:
            break
        p = p.parent
    return str(p)


def _mounted(mount: str, dev: int, path: Path, mountinfo: str) -> tuple:
    """(device, type, mount point) from mountinfo: the last entry at `mount` (a later mount
    hides an earlier one), else the deepest one above path with path's major:minor (a bind
    mount, or a filesystem whose folders report their own st_dev); (None, None, mount) where
    the file is not there (not Linux)."""
    try:
        with open(mountinfo, encoding="utf-8", errors="replace") as f:
            lines = f.read().splitlines()
    except OSError:
        return None, None, mount
    at, same_dev = None, None
    want = f"{os.major(dev)}:{os.minor(dev)}"
    for line in lines:
        # id parent major:minor root mount-point options [optional...] - type source options
        left, sep, right = line.partition(" - ")
        fields, tail = left.split(), right.split()
        if not sep or len(fields) < 5 or len(tail) < 2:
            continue
        point, entry = _unescape(fields[4]), (_unescape(tail[1]), tail[0])
        if point == mount:
            at = entry
        if fields[2] == want and _holds(point, path) and (
                same_dev is None or len(point) >= len(same_dev[1])):
            same_dev = (entry, point)
    if at is not None:
        return (*at, mount)
    if same_dev is not None:
        return (*same_dev[0], same_dev[1])
    return None, None, mount


def _holds(point: str, path: Path) -> bool:
    return point == "/" or path == Path(point) or Path(point) in path.parents


def _unescape(text: str) -> str:
    """mountinfo writes a space, tab, newline and backslash in a name as \\040 and the like."""
    return re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), text)


def size(n: int) -> str:
    for unit, scale in (("TiB", 1 << 40), ("GiB", GiB), ("MiB", MiB)):
        if n >= scale:
            return f"{n / scale:,.1f} {unit}"
    return f"{n:,} bytes"


def write_failure(path: str | Path, err: OSError) -> str:
    """What failed: 'writing PATH failed: ERROR', with the disk and its free space when it is
    full."""
    text = f"writing {path} failed: {err}"
    disk = disk_of(path) if err.errno in FULL else None
    if disk is None:
        return text
    # a filesystem that reports no size (a FUSE or pseudo filesystem) says 0 of 0
    room = (f"has {size(disk.free)} free of {size(disk.total)}" if disk.total
            else "reports no size to say how much is free")
    if err.errno == errno.EDQUOT:
        return (f"{text} (your quota on the filesystem holding it, {disk.named()}, is used "
                f"up; the filesystem {room})")
    return f"{text} (the filesystem holding it, {disk.named()}, {room})"


def write_remedy(path: str | Path, err: OSError) -> str:
    """What to do about it, once the committed shards are kept: for a full disk, where to make
    room, then --resume."""
    disk = disk_of(path) if err.errno in FULL else None
    if disk is None:
        return ("committed shards are intact, free space or fix the folder and run again "
                "with --resume")
    if err.errno == errno.EDQUOT:
        return (f"committed shards are intact: free space within your quota on "
                f"{disk.mount} (or have it raised), then run again with --resume")
    return (f"committed shards are intact: free space on {disk.mount} (delete or move files "
            "off that filesystem), then run the same command again with --resume")
