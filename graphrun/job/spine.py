"""run(spec): the whole job, file -> outputs + manifest. The spine of graphrun; one screen.

spec -> Runner (engine/: model, lanes of static buffers, capture, verify), or for a generation
spec GenerationRunner (generate/: model, slots, KV blocks, graphs) -> stream (read, check,
batch) -> feed (stage, launch, result on three threads, through the runner's launcher: the
Launcher, or generation's Scheduler) -> write (shards, rejects, journal) -> manifest.
"""

from __future__ import annotations

import json
import signal
import threading
import time
from concurrent.futures import Future
from numbers import Integral
from pathlib import Path

from graphrun.base.errors import GraphrunError, InputError, Interrupted, OutputError
from graphrun.manifest.keys import Manifest
from graphrun.spec.keys import PipelineSpec
from graphrun.job.parts import JobParts
from graphrun.job.progress import Progress, summary_table
from graphrun.generate.records import with_implied_io
from graphrun.engine.device_start import DeviceStart
from graphrun.engine.lazy import data_needs, look_ahead
from graphrun.feed.loop import OVERLAP_ENV, overlap_choice
from graphrun.read.grouping import PaddingCount
from graphrun.base.phases import BEFORE_RUN, PhaseClock, phase
from graphrun.job.state import JobRunner, RunHashes, RunRecord, RunResources
from graphrun.job.signals import StopSignals
from graphrun.write.finished import FinishedLog
from graphrun.read.stream import ReadAhead, padded_batches
from graphrun.read.formats import first_fields
from graphrun.read.prompts import parameter_warnings
from graphrun.read.text import TextCuts
from graphrun.base.tuning import Tuning
from graphrun.write.folder import completed_manifest, locked, prepare_out_dir, unusable_folder
from graphrun.write.journal import SPEC_COPY, ShardPlace
from graphrun.write.disk import write_failure, write_remedy
from graphrun.write.sinks import shard_suffixes


def run(spec, *, out: str | Path | None = None, resume: bool = False, overwrite: bool = False,
        show: bool = False, start: int = 0, stop: int | None = None,
        overlap: bool | None = None, tuning: Tuning | None = None,
        accept_model_change: bool = False, place: ShardPlace | None = None,
        progress=None, clock: PhaseClock | None = None,
        hashes: RunHashes | None = None, parts: JobParts | None = None) -> Manifest:
    """Run the pipeline; returns the manifest (also written to <out>/manifest.json).

    start/stop select a slice of the input's records (one process per GPU reads its own).
    overlap: True for the overlapped data path (feed/loop.py), False for the serial one; None
    (the default) takes GRAPHRUN_OVERLAP (on | off | auto) from the environment, and auto is
    overlapped on a GPU and serial on the CPU, where torch's own threads run the model on
    every core and the stream's threads would take cores from it. tuning: the reader's and
    writer's threads and chunk sizes (default: Tuning.from_machine(), from the cores and the
    GRAPHRUN_* variables). accept_model_change: --resume goes on although a model file
    (weights, archive, target source) changed, for a change that does not alter outputs.

    The output folder is locked for the whole run (folder.FolderLock). A signal before the
    stream starts stops the run at once; during the stream the batch in flight finishes.
    clock: the process's phases (phases.py; the CLI's holds its imports), else a new one.
    hashes: where the input's and model's sha256 come from (a job's worker: the digests its
    job hashed once, scale/local/input_digest.py), else this run hashes them (RunHashes.own).
    parts: the runner, reader, stream and writer it builds and calls (job/parts.py), else
    graphrun's own."""
    check_call(spec, start, stop)
    clock = clock or PhaseClock(BEFORE_RUN)
    with clock.active():
        window = (place.job_start, place.job_stop) if place else (start, stop)
        record, held, overlap = new_job(spec, out, overlap, tuning, clock, hashes, parts,
                                        window)
    stop_signal = StopSignals()
    try:
        with stop_signal, clock.active(), locked(record.out_dir):
            manifest = run_locked(record, held, stop_signal, resume=resume, overwrite=overwrite,
                                  accept_model_change=accept_model_change, show=show,
                                  start=start, stop=stop, overlap=overlap, place=place,
                                  progress=progress)
    except KeyboardInterrupt:  # a signal before the run's folder was ready: nothing written
        raise Interrupted(stop_signal.signum or signal.SIGINT) from None
    finally:
        held.stop_hashes()
    if manifest.already_complete:
        return manifest
    if show:
        summary_table(manifest, shown=record.printed)
    if stop_signal.signum and manifest.status == "completed":  # it came after the last record
        raise Interrupted(stop_signal.signum, after="the run had completed, every record "
                          "written (manifest.json says so); nothing is left to resume")
    if stop_signal.signum:
        raise Interrupted(stop_signal.signum)
    return manifest


