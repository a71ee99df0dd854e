"""The input's and the model's sha256 hashed once for a job of several workers
(scale/input_digest.py): the publisher's record reaches the workers' runs as the digests one
process computes; a failed hash, a publisher gone, or one that never publishes, ends the wait
with a clear error, never a hang."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

import graphrun
from graphrun.write import journal
from graphrun.base.errors import InputError, OutputError
from graphrun.write.folder import FilesHash
from graphrun.job.state import RunHashes
from graphrun.scale.local.input_digest import (Publisher, PublishedHash, SharedHash, SharedRecord,
                                               part_files, worker_hashes, write_entry)
from graphrun.write.job_layout import digest_file


def me() -> Publisher:
    import os

    return Publisher(f"this test (pid {os.getpid()})", os.getpid())


def unreadable(path: Path) -> None:
    """The file replaced by a folder of its name: its hash fails as a read error does."""
    path.unlink()
    path.mkdir()


def job_files(tmp_path) -> dict[str, dict[str, Path]]:
    """An input of 1 MB and a model of a weights file and a target's source."""
    data, weights, source = tmp_path / "data.bin", tmp_path / "w.pt", tmp_path / "model.py"
    data.write_bytes(bytes(range(256)) * 4000)
    weights.write_bytes(b"\x01weights" * 5000)
    source.write_text("def build(): ...\n")
    return {"input": {"input": data}, "model": {"weights": weights, "target": source}}


def shared(top: Path, files: dict, publisher: Publisher | None = None) -> RunHashes:
    """A worker's views of the job's record, as worker_hashes makes them."""
    record = SharedRecord(top, publisher or me(), [p for f in files.values() for p in f.values()])
    return RunHashes(*(SharedHash(record, part, files[part]) for part in ("input", "model")))


def test_the_published_digests_are_the_files_sha256_and_waited_for(tmp_path):
    files = job_files(tmp_path)
    top = tmp_path / "job"
    hashes = shared(top, files)
    assert not hashes.input.done() and hashes.input.stop() is None  # nothing published yet
    assert hashes.model.stop() == {"weights": None, "target": None}
    data = files["input"]["input"]
    own_model = FilesHash(files["model"]).result()  # what one process's run records
    assert own_model == {role: journal.sha256_file(p) for role, p in files["model"].items()}
    with PublishedHash(top, files):
        assert hashes.input.result() == journal.sha256_file(data)
        assert hashes.model.result() == own_model
    assert hashes.input.done() and hashes.input.stop() == journal.sha256_file(data)
    assert hashes.model.stop() == own_model
    entry = json.loads(digest_file(top).read_text())
    assert entry == {"input": {"paths": {"input": str(data)},
                               "sha256": {"input": journal.sha256_file(data)}},
                     "model": {"paths": {r: str(p) for r, p in files["model"].items()},
                               "sha256": own_model}}
    assert not (top / "workers/.input.sha256.tmp").exists()


def test_the_input_is_not_waited_for_past_its_own_digest(tmp_path):
    """The record holds the input's part before the model's: the input's wait ends there
    (input_hash_s is the input's), the model's goes on."""
    files = job_files(tmp_path)
    data = files["input"]["input"]
    write_entry(digest_file(tmp_path), {"input": {
        "paths": {"input": str(data)}, "sha256": {"input": journal.sha256_file(data)}}})
    hashes = shared(tmp_path, files)
    assert hashes.input.result() == journal.sha256_file(data) and hashes.input.done()
    assert not hashes.model.done() and hashes.model.stop() == {"weights": None, "target": None}
    hashes.model.record.limit_s = 0.1
    with pytest.raises(OutputError, match="published no hash of the model's files"):
        hashes.model.result()


def test_a_failed_hash_is_a_clear_error_in_the_worker(tmp_path):
    files = job_files(tmp_path)
    unreadable(files["input"]["input"])
    with PublishedHash(tmp_path, files):
        t0 = time.perf_counter()
        with pytest.raises(InputError, match=r"this test \(pid \d+\) could not hash the input "
                           r"for the job's workers: .*cannot read the input file to hash it"
                           r".*Is a directory"):
            shared(tmp_path, files).input.result()
    assert time.perf_counter() - t0 < 10


def test_a_weights_file_that_cannot_be_hashed_is_a_clear_error_in_the_worker(tmp_path):
    files = job_files(tmp_path)
    unreadable(files["model"]["weights"])
    with PublishedHash(tmp_path, files):
        hashes = shared(tmp_path, files)
        assert hashes.input.result() == journal.sha256_file(files["input"]["input"])
        with pytest.raises(InputError, match=r"this test \(pid \d+\) could not hash the "
                           r"model's files for the job's workers: .*w\.pt.*Is a directory"):
            hashes.model.result()


