"""The filesystem a full disk's message names (issue 28): its device, type and mount point from
/proc/self/mountinfo (an escaped name read back, a later mount over an earlier one, a bind
mount by its major:minor), its free space, and what to do; a quota says quota."""

from __future__ import annotations

import errno
import os
from pathlib import Path

from graphrun.write.disk import disk_of, size, write_failure, write_remedy


def mount_of(path: Path) -> str:
    """Where path's filesystem is mounted, as os.path.ismount finds it."""
    p = path.resolve()
    while not os.path.ismount(p):
        p = p.parent
    return str(p)


def fake_mountinfo(tmp_path: Path, lines: list[str]) -> str:
    f = tmp_path / "mountinfo"
    f.write_text("".join(line + "\n" for line in lines))
    return str(f)


def dev_of(path: Path) -> str:
    st = os.stat(path)
    return f"{os.major(st.st_dev)}:{os.minor(st.st_dev)}"


def test_the_last_mount_at_the_mount_point_names_the_device(tmp_path):
    mount = mount_of(tmp_path)
    info = fake_mountinfo(tmp_path, [
        f"30 1 9:9 / {mount} rw - ext4 /dev/old rw",
        "31 1 0:50 / /elsewhere rw - tmpfs tmpfs rw",
        f"32 1 9:9 / {mount} rw,relatime shared:1 - xfs /dev/nvme0n1p2 rw",  # mounted over it
    ])
    disk = disk_of(tmp_path / "out" / "not-yet", info)  # the folder need not exist yet
    assert (disk.mount, disk.device, disk.fstype) == (mount, "/dev/nvme0n1p2", "xfs")
    assert 0 <= disk.free <= disk.total
    assert disk.named() == f"/dev/nvme0n1p2 (xfs) mounted at {mount}"


def test_a_bind_mount_is_found_by_its_device_and_escapes_are_read(tmp_path):
    """No entry at the mount point st_dev finds (a bind mount over a folder of the same
    filesystem): the deepest entry above the path with its major:minor, names unescaped."""
    bound = tmp_path / "my disk"
    bound.mkdir()
    escaped = str(bound).replace(" ", "\\040")
    info = fake_mountinfo(tmp_path, [
        f"40 1 {dev_of(tmp_path)} / {tmp_path} rw - ext4 /dev/sdy rw",
        f"41 1 {dev_of(tmp_path)} /exports {escaped} rw - nfs4 server:/exports\\040a rw",
        f"42 1 0:77 / {escaped}/elsewhere rw - ext4 /dev/sdz rw",  # not above the path
    ])
    disk = disk_of(bound / "out", info)
    assert (disk.mount, disk.device, disk.fstype) == (str(bound), "server:/exports a", "nfs4")


def test_without_mountinfo_the_mount_point_alone(tmp_path):
    disk = disk_of(tmp_path, str(tmp_path / "no-such-file"))
    assert (disk.mount, disk.device) == (mount_of(tmp_path), None)
    assert disk.named() == f"the filesystem mounted at {mount_of(tmp_path)}"


def test_messages_for_a_full_disk_a_quota_and_another_error(tmp_path):
    mount = mount_of(tmp_path)
    full = OSError(errno.ENOSPC, "No space left on device")
    text = write_failure(tmp_path / "out", full)
    assert text.startswith(f"writing {tmp_path / 'out'} failed: [Errno {errno.ENOSPC}] No space")
    assert f"mounted at {mount}, has " in text and " free of " in text
    assert f"free space on {mount}" in write_remedy(tmp_path, full)
    assert "--resume" in write_remedy(tmp_path, full)
    quota = OSError(errno.EDQUOT, "Disk quota exceeded")
    assert "your quota on the filesystem holding it" in write_failure(tmp_path, quota)
    assert f"within your quota on {mount}" in write_remedy(tmp_path, quota)
    eio = OSError(errno.EIO, "Input/output error")
    assert write_failure(tmp_path, eio) == f"writing {tmp_path} failed: [Errno 5] Input/output error"
    assert "fix the folder" in write_remedy(tmp_path, eio)
    assert (size(5 << 20), size(3 << 30), size(2 << 40)) == ("5.0 MiB", "3.0 GiB", "2.0 TiB")


def test_a_filesystem_of_no_size_is_not_said_to_have_0_of_0(tmp_path, monkeypatch):
    import shutil

    from graphrun.write import disk

    # a patch: the filesystem's reported size is the environment's (shutil)
    monkeypatch.setattr(disk.shutil, "disk_usage", lambda p: shutil._ntuple_diskusage(0, 0, 0))
    text = write_failure(tmp_path, OSError(errno.ENOSPC, "No space left on device"))
    assert "reports no size" in text and "0.0 MiB" not in text, text
    assert size(4096) == "4,096 bytes" and size(3 * 2**20) == "3.0 MiB"
