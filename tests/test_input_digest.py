"""The input's sha256 hashed once for a job of several workers (scale/input_digest.py): the
publisher's digest reaches the workers' runs; a failed hash, a publisher gone, or one that
never publishes, ends the wait with a clear error, never a hang."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time

import pytest

import graphrun
from graphrun import journal
from graphrun.errors import InputError, OutputError
from graphrun.scale.input_digest import (Publisher, PublishedHash, SharedHash, worker_hash,
                                         write_entry)
from graphrun.scale.layout import digest_file


def me() -> Publisher:
    import os

    return Publisher(f"this test (pid {os.getpid()})", os.getpid())


def failing_hash(self):  # as InputHash._hash ends when the file cannot be read
    self._error = OSError("[Errno 5] Input/output error")


def test_the_published_digest_is_the_files_sha256_and_waited_for(tmp_path):
    data = tmp_path / "data.bin"
    data.write_bytes(bytes(range(256)) * 4000)
    shared = SharedHash(tmp_path / "job", data, me())
    assert not shared.done() and shared.stop() is None  # nothing published yet
    with PublishedHash(tmp_path / "job", data):
        assert shared.result() == journal.sha256_file(data)
    assert shared.done() and shared.stop() == journal.sha256_file(data)
    entry = json.loads(digest_file(tmp_path / "job").read_text())
    assert entry == {"input": str(data), "sha256": journal.sha256_file(data)}
    assert not (tmp_path / "job/workers/.input.sha256.tmp").exists()


def test_a_failed_hash_is_a_clear_error_in_the_worker(tmp_path, monkeypatch):
    data = tmp_path / "data.bin"
    data.write_bytes(b"x" * 100)
    monkeypatch.setattr(journal.InputHash, "_hash", failing_hash)
    with PublishedHash(tmp_path, data):
        t0 = time.perf_counter()
        with pytest.raises(InputError, match=r"this test \(pid \d+\) could not hash the input "
                           r"for the job's workers: .*cannot read the input file to hash it"
                           r".*Input/output error"):
            SharedHash(tmp_path, data, me()).result()
    assert time.perf_counter() - t0 < 10


def test_a_publisher_gone_without_publishing_is_an_error_not_a_hang(tmp_path):
    data = tmp_path / "data.bin"
    data.write_bytes(b"x")
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    shared = SharedHash(tmp_path, data, Publisher(f"the --gpus parent (pid {gone.pid})",
                                                  gone.pid))
    with pytest.raises(OutputError, match=r"the --gpus parent \(pid \d+\), which hashes the "
                       "input for the job's workers, ended before it published the hash"):
        shared.result()
    assert shared.waited_s < 5


def test_a_publisher_that_never_publishes_is_given_up_on(tmp_path):
    data = tmp_path / "data.bin"
    data.write_bytes(b"x")
    shared = SharedHash(tmp_path, data, me())
    assert shared.limit_s >= 600  # a floor, then in proportion to the file's size
    shared.limit_s = 0.2
    with pytest.raises(OutputError, match=r"published no hash of .* in 0 s .*input\.sha256 "
                       "is missing.*writable"):
        shared.result()


def test_a_rank_on_another_host_than_rank_0_hashes_the_input_itself(tmp_path):
    data = tmp_path / "data.bin"
    data.write_bytes(b"abc")
    own = worker_hash(tmp_path, data, None, ("not-this-host.example", 1))
    assert isinstance(own, journal.InputHash) and own.result() == journal.sha256_file(data)
    assert isinstance(worker_hash(tmp_path, data, 77, None), SharedHash)


def test_a_run_given_the_shared_hash_waits_for_it_as_its_input_hash_wait(write_spec, tmp_path):
    """The phase "input hash wait" is the wait for the published digest, and the phases still
    add up to the process's time."""
    spec = graphrun.load_spec(write_spec())
    digest = journal.sha256_file(spec.data.path)
    top = tmp_path / "job"

    def publish_late():
        time.sleep(2.0)
        write_entry(digest_file(top), {"input": str(spec.data.path), "sha256": digest})

    threading.Thread(target=publish_late, daemon=True).start()
    m = graphrun.run(spec, out=top / "one", input_hash=SharedHash(top, spec.data.path, me()))
    assert m.status == "completed" and m.input["sha256"] == digest
    assert json.loads((top / "one/run.json").read_text())["input_sha256"] == digest
    phases = {p.name: p.s for p in m.phases.top}
    assert m.totals.input_hash_s > 1.0  # setup took less than the 2 s the digest came late
    assert phases["input hash wait"] >= m.totals.input_hash_s
    assert sum(phases.values()) == pytest.approx(m.totals.process_wall_s, rel=0.02)
