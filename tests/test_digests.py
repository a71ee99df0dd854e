"""Digests of large files kept between runs (write/digests.py): a file unchanged since it was
hashed is not read again, one changed in any way the file system shows is, and a cache that
cannot be read or written changes nothing but the time."""

from __future__ import annotations

import os

import pytest

from graphrun.base.tuning import Tuning
from graphrun.write import digests, journal
from graphrun.write.journal import InputHash, sha256_file


@pytest.fixture
def small_cache(tmp_path, monkeypatch):
    """The cache in the test's folder (hashed() keeps every file's digest)."""
    monkeypatch.setenv("GRAPHRUN_HASH_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache" / digests.NAME


def hashed(path, keep_bytes: int = 1) -> tuple[str, bool]:
    """(the digest, whether a child process read the file); kept from keep_bytes (every file,
    unless told)."""
    spawned = []
    real = journal.subprocess.Popen

    def spy(*args, **kwargs):
        spawned.append(args)
        return real(*args, **kwargs)

    journal.subprocess.Popen = spy
    try:
        return InputHash(path, keep_bytes).result(), bool(spawned)
    finally:
        journal.subprocess.Popen = real


def test_an_unchanged_file_is_hashed_once_and_a_changed_one_again(tmp_path, small_cache):
    data = tmp_path / "weights.bin"
    data.write_bytes(b"a" * 1000)
    assert hashed(data) == (sha256_file(data), True)
    assert small_cache.is_file()
    assert hashed(data) == (sha256_file(data), False)  # from the cache: not read
    data.write_bytes(b"b" * 1000)  # same size, new bytes: its modification time moved
    st = os.stat(data)
    os.utime(data, ns=(st.st_atime_ns, st.st_mtime_ns + 1))
    assert hashed(data) == (sha256_file(data), True)
    assert hashed(data) == (sha256_file(data), False)


def test_a_broken_or_unwritable_cache_only_costs_the_hash(tmp_path, small_cache):
    data = tmp_path / "input.jsonl"
    data.write_bytes(b"{}\n" * 100)
    small_cache.parent.mkdir()
    small_cache.write_text("{not json")
    assert hashed(data) == (sha256_file(data), True)
    assert hashed(data) == (sha256_file(data), False)  # rewritten whole, readable again
    small_cache.write_text('{"%s": {"stat": "x", "sha256": 5}}' % os.path.realpath(data))
    assert hashed(data) == (sha256_file(data), True)


def test_small_files_and_off_keep_nothing(tmp_path, monkeypatch):
    monkeypatch.setenv("GRAPHRUN_HASH_CACHE", str(tmp_path / "cache"))
    small = tmp_path / "config.json"
    small.write_text("{}")
    # under Tuning's hash_keep_bytes
    assert hashed(small, Tuning.hash_keep_bytes)[1] and not (tmp_path / "cache").exists()
    monkeypatch.setenv("GRAPHRUN_HASH_CACHE", "off")
    assert digests.cache_file() is None
    assert hashed(small)[1] and hashed(small)[1]


def test_digests_kept_at_once_from_threads_and_processes_are_all_kept(tmp_path, small_cache):
    """A run keeps its input's and its model's digests from threads of their own (and two jobs
    may share the cache): no keep writes over another's entry."""
    import subprocess
    import sys
    import threading

    files = [tmp_path / f"f{i}" for i in range(24)]
    for i, f in enumerate(files):
        f.write_bytes(bytes([i]) * 64)
    code = ("import sys; from pathlib import Path; from graphrun.write import digests; "
            "[digests.keep(Path(p), digests.stat_key(Path(p), 1), f'{i:064d}') "
            "for i, p in enumerate(sys.argv[1:])]")
    other = subprocess.Popen([sys.executable, "-c", code, *map(str, files[16:])],
                             env={**os.environ, "PYTHONPATH": os.getcwd()})
    threads = [threading.Thread(target=digests.keep,
                                args=(f, digests.stat_key(f, 1), f"{i:064d}"))
               for i, f in enumerate(files[:16])]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert other.wait() == 0
    assert [digests.known(digests.stat_key(f, 1)) is not None for f in files] == [True] * 24
