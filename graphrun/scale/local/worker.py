"""One worker of a job: a full graphrun run of its share of the records, on its own device,
capturing its own graphs; its shards go into the job's folder, its journal into its own.

Started by `graphrun run --gpus N` (the parent prepared the folder and merges the manifest)
or by torchrun, where there is no parent: rank 0 prepares the folder while the others wait
(a gloo rendezvous, which also tells every worker the others' pids), hashes the input and
the model's files for all of them (input_digest.py), and merges the manifest once every
worker ended; a worker whose process is gone without ending is named, not waited for.
"""

from __future__ import annotations

import datetime as dt
import os
import signal
import socket
import threading
import time
from contextlib import nullcontext
from pathlib import Path

from graphrun.base.errors import GraphrunError, Interrupted, OutputError
from graphrun.write.folder import locked, read_mark
from graphrun.write.journal import ShardPlace
from graphrun.manifest.keys import Manifest
from graphrun.scale.local.input_digest import PublishedHash, worker_hashes
from graphrun.scale.local.job_folder import prepare_job
from graphrun.write.job_layout import is_job, manifest_since, progress_file, shares, worker_dir
from graphrun.scale.local.merge import merge
from graphrun.scale.local.watch import JobProgress, ProgressFile, outcome
from graphrun.scale.local.world import World, alive, watch_parent, worker_cores, worker_device
from graphrun.base.phases import utc_now
from graphrun.base.tuning import Tuning

RENDEZVOUS_S = 1800  # how long workers wait for rank 0 to prepare the folder


def run_worker(spec, world: World, *, out, resume: bool, overwrite: bool,
               accept_model_change: bool, start: int, stop: int | None, show: bool
               ) -> Manifest | None:
    """Run this worker's share. Under torchrun, rank 0 returns the job's manifest (others
    return their own); a launched worker returns its own."""
    top = Path(out).resolve() if out else spec.output.dir
    watch_parent(world)
    since, started, t0 = time.time(), utc_now(), time.perf_counter()
    if world.parent is None:
        mark, peers = rendezvous(top, spec, world, resume=resume, overwrite=overwrite,
                                 start=start, stop=stop)
    else:
        mark, peers = launched_mark(top, world), None
    # the job's input and model hashes, once: the --gpus parent publishes them, under
    # torchrun rank 0
    publishing = (PublishedHash.of(top, spec) if world.parent is None and world.rank == 0
                  else nullcontext())
    with publishing:
        return run_rank(spec, world, top, mark, peers, (since, started, t0), show=show,
                        resume=resume, accept_model_change=accept_model_change)


def run_rank(spec, world: World, top: Path, mark: dict, peers: list | None, times: tuple, *,
             show: bool, resume: bool, accept_model_change: bool) -> Manifest | None:
    """This rank's share on its device; rank 0 under torchrun then waits for the others and
    merges the job's manifest. times: the job's (since, started, t0) for the merge."""
    since, started, t0 = times
    hashes = worker_hashes(top, spec, world.parent, peers and peers[0])
    devices = [worker_device(spec.device, k % world.local_size) for k in range(world.size)]
    cores = worker_cores(world.local_size)
    import torch

    if devices[world.rank] == "cpu":
        torch.set_num_threads(cores)
    else:  # streams, events and pinned memory made without a device land on this one
        torch.cuda.set_device(devices[world.rank])
    watcher = None
    if world.parent is None and world.rank == 0:
        watcher = Watcher(JobProgress(top, mark, show))
    own = failure = None
    try:
        own = run_share(spec.model_copy(update={"device": devices[world.rank]}), top,
                        world.rank, shares(mark)[world.rank], hashes, resume=resume,
                        cores=cores, accept_model_change=accept_model_change,
                        job=(shares(mark)[0][0], shares(mark)[-1][1]))
    except GraphrunError as err:
        failure = err
    finally:
        if watcher is not None:
            watcher.stop()
    if watcher is None:
        if failure is not None:
            raise failure
        return own
    # rank 0 under torchrun: the job ends when every worker has (and has its input hash)
    ends = watcher.wait(top, world, peers, since)
    if failure is not None and ends[0] is None and not manifest_since(top, 0, since):
        ends[0] = ("failed", str(failure))
    return job_result(merge(top, spec, mark, ends, devices, t0, started, since), failure)


