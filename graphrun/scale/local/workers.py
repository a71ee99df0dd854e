"""`graphrun run SPEC --gpus N|all`: one worker process per GPU (N CPU workers for a spec of
device: cpu), started with torchrun's variables, so that they run the very code they run under
torchrun (worker.py). The parent prepares the folder, hashes the input and the model's
files once for them (input_digest.py), forwards SIGINT and SIGTERM, shows one progress bar,
stops the other workers when one fails (they commit what is finished), and merges their
manifests into the job's.
"""

from __future__ import annotations

import fcntl
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from graphrun.base.errors import GraphrunError, Interrupted, OutputError
from graphrun.base.phases import utc_now
from graphrun.write.folder import locked
from graphrun.manifest.keys import Manifest
from graphrun.scale.local.input_digest import PublishedHash
from graphrun.scale.local.job_folder import prepare_job
from graphrun.write.job_layout import WORKERS, log_file, manifest_since, progress_file, worker_dir
from graphrun.write.journal import JOURNAL
from graphrun.scale.local.merge import merge
from graphrun.scale.local.watch import JobProgress, last_line, outcome, read_progress
from graphrun.scale.local.worker import JobFailed, job_result
from graphrun.scale.local.world import worker_device
from graphrun.job.signals import SignalTrap
from graphrun.base.nofollow import open_file


def worker_count(gpus: str, spec) -> int:
    """--gpus N|all as a number of workers: CUDA devices, or CPU processes for device: cpu."""
    try:
        n = 0 if gpus == "all" else int(gpus)
    except ValueError:
        n = -1
    if n < 0 or (n == 0 and gpus != "all"):
        raise GraphrunError(f"--gpus {gpus!r}: give a number of workers (1 or more) or all")
    if n and spec.device == "cpu":  # the workers' own processes import torch, this one need not
        return n
    import torch

    cuda = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if gpus == "all":
        if not cuda:
            raise GraphrunError("--gpus all: this machine has no CUDA device "
                                "(torch.cuda.is_available() is False); for worker processes on "
                                "the CPU set device: cpu and give their number (--gpus 2)")
        return cuda
    if not cuda:
        raise GraphrunError(f"--gpus {n}: this machine has no CUDA device "
                            "(torch.cuda.is_available() is False); to run the job in "
                            f"{n} worker processes on the CPU, set device: cpu "
                            "(--set device=cpu)")
    if n > cuda:
        raise GraphrunError(f"--gpus {n}: this machine has {cuda} CUDA device(s); pass "
                            f"--gpus {cuda} or --gpus all")
    return n


def launch(spec, spec_path: Path, overrides, *, gpus: str, out, resume: bool, overwrite: bool,
           accept_model_change: bool, start: int, stop: int | None, show: bool) -> Manifest:
    """Run the job in worker processes; returns its manifest, or raises the error that names
    a failed worker (worker.job_result)."""
    n = worker_count(gpus, spec)
    top = Path(out).resolve() if out else spec.output.dir
    since, started, t0 = time.time(), utc_now(), time.perf_counter()
    devices = [worker_device(spec.device, k) for k in range(n)]
    with locked(top) as lock:
        mark = prepare_job(top, spec, n, resume=resume, overwrite=overwrite, start=start,
                           stop=stop)
        journals = journal_sizes(top, n)
        if lock.fd is not None:  # the workers share the folder; a one-process run stays out
            fcntl.flock(lock.fd, fcntl.LOCK_SH)
        # the input and model hashed once for the job, beside the workers' start
        with Forward() as forward, PublishedHash.of(top, spec):
            forward.procs = start_workers(spec_path, overrides, top, n, resume=resume,
                                          accept_model_change=accept_model_change)
            if forward.signum:  # it came while they started
                forward.send(forward.signum)
            stopped = watch(forward, JobProgress(top, mark, show))
        ends = [outcome(top, k, p.returncode, read_progress(progress_file(top, k))[1], since,
                        stopped) for k, p in enumerate(forward.procs)]
        if resume and any(ends) and nothing_ran(top, n, since, journals):
            raise untouched(top, ends, devices, forward)
        job = merge(top, spec, mark, ends, devices, t0, started, since)
    return job_result(job, Interrupted(forward.signum) if forward.signum else None)


