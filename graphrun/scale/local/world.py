"""Who this process is in a job of several workers, and what share of the records it takes.

A worker learns its place from torchrun's variables (RANK, WORLD_SIZE, LOCAL_RANK,
LOCAL_WORLD_SIZE), whether torchrun or `graphrun run --gpus N` started it; the latter also
sets GRAPHRUN_JOB_PARENT (it prepared the output folder, and merges the manifest itself).
"""

from __future__ import annotations

import math
import os
import signal
import threading
import time
from dataclasses import dataclass

from graphrun.base import envs
from graphrun.base.cores import usable_cores
from graphrun.base.errors import GraphrunError

# a share aligned to this many units of output.rows_per_file (or of the batch) is balanced to
# within 1/BALANCE of a worker's records
BALANCE = 20


@dataclass(frozen=True)
class World:
    rank: int
    size: int
    local_rank: int
    local_size: int
    parent: int | None  # the pid of `graphrun run --gpus`, which started this worker

    @classmethod
    def from_env(cls, environ=None) -> "World | None":
        """The worker's place, or None outside a job (no WORLD_SIZE, or torchrun's 1: a plain
        run; `--gpus 1` still makes a job of one worker)."""
        env = os.environ if environ is None else environ
        parent = envs.get("GRAPHRUN_JOB_PARENT", env)
        if env.get("WORLD_SIZE", "").strip() in ("", "1") and not parent:
            return None
        try:
            size = int(env["WORLD_SIZE"])
            rank = int(env.get("RANK", ""))
            local = int(env.get("LOCAL_RANK", rank))
            local_size = int(env.get("LOCAL_WORLD_SIZE", size))
        except ValueError:
            raise GraphrunError(
                "WORLD_SIZE is set, so this is one worker of a job, but RANK, LOCAL_RANK or "
                "LOCAL_WORLD_SIZE is not a whole number: start the workers with torchrun "
                "(which sets them) or with `graphrun run SPEC --gpus N`") from None
        if not (0 <= rank < size and 0 <= local < local_size):
            raise GraphrunError(f"RANK={rank} / LOCAL_RANK={local} is outside WORLD_SIZE={size} "
                                f"/ LOCAL_WORLD_SIZE={local_size}: start the workers with "
                                "torchrun or `graphrun run SPEC --gpus N`")
        return cls(rank, size, local, local_size, int(parent) if parent.isdigit() else None)

    def name(self, device: str | None) -> str:
        return f"rank {self.rank}" + (f" ({device})" if device else "")


def split(start: int, stop: int, workers: int, rows_per_file: int, batch_size: int
          ) -> list[tuple[int, int, int, int]]:
    """Contiguous shares of the records [start, stop): (start, stop, first shard, end shard) per
    worker. Equal shares keep identical devices busy to the end; their bounds are aligned to
    whole shards and batches where that keeps them balanced, so that shards and batches are
    those of one process. Worker k numbers its shards from the shards the shares before it may
    write (a share of n records writes at most ceil(n / rows_per_file)), so every name is
    unique and name order is input order."""
    n = stop - start
    unit = next((u for u in (math.lcm(rows_per_file, batch_size), rows_per_file, batch_size)
                 if u * BALANCE * workers <= n), batch_size)
    bounds = [start + min(n, round(n * k / workers / unit) * unit) for k in range(workers)]
    bounds.append(stop)
    out, shard = [], 0
    for k in range(workers):
        count = math.ceil((bounds[k + 1] - bounds[k]) / rows_per_file)
        out.append((bounds[k], bounds[k + 1], shard, shard + count))
        shard += count
    return out


def worker_device(device: str, local_rank: int) -> str:
    """cuda:LOCAL_RANK where the spec asks for CUDA (auto on a CUDA machine); cpu stays cpu."""
    if device == "cpu":
        return "cpu"
    import torch  # only where CUDA may be asked for: a CPU job's parent needs no torch

    if device == "auto" and not torch.cuda.is_available():
        return "cpu"
    return f"cuda:{local_rank}"


def worker_cores(local_size: int) -> int:
    """This worker's part of the host's cores (torch's threads, the reader's pools)."""
    return max(1, usable_cores() // local_size)


def watch_parent(world: World, poll_s: float = 0.2, grace_s: float | None = None) -> None:
    """A launched worker ends when its parent dies, instead of running on unwatched, holding
    the folder's lock: PR_SET_PDEATHSIG sends it SIGTERM (Linux: it commits and stops), and a
    watchdog thread (everywhere) sees os.getppid() change, sends SIGTERM itself where prctl is
    missing, and ends the process at once if the stop has not ended it within grace_s (a stop
    that hangs must not keep the lock from --resume; what is journaled is intact, as after
    kill -9)."""
    if world.parent is None:
        return
    grace_s = ORPHAN_GRACE_S if grace_s is None else grace_s
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
        signalled = True
    except (OSError, AttributeError):
        signalled = False
    threading.Thread(target=_orphan_watchdog, args=(world.parent, poll_s, grace_s, signalled),
                     name="graphrun-parent-watch", daemon=True).start()
    if os.getppid() != world.parent:  # it died before prctl took effect
        os.kill(os.getpid(), signal.SIGTERM)


# How long an orphaned worker's own stop (the batch in flight, its commits) may take before
# the watchdog ends the process.
ORPHAN_GRACE_S = 5.0


def _orphan_watchdog(parent: int, poll_s: float, grace_s: float, signalled: bool) -> None:
    while os.getppid() == parent:
        time.sleep(poll_s)
    if not signalled:  # no PR_SET_PDEATHSIG here: the stop it would have started
        os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(grace_s)
    os._exit(128 + signal.SIGTERM)  # still here: the stop hung; the kernel frees the lock


def alive(pid: int) -> bool:
    """A process of this host runs under that pid (one of another user's counts)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