def job_result(job: Manifest, failure: BaseException | None = None) -> Manifest:
    """The job's manifest if it completed; else the error that names the worker and says
    what to do."""
    if job.status == "completed":
        return job
    if job.status == "interrupted":
        raise Interrupted(failure.signum if isinstance(failure, Interrupted) else signal.SIGTERM)
    bad = next(w for w in job.workers if w.status == "failed")
    failed = [w for w in job.workers if w.status == "failed"]
    todo = ("what every worker committed is kept: run the same command again with --resume "
            "to complete the job")
    if (bad.error or "").startswith("failed:"):  # its own error says what to fix first
        todo = "fix that, then run the same command with --resume (" + todo.split(":")[0] + ")"
    elif "cannot resume" in (bad.error or ""):  # a refused --resume says itself what to do
        todo = todo.split(":")[0]
    raise JobFailed(f"worker rank {bad.rank} ({bad.device}) {bad.error}. {todo[0].upper()}"
                    f"{todo[1:]}; {len(failed)} of {len(job.workers)} workers failed, "
                    "manifest.json's workers say how each ended")


class JobFailed(GraphrunError):
    """A worker of the job failed or died; its committed work is kept for --resume."""

    exit_code = 1


def run_share(spec, top: Path, rank: int, share: tuple, hashes, *, resume: bool,
              cores: int, accept_model_change: bool, job: tuple = (0, None)) -> Manifest:
    """The spine's run() over [start, stop), shards numbered [first, end), into the job's
    folder (shared with the other workers; its own folder locked by run()); hashes: the
    input's and model's digests as the job shares them (input_digest.worker_hashes).
    job: the job's [start, stop) of the input (rank 0's share's start, the last share's
    stop), from which ids count for duplicates and `buckets: auto` plans."""
    from graphrun.job.spine import run

    start, stop, first, end = share
    progress = ProgressFile(progress_file(top, rank))
    state = "failed"
    try:
        with locked(top, shared=True):
            manifest = run(spec, out=worker_dir(top, rank), resume=resume, start=start,
                           stop=stop, place=ShardPlace(top, first, end, *job),
                           progress=progress, tuning=Tuning.from_machine(cores=cores),
                           accept_model_change=accept_model_change, hashes=hashes)
        state = manifest.status
        return manifest
    except Interrupted:
        state = "interrupted"
        raise
    finally:
        progress.end(state)


def launched_mark(top: Path, world: World) -> dict:
    mark = read_mark(top)
    if not is_job(mark) or len(mark["workers"]) != world.size:
        raise OutputError(f"{top} is not the folder of a job of {world.size} workers that "
                          "`graphrun run --gpus` prepared; start workers with --gpus or torchrun")
    return mark


def rendezvous(top: Path, spec, world: World, **ask) -> tuple[dict, list]:
    """Rank 0 prepares the folder (locked) while the others wait; every worker learns the
    job's mark, and rank 0 each worker's (host, pid)."""
    import torch.distributed as dist

    dist.init_process_group("gloo", timeout=dt.timedelta(seconds=RENDEZVOUS_S))
    try:
        box: list = [None]
        if world.rank == 0:
            try:
                with locked(top):
                    box = [prepare_job(top, spec, world.size, **ask)]
            except GraphrunError as err:
                box = [f"{type(err).__name__}: {err}"]
        dist.broadcast_object_list(box, src=0)
        peers: list = [None] * world.size
        dist.all_gather_object(peers, (socket.gethostname(), os.getpid()))
    finally:
        dist.destroy_process_group()
    if isinstance(box[0], str):
        raise OutputError(f"rank 0 could not prepare the output folder: {box[0]}")
    return box[0], peers


class Watcher:
    """Rank 0 under torchrun: the job's bar while it runs its own share, then the wait."""

    def __init__(self, bar: JobProgress):
        self.bar, self._stop = bar, threading.Event()
        self._thread = threading.Thread(target=self._loop, name="graphrun-job-progress",
                                        daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        while not self._stop.wait(0.2):
            self.bar.poll()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()

    def wait(self, top: Path, world: World, peers: list, since: float) -> list:
        """Every worker's end (watch.outcome); a worker of this host whose process is gone
        without ending is dead, not waited for."""
        host = socket.gethostname()
        while True:
            states = self.bar.poll()
            gone = [k for k, (h, pid) in enumerate(peers)
                    if states[k] is None and h == host and not alive(pid)]
            if all(s is not None or k in gone for k, s in enumerate(states)):
                break
            time.sleep(0.1)
        self.bar.close()
        return [("failed", f"died: its process (pid {peers[k][1]}) is gone, its share "
                 "unfinished; torchrun's log says how") if k in gone
                else None if k == world.rank else outcome(top, k, None, states[k], since)
                for k in range(world.size)]

