"""`graphrun run SPEC --ray`: the spec's input read with Ray's readers, mapped through one Runner
per actor (data.py), written with Ray's writers into the output folder, then rejects.jsonl
and manifest.json gathered from the actors' statistics and Ray's (manifest.py).

Order: the DataContext preserves order, so each write task holds the records after the
previous task's; the files are renamed part-00000.<format>, ... in task order, and reading
them in name order gives input order.
"""

from __future__ import annotations

import logging
import signal
import time
from pathlib import Path

from graphrun.base.tuning import Tuning
from graphrun.plan.auto import resolve_auto
from graphrun.read.formats import reader_for
from graphrun.read.formats import parquet_id_kind
from graphrun.read.stream import job_duplicates
from graphrun.base.errors import GraphrunError, InputError, Interrupted, OutputError, error_chain
from graphrun.job.signals import SignalTrap
from graphrun.write.folder import RAY_PART, locked, prepare_out_dir, unusable_folder
from graphrun.write.journal import REJECTS, reject_line
from graphrun.manifest.keys import Manifest, spec_digest, write_manifest
from graphrun.scale.ray.data import dataset_map, need_ray
from graphrun.scale.ray.manifest import RunFacts, ray_manifest
from graphrun.spec.keys import PipelineSpec
from graphrun.base.nofollow import open_file

READERS = (".parquet", ".jsonl", ".npy")
WRITERS = ("parquet", "jsonl")


def run_ray(spec: PipelineSpec, *, out: str | Path | None = None, address: str | None = None,
            workers: int | None = None, overwrite: bool = False, resume: bool = False,
            show: bool = False) -> Manifest:
    """Run the spec on a Ray cluster (address: an existing one; None: RAY_ADDRESS or a local
    cluster started here, or the one this process already joined). Returns the manifest."""
    ray = need_ray()
    check_supported(spec, resume)
    spec, bucket_plan = resolve_auto(spec)
    out_dir = Path(out).resolve() if out else spec.output.dir
    spec_json = spec.model_dump(mode="json")
    fingerprint = {"spec_sha256": spec_digest(spec_json), "input_sha256": None,
                   "model_sha256": None, "slice": [0, None], "shards": [spec.output.format],
                   "ray": True}
    facts = RunFacts(spec, spec_json, out_dir, bucket_plan, address)
    with locked(out_dir):
        try:
            prepare_out_dir(out_dir, resume=False, overwrite=overwrite,
                            fingerprint=fingerprint, input_path=spec.data.path)
        except OSError as err:
            raise unusable_folder(out_dir, err) from err
        stop = RayStop()
        try:  # a failure from here on leaves a failed manifest: the next run starts over
            with stop:
                # the ids of the whole file, before its records are spread over the actors
                duplicates = job_duplicates(spec)
                join_cluster(ray, address, show)
                stop.take_back()
                mapped = map_input(spec, ray, workers, duplicates)
                facts.workers = mapped.graphrun_workers
                facts.collector = mapped.graphrun_collector
                facts.stream_t0 = time.perf_counter()
                write_output(mapped, out_dir, spec)
                facts.stream_s = time.perf_counter() - facts.stream_t0
                facts.dataset_stats = mapped.stats()
                facts.status = "completed"
        except KeyboardInterrupt:
            signum = stop.signum or signal.SIGINT
            facts.status = "interrupted"
            facts.error = f"stopped by {signal.Signals(signum).name}"
            with SignalTrap():  # a second signal waits for the manifest
                finish(facts)
            raise Interrupted(signum, "the manifest says so; a Ray run is not resumed: run "
                              "it again with --overwrite") from None
        except Exception as err:  # noqa: BLE001 - a user error is unwrapped, others kept
            user = graphrun_cause(err, facts.collector)
            facts.status, facts.error = "failed", str(user or f"{type(err).__name__}: {err}")
            finish(facts)
            if user is not None:
                raise user from None
            raise
        return finish(facts)


class RayStop(SignalTrap):
    """SIGINT or SIGTERM stop a Ray run at once (a KeyboardInterrupt where the driver waits on
    Ray): the run then writes its manifest, interrupted, and exits 128 + the signal."""

    def _handle(self, signum, frame) -> None:
        self.signum = signum
        raise KeyboardInterrupt

    def take_back(self) -> None:
        """ray.init puts in a SIGTERM handler of its own (sys.exit, no manifest)."""
        if self._old:
            signal.signal(signal.SIGTERM, self._handle)