def check_call(spec, start: int, stop: int | None) -> None:
    """What graphrun.run is given, refused before any work or output folder."""
    if not isinstance(spec, PipelineSpec):
        raise GraphrunError(f"graphrun.run takes a PipelineSpec, got {type(spec).__name__}: "
                            "graphrun.load_spec(path) reads a spec file into one")
    for name, value in (("start", start), ("stop", stop)):  # "3" was a TypeError at start < 0
        if value is not None and (isinstance(value, bool) or not isinstance(value, Integral)):
            raise InputError(f"{name}={value!r} is not a whole number: give 0 <= start <= stop "
                             "as ints (stop=None: to the end of the input)")
    if start < 0 or (stop is not None and stop < start):
        said = f"start={start} is negative" if start < 0 else f"stop={stop} is before start={start}"
        raise InputError(f"{said}: give 0 <= start <= stop (the records [start, stop) of the "
                         "input; stop is the record to stop before)")


def run_locked(record: RunRecord, held: RunResources, stop_signal: StopSignals, *, resume: bool, overwrite: bool,
               accept_model_change: bool, show: bool, start: int, stop: int | None,
               overlap, place: ShardPlace | None = None, progress=None) -> Manifest:
    """The run, its output folder locked: prepare it, set up, stream, and write the manifest
    whatever happens (a write of it failing on a full disk fails the run with one message,
    not a second traceback over the first error)."""
    spec, out_dir = record.spec, record.out_dir  # buckets: auto planned
    # The input and model files are hashed beside setup (journal.InputHash); --resume needs
    # them first, to compare, and a new run records them in run.json before streaming.
    with phase("input hash wait"):
        fingerprint = {"spec_sha256": record.spec_sha,
                       "input_sha256": held.input_hash.result() if resume else None,
                       "model_sha256": held.model_hash.result() if resume else None,
                       "slice": [start, stop],
                       "shards": shard_suffixes(spec.output.format, list(spec.outputs)),
                       SPEC_COPY: record.spec_json}
    if place is not None:
        fingerprint["shard_range"] = [place.first, place.end]
    held.place = place
    with phase("output folder"):
        done = (completed_manifest(out_dir, fingerprint, with_model=not accept_model_change,
                                   shard_dir=place and place.folder) if resume else None)
    if done is not None:  # --resume of a completed run: nothing to do, nothing rewritten
        return done
    resume_point, start = open_out_dir(record, held, fingerprint, resume, overwrite, start,
                                       accept_model_change)
    progress = progress or Progress(show, total=None)  # total: counted beside setup
    try:
        run_stream(record, held, fingerprint, resume_point, start, stop, overlap, progress,
                   stop_signal, show)
        record.status = "interrupted" if stop_signal.signum else "completed"
    except GraphrunError as err:
        record.status, record.error = "failed", str(err)
        raise
    except OSError as err:  # the disk: full, gone, not writable
        record.status = "failed"
        record.error = write_failure(out_dir, err)
        raise OutputError(f"{record.error}; {write_remedy(out_dir, err)}") from err
    except KeyboardInterrupt:
        # A signal during setup, or a second one while streaming: stopped at once, the batch
        # in flight dropped. What is complete is still committed below, so this is an
        # interruption like the first signal's (manifest, exit 130/143, --resume).
        record.status = "interrupted"
        raise Interrupted(stop_signal.signum or signal.SIGINT) from None
    except BaseException as err:  # not a user error: a bug in graphrun or in the model
        record.error = f"{type(err).__name__}: {err}"  # the manifest says why it failed
        raise
    finally:
        stop_signal.hold()  # a signal now must not cut the commit and manifest below short
        manifest = held.finish(record, progress)
    if record.late_error is not None:  # the stream ended well, but its bookkeeping did not
        raise OutputError(f"{record.late_error}; {record.late_remedy}")
    return manifest


