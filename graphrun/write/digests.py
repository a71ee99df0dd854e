"""sha256 digests of large files kept between runs, by what the file system says of the file.

--resume checks that the input and the model did not change by their sha256; reading a 2.5 GB
checkpoint to hash it takes longer than the rest of a short job's setup, and most runs read the
same model (and often the same input) as the run before. A digest is kept under the file's
real path with its size, modification time (ns), inode and device: if any of them differs the
file is hashed again, as `git status` trusts a file's stat until it changes. Only files of at
least keep_bytes (Tuning.hash_keep_bytes) are kept; a cache that cannot be read or written is
skipped, never an error.
"""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
import threading
from pathlib import Path

from graphrun.base import envs
from graphrun.base.tuning import Tuning

KEEP = 2000  # entries kept, the newest
NAME = "sha256-v1.json"
# a run keeps the input's and the model's digests from threads of their own: each read, change
# and write of the cache is one at a time, in this process and (flock) between processes
_LOCK = threading.Lock()


def cache_file(environ=None) -> Path | None:
    """Where the digests are kept (GRAPHRUN_HASH_CACHE), None where it says off."""
    env = os.environ if environ is None else environ
    where = envs.get("GRAPHRUN_HASH_CACHE", env)
    if where.lower() in ("off", "0", "none"):
        return None
    if where:
        return Path(where) / NAME
    base = env.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "graphrun" / NAME


def stat_key(path: Path, keep_bytes: int = Tuning.hash_keep_bytes
             ) -> tuple[str, list[int]] | None:
    """(real path, [size, mtime ns, inode, device]) of a file of at least keep_bytes, else
    None."""
    try:
        st = os.stat(path)
        real = os.path.realpath(path)
    except OSError:
        return None
    if st.st_size < keep_bytes:
        return None
    return real, [st.st_size, st.st_mtime_ns, st.st_ino, st.st_dev]


def _read(cache: Path) -> dict:
    try:
        kept = json.loads(cache.read_text())
    except (OSError, ValueError):
        return {}
    return kept if isinstance(kept, dict) else {}


def known(key: tuple[str, list[int]] | None, environ=None) -> str | None:
    """The digest kept for the file of this stat_key, or None."""
    cache = cache_file(environ)
    if cache is None or key is None:
        return None
    entry = _read(cache).get(key[0])
    if isinstance(entry, dict) and entry.get("stat") == key[1]:
        digest = entry.get("sha256")
        return digest if isinstance(digest, str) and len(digest) == 64 else None
    return None


def keep(path: Path, key: tuple[str, list[int]] | None, digest: str, environ=None) -> None:
    """Keep the digest of the file hashed from the state `key` (its stat_key before), unless
    it changed meanwhile. The cache is written whole: another process reading it meanwhile
    sees the old one or the new one."""
    cache = cache_file(environ)
    # any size: a key was only made for a file large enough, and its size is in the key
    if cache is None or key is None or stat_key(path, 0) != key:
        return
    try:
        cache.parent.mkdir(parents=True, exist_ok=True)
        with _LOCK, _locked(cache):
            kept = _read(cache)
            kept.pop(key[0], None)
            kept[key[0]] = {"stat": key[1], "sha256": digest}
            kept = dict(list(kept.items())[-KEEP:])
            fd, tmp = tempfile.mkstemp(dir=cache.parent, prefix=".sha256-", suffix=".tmp")
            with os.fdopen(fd, "w") as f:
                json.dump(kept, f)
            os.replace(tmp, cache)
    except OSError:
        pass


@contextlib.contextmanager
def _locked(cache: Path):
    """The cache's lock file held (exclusive flock) where the system has flock, else nothing:
    another process's keep waits instead of writing over this one's entry."""
    try:
        import fcntl
    except ImportError:  # no flock (Windows): this process's lock alone
        yield
        return
    with open(cache.with_name(cache.name + ".lock"), "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)