def journal_sizes(top: Path, n: int) -> list[int | None]:
    """Each worker's journal's size (None: none yet): one that grew committed something."""
    sizes = []
    for k in range(n):
        try:
            sizes.append((worker_dir(top, k) / JOURNAL).stat().st_size)
        except OSError:
            sizes.append(None)
    return sizes


def nothing_ran(top: Path, n: int, since: float, journals: list[int | None]) -> bool:
    """No worker wrote a manifest or committed a shard in this attempt: each stopped before
    its run began (a refused --resume, say)."""
    return (not any(manifest_since(top, k, since) for k in range(n))
            and journal_sizes(top, n) == journals)


def untouched(top: Path, ends: list, devices: list[str], forward) -> GraphrunError:
    """The error of a --resume whose workers all stopped before their runs began. As for a
    refused one-process --resume, the folder is left as it was, the job's manifest included."""
    if forward.signum:
        return Interrupted(forward.signum)
    k = next((k for k, e in enumerate(ends) if e is not None and e[0] == "failed"), 0)
    rc = forward.procs[k].returncode
    err = OutputError if rc == OutputError.exit_code else JobFailed
    line = last_line(log_file(top, k)).removeprefix("error: ")
    return err(f"worker rank {k} ({devices[k]}): {line} (no worker ran: the job's folder is "
               "as it was)")


def start_workers(spec_path: Path, overrides, top: Path, n: int, *, resume: bool,
                  accept_model_change: bool) -> list[subprocess.Popen]:
    """N `python -m graphrun run` processes with RANK, WORLD_SIZE, LOCAL_RANK set, each in
    its own session (a terminal's Ctrl-C reaches the parent, which forwards it once), its
    output into workers/rank-K.log."""
    from graphrun.base.errors import debugging

    cmd = [sys.executable, "-m", "graphrun", *(["--debug"] if debugging() else []), "run",
           str(spec_path), "--out", str(top), "-q",
           *[a for o in overrides for a in ("--set", o)],
           *(["--resume"] if resume else []),
           *(["--accept-model-change"] if accept_model_change else [])]
    (top / WORKERS).mkdir(exist_ok=True)
    procs: list[subprocess.Popen] = []
    try:
        for k in range(n):
            env = dict(os.environ, RANK=str(k), WORLD_SIZE=str(n), LOCAL_RANK=str(k),
                       LOCAL_WORLD_SIZE=str(n), GRAPHRUN_JOB_PARENT=str(os.getpid()))
            with open_file(log_file(top, k), "wb") as log:
                procs.append(subprocess.Popen(cmd, env=env, stdin=subprocess.DEVNULL,
                                              stdout=log, stderr=log, start_new_session=True))
    except BaseException:
        for p in procs:
            p.kill()
            p.wait()
        raise
    return procs


class Forward(SignalTrap):
    """SIGINT and SIGTERM to the parent go to every worker still running (each commits what is
    finished and stops; a second signal stops them at once, as for one process)."""

    def __init__(self):
        super().__init__()
        self.procs: list[subprocess.Popen] = []

    def _handle(self, signum, frame) -> None:
        self.signum = signum
        self.send(signum)

    def send(self, signum: int) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.send_signal(signum)


def watch(forward: Forward, bar: JobProgress) -> int:
    """Wait for every worker, the bar moving; when one fails on its own, stop the others.
    Returns the signal the job was stopped with (0: none)."""
    stopping = 0
    while True:
        codes = [p.poll() for p in forward.procs]
        if all(c is not None for c in codes):
            break
        if not stopping and not forward.signum and any(c not in (None, 0) for c in codes):
            stopping = signal.SIGTERM
            forward.send(stopping)
        bar.poll()
        time.sleep(0.1)
    bar.close()
    return forward.signum or stopping
