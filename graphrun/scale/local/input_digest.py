"""The input's and the model's sha256 for a job of several workers, hashed once for the job,
not once per worker (each would read the whole input, and every weights file, beside the
others).

The publisher (the `--gpus` parent; under torchrun, rank 0) hashes the input file and the
model's files (folder.model_files: weights, archive, a target's source) with journal.InputHash,
child processes, beside the workers' start, and writes one record of their digests (or why
hashing failed) into the job's folder, atomically, the input's part as soon as it is known,
then both (layout.digest_file):

    {"input": {"paths": {"input": path}, "sha256": {"input": hex}},
     "model": {"paths": {role: path}, "sha256": {role: hex}}}     (a part fails: "error": why)

A worker's run takes SharedHash views of that record in place of its own InputHash and
FilesHash (job/state.RunHashes): it waits for the record where one process waits for its own hashes
(the "input hash wait" phase), so every run.json carries the input_sha256 and model_sha256
one process would (and its manifest the input's), and --resume compares against them. A
worker never waits for a publisher that is gone, nor past a limit in proportion to the files'
size: it says so and fails.
"""

from __future__ import annotations

import json
import os
import socket
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from graphrun.base.errors import GraphrunError, InputError, OutputError
from graphrun.write.folder import FilesHash, model_files
from graphrun.job.state import RunHashes
from graphrun.write.job_layout import digest_file
from graphrun.scale.local.world import alive
from graphrun.base.nofollow import open_file

POLL_S = 0.02  # how often a waiting worker looks for the record
# The longest a worker waits for a publisher that still runs: a floor, and the files' size
# read at a rate any disk hashing them beats by far (a publisher that cannot write the file).
WAIT_FLOOR_S = 600.0
WAIT_BYTES_PER_S = 20e6
PARTS = {"input": "the input", "model": "the model's files"}  # the record's parts, as named


@dataclass(frozen=True)
class Publisher:
    """The process that publishes the record: the --gpus parent, or rank 0 under torchrun."""

    name: str  # "the --gpus parent (pid 4242)", for the messages
    pid: int

    def alive(self) -> bool:
        return alive(self.pid)


def part_files(spec) -> dict[str, dict[str, Path]]:
    """The files of each part of the record, by role, as a run of this spec hashes them."""
    return {"input": {"input": Path(spec.data.path)},
            "model": model_files(spec.model, spec.base_dir)}


class PublishedHash:
    """The publisher's side: every file hashed (InputHash each, all at once) and the record
    written to the job's folder as each part is known (the input first, so that a worker's
    wait for the input is not the model's), on a thread of its own. close() stops hashing
    that is not done."""

    def __init__(self, top: Path, files: dict[str, dict[str, Path]]):
        self.file, self.files = digest_file(top), files
        self._closing = threading.Event()
        self._hashes = {part: FilesHash(by_role) for part, by_role in files.items()}
        self._thread = threading.Thread(target=self._publish, name="graphrun-hash-publish",
                                        daemon=True)
        self._thread.start()

    @classmethod
    def of(cls, top: Path, spec) -> "PublishedHash":
        return cls(top, part_files(spec))

    def _publish(self) -> None:
        entry, failed = {}, None
        for part, hashed in self._hashes.items():
            entry[part] = {"paths": {role: str(p) for role, p in self.files[part].items()}}
            if failed is not None:
                entry[part]["error"] = f"not hashed, as hashing {PARTS[failed]} failed"
            else:
                try:
                    entry[part]["sha256"] = hashed.result()
                except GraphrunError as err:
                    if self._closing.is_set():  # stopped at the job's end: no worker waits
                        return
                    entry[part]["error"], failed = str(err), part
                    self._stop_all()  # the workers fail on this error: publish it now
            try:
                write_entry(self.file, entry)
            except OSError:  # a folder not writable: the workers' wait gives up (SharedRecord)
                return

    def _stop_all(self) -> None:
        for hashed in self._hashes.values():
            hashed.stop()

    def close(self) -> None:
        self._closing.set()
        self._stop_all()
        self._thread.join()

    def __enter__(self) -> "PublishedHash":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def write_entry(file: Path, entry: dict) -> None:
    """The record's file, replaced atomically: a reader sees the whole record or none."""
    file.parent.mkdir(parents=True, exist_ok=True)
    tmp = file.with_name(f".{file.name}.tmp")
    with open_file(tmp, "w") as f:
        f.write(json.dumps(entry) + "\n")
    os.replace(tmp, file)


