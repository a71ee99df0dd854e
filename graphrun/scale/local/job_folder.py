"""The job's output folder made ready before its workers start: by `graphrun run --gpus N`,
or by rank 0 under torchrun. The rules are one process's (folder.py): a new or empty folder is
used; --overwrite replaces only graphrun's files; --resume continues the same job (the same
spec, slice and number of workers); otherwise an existing run is refused.
"""

from __future__ import annotations

from pathlib import Path

from graphrun.base.errors import OutputError
from graphrun.write.folder import (ended_with_nothing_committed, input_inside, read_mark,
                                   shard_shaped, split_entries, write_fingerprint)
from graphrun.write.guard import only_a_first_mark_temp, refuse_foreign
from graphrun.write.journal import (SPEC_COPY, ShardPlace, listed_names, remove_and_sync,
                                    shard_number)
from graphrun.manifest.keys import spec_digest
from graphrun.write.sinks import shard_suffixes
from graphrun.job.progress import count_records
from graphrun.write.job_layout import digest_file, is_job, progress_file, shares
from graphrun.scale.local.world import split


def job_mark(spec, workers: int, start: int, stop: int | None) -> dict:
    """The job's run.json: the spec's digest, the shard suffixes, and each worker's share."""
    total = count_records(spec, start, stop)
    if total is None:  # the file cannot say: the reader names the problem
        from graphrun.read.stream import read_batches

        next(read_batches(spec, start=start, stop=start), None)
        raise OutputError(f"cannot count the records of {spec.data.path} to share them out "
                          "between workers; check that it is readable")
    end = start + total
    return {"spec_sha256": spec_digest(spec.model_dump(mode="json")),
            "input_sha256": None, "model_sha256": None, "slice": [start, stop],
            "shards": shard_suffixes(spec.output.format, list(spec.outputs)),
            "workers": [{"slice": [s, e], "shards": [f, g]} for s, e, f, g in
                        split(start, end, workers, spec.output.rows_per_file,
                              spec.data.batch_size)],
            SPEC_COPY: spec.model_dump(mode="json")}


def prepare_job(top: Path, spec, workers: int, *, resume: bool, overwrite: bool, start: int,
                stop: int | None) -> dict:
    """Make `top` ready for a job of `workers` processes; returns its mark (run.json). Call it
    with the folder locked. The workers' progress files and the input's digest of an earlier
    attempt are removed."""
    if resume and overwrite:
        raise OutputError("--resume and --overwrite exclude each other; pass one of them")
    if input_inside(top, spec.data.path):
        raise OutputError(f"the output folder {top} holds the input file {spec.data.path}; "
                          "pick another output folder (--out or output.dir)")
    if top.exists() and only_a_first_mark_temp(top):  # killed as it first wrote run.json
        remove_and_sync(top, list(top.iterdir()))
    if top.exists() and any(top.iterdir()):
        if resume:
            mark = resumed_mark(top, spec, workers, start, stop)
            # before anything is removed: a worker's restore would have to remove a user's entry
            shaped = refuse_foreign(top, shard_shaped(top, mark.get("shards") or []))
            refuse_outside(top, mark, shaped)
            # an earlier attempt's progress, and its input hash: this one hashes the input anew
            stale = [progress_file(top, k) for k in range(workers)] + [digest_file(top)]
            remove_and_sync(top, [p for p in stale if p.exists()])
            return mark
        clear(top, overwrite)
    top.mkdir(parents=True, exist_ok=True)
    mark = job_mark(spec, workers, start, stop)
    write_fingerprint(top, mark)
    return mark


def refuse_outside(top: Path, mark: dict, shaped: list[Path]) -> None:
    """OutputError naming the files named as shards that no worker's share numbers (no
    worker writes them: a file put there, which a completed job would otherwise not see)."""
    places = [ShardPlace(top, first, end) for _, _, first, end in shares(mark)]
    suffixes = mark.get("shards") or []
    outside = [p for p in shaped
               if not any(place.holds(shard_number(p.name, suffixes)) for place in places)]
    if outside:
        raise OutputError(f"cannot resume {top}: it holds {listed_names(outside)}, named as the "
                          "job's shards but numbered outside every worker's share (graphrun "
                          "did not write them): move them out of the folder, or --overwrite "
                          "to start over")


def clear(top: Path, overwrite: bool) -> None:
    """Remove an earlier run's files: asked (--overwrite), or it ended with nothing committed."""
    own, foreign = split_entries(top)
    if overwrite and foreign:
        raise OutputError(f"output folder {top} holds files graphrun did not write "
                          f"({listed_names(foreign)}); refusing to --overwrite it: move them "
                          "away or pick another output folder")
    if not overwrite:
        if not own:
            raise OutputError(f"output folder {top} is not empty ({listed_names(foreign)}); "
                              "pick a new or empty folder")
        if foreign or not ended_with_nothing_committed(top):
            raise OutputError(f"output folder {top} exists and holds a run; pass --resume to "
                              "continue it or --overwrite to replace it")
    remove_and_sync(top, own)


def resumed_mark(top: Path, spec, workers: int, start: int, stop: int | None) -> dict:
    """The job's mark, if the folder holds this very job; else OutputError saying why not."""
    mark = read_mark(top)
    if mark is None:
        raise OutputError(f"output folder {top} has no run.json graphrun wrote, so it cannot "
                          "be resumed; rerun with --overwrite to replace it")
    if not is_job(mark):
        raise OutputError(f"output folder {top} holds a run of one process: resume it with "
                          "`graphrun run SPEC --resume`, without --gpus or torchrun")
    try:
        count = len(shares(mark))
    except (ValueError, KeyError, TypeError):
        raise OutputError(f"{top / 'run.json'} does not list its workers as graphrun wrote "
                          "them; rerun with --overwrite") from None
    if count != workers:
        raise OutputError(f"output folder {top} holds a job of {count} workers: resume it with "
                          f"--gpus {count} (or torchrun --nproc-per-node {count}), or start "
                          "over with --overwrite")
    if mark.get("spec_sha256") != spec_digest(spec.model_dump(mode="json")):
        from graphrun.write.folder import spec_change_text, spec_changes

        differ = spec_changes(top, spec.model_dump(mode="json"))  # the job's manifest, if any
        if differ:
            said, again = spec_change_text(differ)
            tail = f" ({said}); {again}--overwrite starts over, or pick another output folder"
        else:
            tail = "; rerun with --overwrite to start over, or pick another output folder"
        raise OutputError(f"cannot resume {top}: the spec changed since the job started{tail}")
    if mark.get("slice") != [start, stop]:
        raise OutputError(f"cannot resume {top}: the job read records {mark.get('slice')} "
                          f"(--start, --stop), not {[start, stop]}; give the same")
    return mark
