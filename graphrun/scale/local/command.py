"""`graphrun run` for a job of several workers: what the command line calls with --gpus, or
in a process torchrun started (WORLD_SIZE set); the same errors and exit codes as one run."""

from __future__ import annotations

from pathlib import Path

import click

from graphrun.base.errors import GraphrunError
from graphrun.manifest.keys import Manifest
from graphrun.scale.local.world import World


def run_job(spec, spec_path: Path, overrides, *, gpus: str | None, world: World | None,
            show: bool, **ask) -> Manifest | None:
    """The job's manifest where this process watches the job (the --gpus parent, rank 0
    under torchrun), after its summary; None in the other workers, which stay quiet."""
    if gpus is not None:
        if world is not None:
            raise GraphrunError("--gpus was given in a worker process (WORLD_SIZE is set, by "
                                "torchrun say): under torchrun drop --gpus, it starts the "
                                "workers itself")
        from graphrun.scale.local.workers import launch

        job = launch(spec, spec_path, overrides, gpus=gpus, show=show, **ask)
    else:
        from graphrun.scale.local.worker import run_worker

        job = run_worker(spec, world, show=show and world.rank == 0, **ask)
        if world.parent is not None or world.rank != 0:
            return None
    if show and not job.already_complete:  # the CLI says so in one line
        summary(job)
    return job


def summary(job: Manifest) -> None:
    from graphrun.job.progress import summary_table

    summary_table(job)
    for w in job.workers:
        click.echo(f"  rank {w.rank} ({w.device}): {w.status}, {w.records_out} records out "
                   f"of [{w.slice[0]}, {w.slice[1]}), setup {w.setup_s:.2f} s, "
                   f"{w.records_per_s:,.0f} records/s")