def read_entry(file: Path) -> dict | None:
    try:
        entry = json.loads(file.read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as err:
        raise OutputError(f"{file} is not the job's digests graphrun wrote ({err}); run the "
                          "job again") from None
    return entry if isinstance(entry, dict) else {}


class SharedRecord:
    """A worker's wait for the record another process publishes part by part (its pid tells
    whether it still runs); what is read is kept."""

    def __init__(self, top: Path, publisher: Publisher, files: list[Path]):
        self.file, self.publisher = digest_file(top), publisher
        self._entry: dict = {}
        size = 0
        for path in files:
            try:
                size += Path(path).stat().st_size
            except OSError:
                pass  # the publisher names the problem
        self.limit_s = WAIT_FLOOR_S + size / WAIT_BYTES_PER_S

    def peek(self, part: str) -> dict | None:
        """The part of the record if it is published (a record not graphrun's: None)."""
        if part not in self._entry:
            try:
                self._entry = read_entry(self.file) or {}
            except OutputError:
                return None
        return self._entry.get(part)

    def wait(self, part: str) -> dict:
        t0 = time.perf_counter()
        while part not in self._entry:
            gone = not self.publisher.alive()  # before the read: a last record is still seen
            self._entry = read_entry(self.file) or {}
            if part in self._entry:
                break
            if gone:
                raise OutputError(f"{self.publisher.name}, which hashes the input and the "
                                  "model's files for the job's workers, ended before it "
                                  f"published the hash of {PARTS[part]}; run the job again "
                                  "(with --resume)")
            if time.perf_counter() - t0 > self.limit_s:
                raise OutputError(f"{self.publisher.name} published no hash of {PARTS[part]} "
                                  f"in {self.limit_s:.0f} s ({self.file} is missing or "
                                  "incomplete); check that the output folder is writable, "
                                  "then run the job again (with --resume)")
            time.sleep(POLL_S)
        return self._entry[part]


class SharedHash:
    """One part of the job's record ("input" or "model"), with the interface of the hash the
    run would make itself (result, stop, done, waited_s): result() is the input's sha256, as
    InputHash's, or the model's {role: sha256}, as FilesHash's. A worker whose files are not
    the ones the record names hashes its own."""

    def __init__(self, record: SharedRecord, part: str, files: dict[str, Path]):
        self.record, self.part, self.files = record, part, files
        self.waited_s = 0.0  # how long the run waited in result()
        self._own: FilesHash | None = None  # hashed here: the record named other files

    def _shaped(self, digests: dict):
        return digests["input"] if self.part == "input" else digests

    def _mine(self, got) -> dict | None:
        """The part's digests, if the record names this run's files."""
        if isinstance(got, dict) and got.get("paths") == {r: str(p) for r, p in
                                                          self.files.items()}:
            return got.get("sha256")
        return None

    def result(self):
        t0 = time.perf_counter()
        try:
            got = self.record.wait(self.part)
            if not isinstance(got, dict) or "sha256" not in got:
                why = got.get("error") if isinstance(got, dict) else "no digest"
                raise InputError(f"{self.record.publisher.name} could not hash "
                                 f"{PARTS[self.part]} for the job's workers: {why}")
            digests = self._mine(got)
            if digests is None:  # found elsewhere by the publisher (its sys.path, say)
                self._own = FilesHash(self.files)
                digests = self._own.result()
            return self._shaped(digests)
        finally:
            self.waited_s += time.perf_counter() - t0

    def done(self) -> bool:
        return self.record.peek(self.part) is not None

    def stop(self):
        """The digest if it is known, else None (nothing of this process to stop)."""
        digests = self._own.stop() if self._own else self._mine(self.record.peek(self.part))
        return self._shaped(digests or {role: None for role in self.files})

    @property
    def source(self):
        """Where the digests came from, shaped as result(): "job" where the publisher's
        record gave them, else this process's own hashing's (InputHash.source)."""
        if self._own is not None:
            sources = self._own.source
        else:
            known = self._mine(self.record.peek(self.part)) is not None
            sources = {role: "job" if known else None for role in self.files}
        return self._shaped(sources)


def worker_hashes(top: Path, spec, parent: int | None, rank0: tuple | None) -> RunHashes:
    """What a worker's run waits on for the input's and the model's hashes: the --gpus
    parent's record (parent: its pid), else rank 0's under torchrun (rank0: its (host, pid));
    a rank on another host than rank 0 cannot tell whether rank 0 still runs, so it hashes
    the files itself."""
    files = part_files(spec)
    if parent is not None:
        publisher = Publisher(f"the --gpus parent (pid {parent})", parent)
    elif rank0[0] != socket.gethostname():
        return RunHashes.own(files["input"]["input"], files["model"])
    else:
        publisher = Publisher(f"rank 0 (pid {rank0[1]})", rank0[1])
    record = SharedRecord(top, publisher, [p for by_role in files.values()
                                           for p in by_role.values()])
    return RunHashes(*(SharedHash(record, part, files[part]) for part in ("input", "model")))