def new_job(spec, out, overlap, tuning: Tuning | None, clock: PhaseClock | None = None,
            hashes: RunHashes | None = None, parts: JobParts | None = None,
            window: tuple = (0, None)) -> tuple[RunRecord, RunResources, object]:
    """What the run records and what it holds (the hashes started), its spec's `buckets: auto`
    planned (plan/auto.py) from the job's slice of the input (window: [start, stop), a
    worker's job's, not its share), and the overlap choice (the caller's, else
    GRAPHRUN_OVERLAP's; None: by the device)."""
    how = "set by run()'s overlap" if overlap is not None else f"set by {OVERLAP_ENV}"
    overlap, parts = overlap_choice(overlap), parts or JobParts()
    started = DeviceStart.begin(spec)  # the CUDA context, on a thread beside what follows
    if spec.generate is not None:  # and a generation job's kernels (the CLI's begun already)
        from graphrun.generate.runner import begin_warm_up

        begin_warm_up(spec, started)
    with phase("bucket plan"):
        spec, bucket_plan = parts.plan(with_implied_io(spec), window=window)
    out_dir = Path(out).resolve() if out else spec.output.dir
    with phase("input hash start"):  # a child process for the input, a thread for the model
        record = RunRecord(spec, out_dir, resolved_json(spec), clock or PhaseClock(),
                           bucket_plan=bucket_plan, overlap_how=how)
        held = RunResources(spec, out_dir, tuning=tuning or Tuning.from_machine(),
                            device_start=started, hashes=hashes, parts=parts)
    return record, held, overlap


def resolved_json(spec) -> dict:
    """The resolved spec as run.json and the manifest record it: a generation job's implied
    inputs and outputs left out, as its user wrote none."""
    dumped = spec.model_dump(mode="json")
    if spec.generate is not None:
        dumped["inputs"], dumped["outputs"] = {}, {}
    return dumped


def open_out_dir(record: RunRecord, held: RunResources, fingerprint: dict, resume: bool,
                 overwrite: bool, start: int, accept_model_change: bool = False):
    """The output folder made ready (or its committed part found, for --resume); returns the
    resume point and the first input ordinal to read."""
    try:
        with phase("output folder"):
            resume_point = prepare_out_dir(
                record.out_dir, resume=resume, overwrite=overwrite, fingerprint=fingerprint,
                input_path=record.spec.data.path, model=held.model_files,
                accept_model_change=accept_model_change, spec=record.spec_json,
                shard_dir=held.place.folder if held.place else None)
    except OSError as err:
        raise unusable_folder(record.out_dir, err) from err
    if resume_point is not None:
        record.resumed(resume_point)
        start = max(start, resume_point.start)
    return resume_point, start