def test_a_worker_whose_files_the_record_does_not_name_hashes_its_own(tmp_path):
    """The publisher found the target's source elsewhere (another sys.path): the worker's
    digest is of its own file, not the publisher's."""
    files = job_files(tmp_path)
    theirs = tmp_path / "theirs.py"
    theirs.write_text("def build(): return 1\n")
    with PublishedHash(tmp_path, {**files, "model": {**files["model"], "target": theirs}}):
        got = shared(tmp_path, files).model.result()
    assert got == {role: journal.sha256_file(p) for role, p in files["model"].items()}


def test_a_publisher_gone_without_publishing_is_an_error_not_a_hang(tmp_path):
    files = job_files(tmp_path)
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    hashes = shared(tmp_path, files, Publisher(f"the --gpus parent (pid {gone.pid})",
                                               gone.pid))
    with pytest.raises(OutputError, match=r"the --gpus parent \(pid \d+\), which hashes the "
                       "input and the model's files for the job's workers, ended before it "
                       "published the hash of the model's files"):
        hashes.model.result()
    assert hashes.model.waited_s < 5


def test_a_publisher_that_never_publishes_is_given_up_on(tmp_path):
    files = job_files(tmp_path)
    hashes = shared(tmp_path, files)
    record = hashes.input.record
    assert record.limit_s >= 600  # a floor, then in proportion to the files' size
    record.limit_s = 0.2
    with pytest.raises(OutputError, match=r"published no hash of the input in 0 s "
                       r".*input\.sha256 is missing or incomplete.*writable"):
        hashes.input.result()


def test_a_rank_on_another_host_than_rank_0_hashes_the_files_itself(tmp_path):
    files = job_files(tmp_path)
    model = SimpleNamespace(weights=str(files["model"]["weights"]), exported=None,
                            torchscript=None, target=None, hf=None)
    spec = SimpleNamespace(data=SimpleNamespace(path=files["input"]["input"]), model=model,
                           base_dir=tmp_path)
    assert part_files(spec) == {"input": files["input"],
                                "model": {"weights": files["model"]["weights"]}}
    own = worker_hashes(tmp_path, spec, None, ("not-this-host.example", 1))
    assert isinstance(own.input, journal.InputHash) and isinstance(own.model, FilesHash)
    assert own.model.result() == {"weights": journal.sha256_file(files["model"]["weights"])}
    assert isinstance(worker_hashes(tmp_path, spec, 77, None).model, SharedHash)


def test_a_run_given_the_shared_hashes_waits_for_them_as_its_input_hash_wait(write_spec,
                                                                            tmp_path):
    """The phase "input hash wait" is the wait for the published record, and the phases still
    add up to the process's time."""
    import torch

    from graphrun.models.builtin.mlp import build_mlp

    torch.save(build_mlp(4, 8, 2, 3, seed=5).state_dict(), tmp_path / "w.pt")
    path = write_spec()  # the tiny mlp, given its weights file
    path.write_text(path.read_text().replace("out_features: 3}\n",
                                             "out_features: 3}\n  weights: w.pt\n"))
    spec = graphrun.load_spec(path)
    files = part_files(spec)
    assert list(files["model"]) == ["weights"]
    digests = {part: FilesHash(by_role).result() for part, by_role in files.items()}
    top = tmp_path / "job"

    def publish_late():
        time.sleep(2.0)
        write_entry(digest_file(top), {
            part: {"paths": {r: str(p) for r, p in files[part].items()}, "sha256": digests[part]}
            for part in files})

    threading.Thread(target=publish_late, daemon=True).start()
    m = graphrun.run(spec, out=top / "one", hashes=shared(top, files))
    assert m.status == "completed" and m.input["sha256"] == digests["input"]["input"]
    run_json = json.loads((top / "one/run.json").read_text())
    assert run_json["input_sha256"] == digests["input"]["input"]
    assert run_json["model_sha256"] == digests["model"]
    phases = {p.name: p.s for p in m.phases.top}
    assert m.totals.input_hash_s > 1.0  # setup took less than the 2 s the digest came late
    assert phases["input hash wait"] >= m.totals.input_hash_s
    assert sum(phases.values()) == pytest.approx(m.totals.process_wall_s, rel=0.02)


def test_a_signal_while_waiting_for_the_hash_then_stop_kills_the_hashing_child(tmp_path):
    import os
    import signal

    fifo = tmp_path / "never-written.fifo"
    os.mkfifo(fifo)  # the child's open() blocks: the hash never ends by itself
    digest = journal.InputHash(fifo)
    deadline = time.monotonic() + 10
    while digest._proc is None and time.monotonic() < deadline:
        time.sleep(0.01)
    proc = digest._proc
    assert proc is not None

    def interrupt(signum, frame):
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGALRM, interrupt)
    try:
        signal.setitimer(signal.ITIMER_REAL, 0.3)
        with pytest.raises(KeyboardInterrupt):
            digest.result()  # as --resume's wait for the hash, cut short by a signal
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
    assert not digest.done()
    assert digest.stop() is None  # stopped, not done
    assert proc.wait(10) is not None  # the child was killed, not left hashing
    assert digest.done()
