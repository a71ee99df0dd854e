"""The input's sha256 for a job of several workers, hashed once for the job, not once per
worker (each would read the whole file again, beside the others).

The publisher (the `--gpus` parent; under torchrun, rank 0) hashes the input with
journal.InputHash, a child process, beside the workers' start, and writes the digest (or why
hashing failed) into the job's folder, atomically (layout.digest_file). A worker's run takes a
SharedHash in place of its own InputHash: it waits for that file where one process waits for
its own hash (the "input hash wait" phase), so every run.json and manifest carries the same
input_sha256, and --resume compares against it. A worker never waits for a publisher that is
gone, nor past a limit in proportion to the file's size: it says so and fails.
"""

from __future__ import annotations

import json
import os
import socket
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from graphrun.errors import GraphrunError, InputError, OutputError
from graphrun.journal import InputHash
from graphrun.scale.layout import digest_file
from graphrun.scale.world import alive

POLL_S = 0.02  # how often a waiting worker looks for the digest
# The longest a worker waits for a publisher that still runs: a floor, and the file's size
# read at a rate any disk hashing it beats by far (a publisher that cannot write the file).
WAIT_FLOOR_S = 600.0
WAIT_BYTES_PER_S = 20e6


@dataclass(frozen=True)
class Publisher:
    """The process that publishes the digest: the --gpus parent, or rank 0 under torchrun."""

    name: str  # "the --gpus parent (pid 4242)", for the messages
    pid: int

    def alive(self) -> bool:
        return alive(self.pid)


class PublishedHash:
    """The publisher's side: the input hashed (InputHash) and its digest written to the job's
    folder once known, on a thread of its own. close() stops hashing that is not done."""

    def __init__(self, top: Path, path: Path):
        self.file, self.path = digest_file(top), Path(path)
        self._closing = threading.Event()
        self._hash = InputHash(self.path)
        self._thread = threading.Thread(target=self._publish, name="graphrun-input-publish",
                                        daemon=True)
        self._thread.start()

    def _publish(self) -> None:
        try:
            entry = {"input": str(self.path), "sha256": self._hash.result()}
        except GraphrunError as err:
            if self._closing.is_set():  # stopped at the job's end: no worker waits
                return
            entry = {"input": str(self.path), "error": str(err)}
        try:
            write_entry(self.file, entry)
        except OSError:  # a folder not writable: the workers' wait gives up (SharedHash)
            pass

    def close(self) -> None:
        self._closing.set()
        self._hash.stop()
        self._thread.join()

    def __enter__(self) -> "PublishedHash":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def write_entry(file: Path, entry: dict) -> None:
    """The digest file, replaced atomically: a reader sees the whole entry or none."""
    file.parent.mkdir(parents=True, exist_ok=True)
    tmp = file.with_name(f".{file.name}.tmp")
    tmp.write_text(json.dumps(entry) + "\n")
    os.replace(tmp, file)


def read_entry(file: Path) -> dict | None:
    try:
        entry = json.loads(file.read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as err:
        raise OutputError(f"{file} is not the input's digest graphrun wrote ({err}); run the "
                          "job again") from None
    return entry if isinstance(entry, dict) else {"error": f"{file} holds no digest"}


class SharedHash:
    """A worker's input hash, published by another process: InputHash's interface (result,
    stop, done, waited_s) for the run's state (run_state.RunState)."""

    def __init__(self, top: Path, path: Path, publisher: Publisher):
        self.file, self.path, self.publisher = digest_file(top), Path(path), publisher
        self.waited_s = 0.0  # how long the run waited in result()
        try:
            size = self.path.stat().st_size
        except OSError:
            size = 0  # the publisher names the problem
        self.limit_s = WAIT_FLOOR_S + size / WAIT_BYTES_PER_S

    def result(self) -> str:
        t0 = time.perf_counter()
        try:
            entry = self._wait(t0)
        finally:
            self.waited_s += time.perf_counter() - t0
        if "sha256" not in entry:
            raise InputError(f"{self.publisher.name} could not hash the input for the job's "
                             f"workers: {entry.get('error')}", where=str(self.path))
        return entry["sha256"]

    def _wait(self, t0: float) -> dict:
        while (entry := read_entry(self.file)) is None:
            if not self.publisher.alive():
                entry = read_entry(self.file)  # it may have published just before it ended
                if entry is not None:
                    return entry
                raise OutputError(f"{self.publisher.name}, which hashes the input for the "
                                  "job's workers, ended before it published the hash; run "
                                  "the job again (with --resume)")
            if time.perf_counter() - t0 > self.limit_s:
                raise OutputError(f"{self.publisher.name} published no hash of {self.path} "
                                  f"in {self.limit_s:.0f} s ({self.file} is missing); check "
                                  "that the output folder is writable, then run the job "
                                  "again (with --resume)")
            time.sleep(POLL_S)
        return entry

    def done(self) -> bool:
        return self.stop() is not None

    def stop(self) -> str | None:
        """The digest if it is published, else None (nothing of this process to stop)."""
        try:
            entry = read_entry(self.file)
        except OutputError:
            return None
        return entry.get("sha256") if entry else None


def worker_hash(top: Path, path: Path, parent: int | None, rank0: tuple | None
                ) -> SharedHash | InputHash:
    """What a worker's run waits on for the input's hash: the --gpus parent's (parent: its
    pid), else rank 0's under torchrun (rank0: its (host, pid)); a rank on another host than
    rank 0 cannot tell whether rank 0 still runs, so it hashes the input itself."""
    if parent is not None:
        return SharedHash(top, path, Publisher(f"the --gpus parent (pid {parent})", parent))
    host, pid = rank0
    if host != socket.gethostname():
        return InputHash(path)
    return SharedHash(top, path, Publisher(f"rank 0 (pid {pid})", pid))