def check_supported(spec: PipelineSpec, resume: bool) -> None:
    if resume:
        raise OutputError("--resume is not supported with --ray: a Ray run writes its output "
                          "in one pass; run it again with --overwrite, or run without --ray "
                          "to have a resumable run")
    if spec.generate is not None:
        raise GraphrunError("a generation job (generate:) does not run with --ray: its actors "
                          "map batches of a forward pass; run it without --ray (--gpus N "
                          "spreads it over this machine's GPUs)")
    suffix = spec.data.path.suffix.lower()
    if suffix not in READERS:
        raise InputError(f"--ray reads {', '.join(READERS)} inputs with Ray's readers, not "
                         f"{suffix or 'this file'}: convert it (to Parquet, say) or run "
                         "without --ray", where=str(spec.data.path))
    if suffix == ".npy" and len(spec.inputs) != 1:
        raise InputError("a .npy file holds one input, the spec lists "
                         f"{len(spec.inputs)}", where=str(spec.data.path))
    if spec.output.format not in WRITERS:
        raise OutputError(f"output.format {spec.output.format} has no Ray writer in graphrun; "
                          f"--ray writes {' or '.join(WRITERS)}: set output.format: parquet")
    if not spec.data.path.is_file():
        raise InputError("input file not found", where=str(spec.data.path))
    # what makes the whole file unreadable, as one process says it (a Parquet column missing,
    # or of strings: Ray's reader would turn '1' into 1.0)
    reader_for(spec, Tuning.from_machine()).check()


def join_cluster(ray, address: str | None, show: bool) -> None:
    """Join the cluster at address (or RAY_ADDRESS's, or start a local one), unless this
    process is in one already; Ray's progress bars and its lines of information only where
    graphrun shows progress (not with -q)."""
    if not ray.is_initialized():
        try:
            ray.init(address=address, log_to_driver=show,
                     logging_level=logging.INFO if show else logging.WARNING)
        except Exception as err:  # noqa: BLE001 - ConnectionError, ValueError, ... by version
            raise GraphrunError(f"cannot join the Ray cluster at {address or 'RAY_ADDRESS'}: "
                                f"{err}; start one (`ray start --head`) or pass its "
                                "--address") from None
    if not show:  # -q: Ray Data's console lines too (each run's plan, start and end, hints)
        quiet_console(logging.getLogger("ray.data"))
    ray.data.DataContext.get_current().enable_progress_bars = show


def quiet_console(logger: logging.Logger) -> None:
    """The logger's console handlers at errors only; its files (the Ray session's
    logs/ray-data) keep every line."""
    for handler in logger.handlers:
        if isinstance(handler, logging.StreamHandler) and not isinstance(
                handler, logging.FileHandler):
            handler.setLevel(max(handler.level, logging.ERROR))


def map_input(spec: PipelineSpec, ray, workers: int | None,
              duplicates: dict[int, str] | None = None):
    """The input through Ray's reader for its format, mapped by a pool of Runner actors."""
    path, suffix = str(spec.data.path), spec.data.path.suffix.lower()
    ray.data.DataContext.get_current().execution_options.preserve_order = True
    if suffix == ".parquet":
        ds = ray.data.read_parquet(path)
    elif suffix == ".jsonl":  # lines, parsed by the actors as one process parses them
        from graphrun.scale.ray.jsonl import jsonl_lines_source

        ds = ray.data.read_datasource(jsonl_lines_source(spec.data.path))
    else:  # .npy: one column named "data"
        ds = ray.data.read_numpy(path).rename_columns({"data": next(iter(spec.inputs))})
    mapped = dataset_map(spec, ds, workers=workers, file=spec.data.path.name,
                         duplicates=duplicates, id_kind=parquet_id_kind(spec))
    return mapped


def write_output(mapped, out_dir: Path, spec: PipelineSpec) -> None:
    """graphrun's sink for output.format into out_dir (a task's rows in order, write.py says
    why; renamed in task order afterwards)."""
    from graphrun.scale.ray.write import OrderedJsonlSink, OrderedParquetSink

    sink = OrderedParquetSink if spec.output.format == "parquet" else OrderedJsonlSink
    mapped.write_datasink(sink(str(out_dir), spec.output.rows_per_file))


def rename_in_order(out_dir: Path) -> list[Path]:
    """Ray's files (this run's only: the folder held graphrun's files alone before it)
    renamed part-00000.<format>, ... in task order; returns the new paths."""
    found = []
    for p in out_dir.iterdir():
        m = RAY_PART.fullmatch(p.name)
        if m and p.is_file():
            found.append(((int(m.group(1)), int(m.group(3) or 0)), p, m.group(4)))
    renamed = []
    for k, (_, p, ext) in enumerate(sorted(found)):
        dest = out_dir / f"part-{k:05d}.{ext}"
        p.replace(dest)
        renamed.append(dest)
    return renamed


def finish(facts: RunFacts) -> Manifest:
    """Ray's files renamed, rejects.jsonl and manifest.json written, whatever the ending."""
    facts.files = rename_in_order(facts.out_dir)
    rejects = facts.collector.rejects() if facts.collector else []
    if rejects:
        with open_file(facts.out_dir / REJECTS, "w") as f:
            f.writelines(reject_line(r["index"], r["id"], r["where"], r["reason"]) + "\n"
                         for r in rejects)
    facts.rejects = len(rejects)
    manifest = ray_manifest(facts)
    write_manifest(manifest, facts.out_dir / "manifest.json")
    return manifest


def graphrun_cause(err: BaseException, collector) -> GraphrunError | None:
    """The GraphrunError that failed the run: raised here, or by an actor (which told the
    Collector: Ray's wrapping of it keeps only a traceback's text)."""
    told = collector.failure() if collector is not None else None
    if told is not None:
        return GraphrunError(told)
    return next((e for e in error_chain(err) if isinstance(e, GraphrunError)
                 and type(e).__module__.startswith("graphrun")), None)