def run_stream(record: RunRecord, held: RunResources, fingerprint: dict, resume_point,
               start: int, stop, overlap, progress, stop_signal, show: bool) -> None:
    """Setup beside the first batch's reading and the outputs' opening, then the stream. What
    it opens goes on `held`, which closes it whatever happens (RunResources.finish); what it
    counts and times, on `record`."""
    spec, parts = record.spec, held.parts
    with phase("output open"):
        # the writer and latencies.jsonl (in the folder prepared above) open beside setup too
        opening = beside(open_sinks, held, resume_point, start)
        # the progress bar's total: a line count for JSONL, on a daemon thread a failed setup
        # does not wait for
        counting = beside(parts.count_records, spec, start, stop, daemon=True) if show else None
    try:
        # then the first batch is read while the runner sets up (started after the threads
        # above: a thread's start waits for the GIL, which the reader's imports hold): for a
        # Parquet file, its first row groups decode meanwhile, not while the device waits
        with phase("reader start"):
            record.padding = PaddingCount(spec) if spec.data.group_by_length else None
            record.cuts = TextCuts(spec, record.count_from) if spec.data.text is not None else None
            ids_from = held.place.job_start if held.place else fingerprint["slice"][0] or 0
            batches = parts.read_batches(spec, start=start, stop=stop, ids_from=ids_from,
                                         tuning=held.tuning, padding=record.padding,
                                         cuts=record.cuts)
            held.reader = ReadAhead(padded_batches(batches, spec),
                                    ahead=look_ahead(spec),
                                    hold_bytes=held.tuning.read_ahead_bytes)
            for said in parameter_warnings(spec, lambda: first_fields(spec.data.path)):
                (record.print_and_warn if show else record.warn)(said)
        engine: type[JobRunner] = parts.engine(spec)
        held.runner = runner = engine(spec, log=record.print_and_warn if show else record.warn,
                                      needs=data_needs(spec, held.reader, record.bucket_plan),
                                      started=held.device_start)
        if spec.report.baseline == "eager":
            with phase("eager baseline"):
                runner.measure_baseline()
    except BaseException:
        take_sinks(record, held, opening, quiet=True)  # setup's error is the one to report
        raise
    with phase("output open"):
        take_sinks(record, held, opening)
        progress.set_total(counting.result() if counting else None)
        if spec.generate is not None:
            progress.count_tokens(lambda: runner.output_tokens)
    if fingerprint["input_sha256"] is None:
        # not beside the stream: reading the file to hash it slows the stream's reads
        held.record_hashes(record, fingerprint)
    if overlap is None:
        overlap, record.overlap_how = runner.default_path
    record.overlapped = overlap
    if overlap:  # the overlapped path's pinned slots: setup, not the stream
        with phase("host slots"):
            runner.launcher.make_room(True)
    if spec.generate is not None:  # completions that finish out of order, kept as they do
        held.finished = FinishedLog.open(held.out_dir, lambda: held.run_key(fingerprint), start,
                                         lambda: held.writer.committed_from)
        runner.launcher.keep(held.finished)
    record.stream_t0 = time.perf_counter()
    progress.streaming()
    stop_signal.streaming()  # from here a signal lets the batch in flight finish
    with phase("stream"):
        record.host_s = parts.feed_stream(
            runner.launcher, held.reader, held.writer, oversize=spec.data.oversize,
            on_batches=lambda ran, n, first: record.log_batches(held.latencies, ran, n, first),
            on_read=record.count, on_done=lambda done: progress.advance(
                record.new(done), taken_back=held.finished.given_among(done, record.count_from)
                if held.finished is not None else 0),
            should_stop=lambda: bool(stop_signal.signum), start=start, overlap=overlap)
    # Full shards commit in the background: the stream is over once they are
    # journaled (and a commit that failed fails the run here, with its manifest).
    with phase("drain and fsync"):
        held.writer.wait_for_commits()


def open_sinks(held: RunResources, resume_point, start: int):
    """The writer (its leftovers from an interrupted run restored, for --resume), and
    latencies.jsonl (cut back to where reading restarts). Runs on a thread of its own beside
    setup: none of it needs the model."""
    writer = held.parts.writer(held.spec, held.out_dir, resume=resume_point,
                               tuning=held.tuning, place=held.place)
    latencies = None
    try:
        latencies = held.parts.open_latencies(held.out_dir / "latencies.jsonl",
                                              keep_below=start if resume_point else None)
        writer.on_hand_over = latencies.flush  # a shard's batches logged before it commits
    except BaseException:  # nothing written yet: closed as they are
        if latencies is not None:
            latencies.close()
        writer.close(partial=False)
        raise
    return writer, latencies


def beside(fn, *args, daemon: bool = False) -> Future:
    """fn(*args) on a thread of its own; the Future's result() waits and returns or raises.
    A daemon thread is not waited for at the process's exit."""
    done: Future = Future()

    def call():
        try:
            done.set_result(fn(*args))
        except BaseException as err:  # noqa: BLE001 - handed to the caller through result()
            done.set_exception(err)

    threading.Thread(target=call, name=f"graphrun-{getattr(fn, '__name__', 'call')}",
                     daemon=daemon).start()
    return done


def take_sinks(record: RunRecord, held: RunResources, opening: Future,
               quiet: bool = False) -> None:
    """What open_sinks opened, on `held` (which closes it); quiet: its error is dropped (an
    error of setup is on its way: the one the user sees)."""
    try:
        held.writer, held.latencies = opening.result()
    except Exception:
        if not quiet:
            raise
        return
    record.batches_before = held.latencies.lines_before
